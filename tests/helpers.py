"""Tolerances and comparisons against the float64 reference."""
import torch
from torch import nn

from gradfuse.ops import reference


def acc_eps(dtype: torch.dtype) -> float:
    # Accumulation happens in float32 (float64 for float64 input); inputs are exact in that type.
    return 1e-12 if dtype == torch.float64 else 1e-5


def acc_tiny(dtype: torch.dtype) -> float:
    # The accumulator's smallest normal number: a square or power below it loses all its
    # relative precision (1e-30 in bf16 squares to 1e-60, which is 0 in float32).
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).tiny


def assert_stats_close(tensors, got, norm_type=2.0, expected=None):
    """Compares compiled (floats, counts) with the reference computed in float64, or with
    `expected`, another backend's result (then both may be off by the tolerance)."""
    f, c = got
    if expected is None:
        rf, rc = reference.multi_tensor_stats([t.cpu() for t in tensors], norm_type)
        slack = 1
    else:
        rf, rc = (t.cpu() for t in expected)
        slack = 2
    f, c = f.cpu(), c.cpu()
    assert f.dtype == torch.float64 and c.dtype == torch.int64
    assert f.shape == rf.shape and c.shape == rc.shape
    torch.testing.assert_close(c, rc, rtol=0, atol=0)
    for i, t in enumerate(tensors):
        x = t.detach().cpu().double().reshape(-1)
        finite = x[x.isfinite()]
        eps = acc_eps(t.dtype)
        underflow = acc_tiny(t.dtype) * x.numel()
        # Error bounds scale with the sum of magnitudes, not the (possibly cancelling) result.
        scale = {0: finite.abs().sum().item(), 1: (finite * finite).sum().item(),
                 2: 0.0, 3: rf[i, 3].abs().item()}
        for col in range(4):
            a, b = f[i, col].item(), rf[i, col].item()
            if b != b:
                assert a != a, f"tensor {i} col {col}: expected NaN, got {a}"
            elif abs(b) == float("inf"):
                assert a == b, f"tensor {i} col {col}: expected {b}, got {a}"
            else:
                tol = slack * eps * (scale[col] + abs(b)) * max(1, x.numel() ** 0.5 / 64) + underflow
                assert abs(a - b) <= tol, f"tensor {i} col {col}: {a} vs {b} (tol {tol})"


def assert_same_stats(a, b):
    """Bitwise equal GradStats: rows, names, total norm (value and dtype), clip coefficient."""
    assert a.names == b.names
    assert torch.equal(a.floats, b.floats) and torch.equal(a.counts, b.counts)
    assert a.total_norm.dtype == b.total_norm.dtype
    torch.testing.assert_close(a.total_norm, b.total_norm, rtol=0, atol=0, equal_nan=True)
    assert (a.clip_coef is None) == (b.clip_coef is None)
    if a.clip_coef is not None:
        torch.testing.assert_close(a.clip_coef, b.clip_coef, rtol=0, atol=0, equal_nan=True)
        assert a.max_norm == b.max_norm


def clone_named(named):
    """Parameters and gradients copied with the same names, shapes, strides, dtypes and layouts
    (a sparse gradient cloned; a gradient of another dtype kept, with grad_dtype=None)."""
    out = []
    for name, p in named:
        q = nn.Parameter(p.detach().clone())
        if p.grad is not None:
            if p.grad.dtype != q.dtype:
                q.grad_dtype = None
            if p.grad.layout != torch.strided:
                q.grad = p.grad.clone()
            else:
                q.grad = torch.empty_strided(p.grad.shape, p.grad.stride(), dtype=p.grad.dtype).copy_(p.grad)
        out.append((name, q))
    return out
