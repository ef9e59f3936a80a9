"""Tolerances and comparisons against the float64 reference."""
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


def two_pass_m2(t: torch.Tensor) -> float:
    """Sum of squared deviations from the mean, in float64 by two passes (the oracle of M2)."""
    x = t.detach().cpu().double().reshape(-1)
    return float(((x - x.mean()) ** 2).sum()) if x.numel() else 0.0


def assert_moments_close(tensors, got, expected=None):
    """multi_tensor_moments rows: M2 within 2e-5 relative of the float64 two-pass M2 (float
    accumulators; 1e-12 for float64 data), NaN where a tensor holds NaN or Inf; every other column
    as assert_stats_close (against the reference, or `expected`). Returns the oracle's M2s."""
    f, c = got
    other = None if expected is None else (expected[0].clone(), expected[1])
    if other is not None:
        other[0][:, 3] = 0
    rest = f.clone()
    rest[:, 3] = 0  # the power sum of norm_type 2 is 0 in the reference
    assert_stats_close(tensors, (rest, c), 2.0, expected=other)
    m2s = []
    for i, t in enumerate(tensors):
        m2 = two_pass_m2(t)
        got_m2 = f[i, 3].item()
        if not bool(t.detach().isfinite().all()):
            assert got_m2 != got_m2, f"tensor {i}: expected NaN, got {got_m2}"
        else:
            rtol = 1e-12 if t.dtype == torch.float64 else 2e-5
            assert abs(got_m2 - m2) <= rtol * m2, f"tensor {i} ({t.numel()} elements): M2 {got_m2} vs {m2}"
        m2s.append(m2)
    return m2s


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


class NoFloat64(TorchDispatchMode):
    """Fails any op with a float64 tensor among its inputs or outputs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float64, torch.complex128):
                raise AssertionError(f"{func} used a {t.dtype} tensor")
        return out


class ListSink:
    """A monitor sink that keeps every record it is given, in ``records``."""

    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)
