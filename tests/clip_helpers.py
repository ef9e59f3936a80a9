"""Comparisons of per-unit statistics (gradfuse.ops.multi_tensor_unit_stats) with the float64
reference, vectorised over units (tens of thousands of units per call): the tolerances of
helpers.assert_stats_close, row by row."""
import torch
from helpers import acc_eps, acc_tiny

from gradfuse.ops import reference


def assert_unit_stats_close(tensors, units, got, norm_type=2.0, expected=None):
    """Compares (floats, counts) of every unit with the reference computed in float64 or, when
    given, with `expected`, another backend's result (then both may be off by the tolerance)."""
    f, c = (t.cpu() for t in got)
    tensors = [t.detach().cpu() for t in tensors]
    if expected is None:
        rf, rc = reference.multi_tensor_unit_stats(tensors, units, norm_type)
        slack = 1
    else:
        rf, rc = (t.cpu() for t in expected)
        slack = 2
    assert f.dtype == torch.float64 and c.dtype == torch.int64
    assert f.shape == rf.shape == (sum(units), 4) and c.shape == rc.shape
    torch.testing.assert_close(c, rc, rtol=0, atol=0)
    row = 0
    for i, (t, u) in enumerate(zip(tensors, units)):
        if u == 0:
            continue
        x = t.reshape(u, -1).double()
        length = x.shape[1]
        finite = torch.where(x.isfinite(), x, torch.zeros_like(x))
        scale = torch.stack([finite.abs().sum(1), (finite * finite).sum(1), torch.zeros(u, dtype=torch.float64),
                             rf[row:row + u, 3].abs()], 1)
        a, b = f[row:row + u], rf[row:row + u]
        nan_b, inf_b = b.isnan(), b.isinf()
        assert torch.equal(a.isnan(), nan_b), f"tensor {i}: NaN rows differ"
        assert torch.equal(a[inf_b], b[inf_b]), f"tensor {i}: Inf rows differ"
        tol = slack * acc_eps(t.dtype) * (scale + b.abs()) * max(1.0, length ** 0.5 / 64) + acc_tiny(t.dtype) * length
        ok = ((a - b).abs() <= tol) | nan_b | inf_b
        if not ok.all():
            r, col = (~ok).nonzero()[0].tolist()
            raise AssertionError(f"tensor {i} unit {r} col {col}: {a[r, col].item()} vs {b[r, col].item()} "
                                 f"(tol {tol[r, col].item()})")
        row += u
