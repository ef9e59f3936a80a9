"""multi_tensor_moments: the stats rows with the sum of squared deviations from the mean (M2),
against a float64 two-pass reference, on data whose mean is far from zero compared with its
spread, where sum x^2 - (sum x)^2 / n has no digit left."""
import math

import pytest
import torch
from helpers import assert_moments_close, two_pass_m2

from gradfuse import ops
from gradfuse.ops import library
from gradfuse.ops.layout import M2, MAXABS, SUM, SUMSQ

pytestmark = pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")

moments_op = torch.ops.gradfuse.multi_tensor_moments
stats_op = torch.ops.gradfuse.multi_tensor_stats
CHUNK = 65536
SIZES = [2, 7, 15, 16, 17, 33, 1000, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def offset_data(n, dtype, offset, spread, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (offset + spread * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)


def check_rows(tensors, floats, counts):
    """Every row against the float64 two-pass M2 and the reference stats; a spread to compare."""
    m2s = assert_moments_close(tensors, (floats, counts))
    assert all(m2 > 0 for m2 in m2s), "the data must have a spread to compare"


@pytest.mark.parametrize("offset,spread", [(0.0, 1.0), (100.0, 0.25), (1e4, 0.25), (1e6, 1.0),
                                           (-3e7, 30.0)])
def test_variance_keeps_its_digits_far_from_zero(dtype, cpu_capability, offset, spread):
    if dtype in (torch.float16, torch.bfloat16):  # within their range and spacing
        offset = math.copysign(min(abs(offset), 1e4), offset)
        spread = max(spread, abs(offset) * (2 ** -6 if dtype == torch.float16 else 2 ** -3))
    tensors = [offset_data(n, dtype, offset, spread, seed=i) for i, n in enumerate(SIZES)]
    floats, counts = moments_op(tensors)
    check_rows(tensors, floats, counts)


def test_the_unshifted_formula_fails_where_moments_do_not(cpu_capability):
    """What the op is for: float32 data with |mean| / std = 1e6."""
    x = offset_data(100_000, torch.float32, 1e6, 1.0)
    m2 = two_pass_m2(x)
    floats, _ = stats_op([x], 2.0)
    naive = floats[0, SUMSQ].item() - floats[0, SUM].item() ** 2 / x.numel()
    assert abs(naive - m2) / m2 > 1e-2
    got = moments_op([x])[0][0, M2].item()
    assert abs(got - m2) / m2 < 1e-5


@pytest.mark.parametrize("outliers", [[0], [0, -1], [0, 50_001], [25_000, 75_001], [0, 1, 2, 3]])
def test_an_outlier_where_the_shift_is_read(cpu_capability, outliers):
    """A start token's activations are often far out: the first element (and a second sampled
    position) 300 spreads away must not cost digits. Four outliers in a row (only one of them
    sampled) neither."""
    x = offset_data(100_003, torch.float32, 1e6, 1.0)
    for i in outliers:
        x[i] = 1e6 + 300.0
    floats, counts = moments_op([x])
    check_rows([x], floats, counts)


def test_reference_matches_the_kernels(dtype):
    tensors = [offset_data(n, dtype, 300.0, 2.0, seed=i) for i, n in enumerate([3, 100, CHUNK + 9])]
    floats, counts = ops.reference.multi_tensor_moments(tensors)
    check_rows(tensors, floats, counts)


def test_reference_float32_rows_are_accurate():
    """The float32 path (devices without float64) computes M2 in float32 by a corrected two-pass."""
    x = offset_data(50_000, torch.float32, 1e6, 1.0)
    d = x - x.mean()
    m2 = float(d.square().sum() - d.sum() ** 2 / x.numel())
    assert m2 == pytest.approx(two_pass_m2(x), rel=1e-4)


def test_split_over_threads_and_ranges(dtype):
    """Large tensors split across the parallel blocks are combined with their one shift."""
    torch.set_num_threads(2)
    tensors = [offset_data(n, dtype, 50.0, 0.5, seed=n) for n in (5_000_003, 17, 2 * CHUNK + 1, 1_200_000)]
    floats, counts = moments_op(tensors)
    check_rows(tensors, floats, counts)


def test_views_empty_and_single(cpu_capability):
    base = offset_data(4 * CHUNK + 3, torch.float32, 1e5, 1.0)
    tensors = [base[1:], base[3:CHUNK + 20], base[::3], torch.empty(0), base[:1]]
    floats, counts = moments_op(tensors)
    check_rows(tensors[:3], floats[:3], counts[:3])
    assert floats[3].tolist() == [0.0, 0.0, 0.0, 0.0] and counts[3].tolist() == [0, 0, 0, 0]
    assert floats[4, M2].item() == 0.0 and floats[4, SUM].item() == base[0].item()


@pytest.mark.parametrize("where", [0, 1, CHUNK + 3])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_rows(dtype, cpu_capability, where, value):
    x = offset_data(2 * CHUNK + 11, dtype, 20.0, 1.0)
    x[where] = value
    floats, counts = moments_op([x])
    s_floats, s_counts = stats_op([x], 2.0)
    assert torch.equal(counts, s_counts)
    assert math.isnan(floats[0, M2].item())
    # the sum is what an unshifted sum gives (+-inf, or NaN), also when the first element is not finite
    assert floats[0, SUM].item() == pytest.approx(s_floats[0, SUM].item(), nan_ok=True)
    assert floats[0, MAXABS].item() == pytest.approx(s_floats[0, MAXABS].item(), nan_ok=True)


def test_finite_float64_values_whose_spread_overflows(cpu_capability):
    """[1, 2, 1e300]: the sum of squared deviations overflows to +Inf, as a float64 two-pass gives
    it; the finish of the shifted sums must not turn it into Inf - Inf = NaN."""
    x = torch.tensor([1.0, 2.0, 1e300], dtype=torch.float64)
    floats, counts = moments_op([x, -x])
    assert two_pass_m2(x) == math.inf
    assert floats[:, M2].tolist() == [math.inf, math.inf]
    assert floats[:, SUM].tolist() == [x.sum().item(), -x.sum().item()]
    assert counts[:, 0].tolist() == [0, 0] and counts[:, 1].tolist() == [0, 0]  # finite data


def test_empty_list_and_mixed_lists_are_refused():
    floats, counts = ops.multi_tensor_moments([])  # (an empty list has no device to dispatch on)
    assert floats.shape == (0, 4) and counts.shape == (0, 4)
    with pytest.raises(RuntimeError, match=r"tensors\[1\]"):
        moments_op([torch.ones(3), torch.ones(3, dtype=torch.float64)])


def test_python_wrapper_routes_to_the_kernel():
    x = offset_data(1000, torch.float32, 1e6, 1.0)
    assert torch.equal(ops.multi_tensor_moments([x])[0], moments_op([x])[0])
