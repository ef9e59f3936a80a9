"""The stats and scale ops against the float64 reference: values, exact counts, layouts, sizes."""
import math

import pytest
import torch
from helpers import assert_stats_close
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfuse import ops
from gradfuse.ops import library

pytestmark = pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")

stats_op = torch.ops.gradfuse.multi_tensor_stats
scale_op = torch.ops.gradfuse.multi_tensor_scale_
CHUNK = 65536


def randn(n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype).to(device)


@pytest.mark.parametrize("sizes", [[1], [7, 0, 13], [CHUNK], [CHUNK + 1, CHUNK - 1, 3 * CHUNK + 17],
                                   [0], [0, 0], [1000003]])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, 0.5, math.inf, 0.0])
def test_stats_matches_reference(device, dtype, cpu_capability, sizes, norm_type):
    tensors = [randn(n, dtype, device, seed=i) for i, n in enumerate(sizes)]
    assert_stats_close(tensors, stats_op(tensors, norm_type), norm_type)


def test_planted_nan_inf_zero_counts_exact(device, dtype, cpu_capability):
    n = 3 * CHUNK + 1001
    x = randn(n, dtype, device) + 10  # no accidental zeros
    nan_at = [0, 5, CHUNK, n - 1]
    inf_at = [1, CHUNK + 7, 2 * CHUNK + 3]
    ninf_at = [17]
    zero_at = [2, 3, 4, CHUNK - 1, 2 * CHUNK, n - 2]
    x[nan_at] = math.nan
    x[inf_at] = math.inf
    x[ninf_at] = -math.inf
    x[zero_at] = 0.0
    x[CHUNK + 100] = -0.0
    f, c = stats_op([x], 2.0)
    assert c[0].tolist() == [4, 4, 7, n]
    assert math.isnan(f[0, 0]) and math.isnan(f[0, 1]) and math.isnan(f[0, 2])


def test_inf_without_nan_propagates(device, dtype, cpu_capability):
    x = randn(CHUNK + 5, dtype, device)
    x[CHUNK + 2] = -math.inf
    f, c = stats_op([x], 2.0)
    assert f[0, 1].item() == math.inf and f[0, 2].item() == math.inf and f[0, 0].item() == -math.inf
    assert c[0, 1].item() == 1 and c[0, 0].item() == 0


def test_fp16_squares_do_not_overflow(device):
    x = torch.full((1000,), 60000.0, dtype=torch.float16, device=device)  # 60000^2 > fp16 max
    f, c = stats_op([x], 2.0)
    assert math.isclose(f[0, 1].item(), 1000 * 60000.0 ** 2, rel_tol=1e-5)
    assert c[0, 1].item() == 0


def test_empty_list_and_empty_tensors(device, dtype):
    # An empty list has no device for the dispatcher: the Python wrappers answer it.
    f, c = ops.multi_tensor_stats([], 2.0)
    ops.multi_tensor_scale_([], torch.tensor(0.5))
    assert f.shape == (0, 4) and c.shape == (0, 4)
    f, c = stats_op([torch.empty(0, dtype=dtype, device=device)], math.inf)
    assert f.tolist() == [[0.0, 0.0, 0.0, 0.0]] and c.tolist() == [[0, 0, 0, 0]]


def test_empty_tensors_do_not_shift_rows(device, dtype, cpu_capability):
    # Zero-size tensors must not shift per-tensor indices (github.com/pytorch/pytorch/issues/140066).
    tensors = []
    for i in range(50):
        n = 0 if i % 3 == 0 else (i * 977) % (2 * CHUNK)
        tensors.append(torch.full((n,), float(i + 1), dtype=dtype, device=device))
    f, c = stats_op(tensors, 2.0)
    for i, t in enumerate(tensors):
        assert c[i, 3].item() == t.numel()
        assert f[i, 2].item() == (float(i + 1) if t.numel() else 0.0)


@pytest.mark.parametrize("offset", [1, 3, 5])
def test_unaligned_views(device, dtype, cpu_capability, offset):
    base = randn(2 * CHUNK + 64, dtype, device)
    views = [base[offset:], base[offset:offset + 1], base[offset:CHUNK + offset + 9]]
    for v in views:
        assert v.storage_offset() == offset
    assert_stats_close(views, stats_op(views, 2.0))


def test_non_contiguous_inputs(device, dtype, cpu_capability):
    m = randn(300 * 517, dtype, device).reshape(300, 517)
    tensors = [m.t(), m[:, ::2], m[::3, 5:400], m.unsqueeze(0).expand(3, 300, 517),
               m.reshape(300, 11, 47).permute(2, 0, 1)]
    assert_stats_close(tensors, stats_op(tensors, 2.0))
    assert_stats_close(tensors, stats_op(tensors, 3.0), 3.0)


def test_channels_last_needs_no_copy_and_is_right(device, dtype):
    x = randn(2 * 3 * 33 * 35, dtype, device).reshape(2, 3, 33, 35).to(memory_format=torch.channels_last)
    assert_stats_close([x], stats_op([x], 2.0))


def test_many_tensors(device):
    # 100 000 tensors of 0..6 elements: exercises the plan, and the CUDA launch tables.
    sizes = [i % 7 for i in range(100_000)]
    flat = randn(sum(sizes), torch.float32, device)
    tensors = list(flat.split(sizes))
    f, c = stats_op(tensors, 2.0)
    assert c[:, 3].tolist() == sizes
    idx = torch.repeat_interleave(torch.arange(len(sizes), device=device),
                                  torch.tensor(sizes, device=device))
    expect_sumsq = torch.zeros(len(sizes), dtype=torch.float64, device=device).index_add_(
        0, idx, flat.double() ** 2)
    torch.testing.assert_close(f[:, 1], expect_sumsq, rtol=1e-6, atol=1e-12)


def test_deterministic_across_thread_counts(dtype, cpu_capability):
    tensors = [randn(n, dtype, "cpu", seed=n) for n in (5 * CHUNK + 3, 17, 2 * CHUNK, 999_999)]
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3, before):
            torch.set_num_threads(threads)
            results.append(stats_op(tensors, 2.0))
    finally:
        torch.set_num_threads(before)
    for f, c in results[1:]:
        assert torch.equal(f, results[0][0]) and torch.equal(c, results[0][1])


def test_cpu_builds_agree_closely(dtype):
    if library.extension.build_info()["best_cpu_capability"] != "avx2":
        pytest.skip("only one CPU build on this machine")
    tensors = [randn(n, dtype, "cpu", seed=n) for n in (3 * CHUNK + 3, 100)]
    got = {}
    before = library.extension.cpu_capability()
    try:
        for isa in ("avx2", "default"):
            library.extension.set_cpu_capability(isa)
            got[isa] = stats_op(tensors, 2.0)
    finally:
        library.extension.set_cpu_capability(before)
    torch.testing.assert_close(got["avx2"][1], got["default"][1], rtol=0, atol=0)
    torch.testing.assert_close(got["avx2"][0], got["default"][0], rtol=1e-5, atol=1e-6)


def test_scale(device, dtype, cpu_capability):
    tensors = [randn(n, dtype, device, seed=n) for n in (CHUNK + 3, 0, 5, 2 * CHUNK)]
    tensors.append(randn(CHUNK + 10, dtype, device)[3:])  # unaligned
    expect = [t.clone() for t in tensors]
    coef = torch.tensor(0.25, dtype=torch.float32, device=device)
    scale_op(tensors, coef)
    torch._foreach_mul_(expect, coef.to(dtype))
    for a, b in zip(tensors, expect):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def every_16bit_pattern(dtype, seed):
    """All 65 536 bit patterns of a 16-bit float (NaN payloads of both signs, Inf, subnormals,
    -0.0), shuffled, then normal values near 1 (whose products round in every way)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)[torch.randperm(65536, generator=g)]
    near_one = torch.empty(40000, dtype=torch.float32).uniform_(0.5, 4.0, generator=g).to(dtype)
    return torch.cat([bits.view(dtype), near_one])


def same_bits_or_both_nan(got, expect):
    """Bitwise equal where the expected value is a number (and -0.0 kept); NaN where it is NaN."""
    nan = expect.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], expect.view(torch.int16)[~nan])


# Coefficients exact in float32, as the kernels take them: clip coefficients, a product that
# overflows the dtype, one that underflows to subnormals and zero, 0 (0 * Inf is NaN), NaN.
SCALE_COEFS = [0.37, 0.5, 0.999, 1e-3, 1e-6, 3.0, 300.0, 0.0, -0.75, math.nan]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("conditional", [False, True], ids=["always", "conditional"])
def test_16bit_scale_matches_torch_mul_bitwise(dtype, cpu_capability, conditional):
    x = every_16bit_pattern(dtype, seed=0)
    # whole, odd lengths and unaligned starts: every split into 16-element steps and a tail
    cuts = [(0, x.numel()), (1, 4097), (3, 18), (5, 5 + 47), (7, 7 + 15), (2, 2 + 16), (9, 9 + 33)]
    for c in SCALE_COEFS:
        c32 = float(torch.tensor(c, dtype=torch.float32))
        for lo, hi in cuts:
            got, expect = x.clone(), x.clone()
            scale_op([got[lo:hi]], torch.tensor(c32), conditional)
            if not conditional or not c32 >= 1.0:
                expect[lo:hi].mul_(c32)  # torch: the product in float32, rounded to nearest even
            same_bits_or_both_nan(got, expect)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16bit_unit_scale_matches_torch_mul_bitwise(dtype, cpu_capability):
    x = every_16bit_pattern(dtype, seed=1)
    tensors = [x[3:70001], x[:1000].clone(), x[7:7 + 31].clone(), x[70003:70003 + 65]]  # unaligned views
    coefs = torch.tensor([0.37, 3.0, 1e-3, 0.0], dtype=torch.float32)
    expect = [t.clone() for t in tensors]
    for t, c in zip(expect, coefs.tolist()):
        t.mul_(c)
    ops.multi_tensor_scale_per_tensor_(tensors, coefs, False)
    for got, exp in zip(tensors, expect):
        same_bits_or_both_nan(got, exp)


@pytest.mark.parametrize("value", [1.0, 2.0])
def test_scale_is_noop_when_coef_at_least_one(device, dtype, value):
    x = randn(CHUNK + 3, dtype, device)
    x[0] = math.nan
    before = x.clone()
    scale_op([x], torch.tensor(value, device=device))
    assert torch.equal(x.isnan(), before.isnan())
    assert torch.equal(x.nan_to_num(), before.nan_to_num())


def test_scale_by_nan_poisons_like_torch(device, dtype):
    x = randn(100, dtype, device)
    scale_op([x], torch.tensor(math.nan, device=device))
    assert x.isnan().all()


def test_scale_non_contiguous(device, dtype):
    m = randn(64 * 33, dtype, device).reshape(64, 33)
    expect = m.clone()
    scale_op([m[:, ::2], m[1::2, :].t()], torch.tensor(0.5, device=device))
    expect[:, ::2] *= 0.5
    expect[1::2, :] *= 0.5
    torch.testing.assert_close(m, expect, rtol=0, atol=0)


def test_bad_inputs_raise_clear_errors(device):
    x = torch.ones(3, device=device)
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Int"):
        stats_op([x, torch.ones(3, dtype=torch.int32, device=device)], 2.0)
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Double but tensors\[0\] has Float"):
        stats_op([x, torch.ones(3, dtype=torch.float64, device=device)], 2.0)
    with pytest.raises(RuntimeError, match=r"tensors\[0\] has dtype ComplexFloat"):
        stats_op([torch.ones(3, dtype=torch.complex64, device=device)], 2.0)
    with pytest.raises(RuntimeError, match="one-element"):
        scale_op([x], torch.ones(2, device=device))


special = st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-30, 65504.0, -3.5])


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * CHUNK // 2), min_size=0, max_size=6),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       norm_type=st.sampled_from([2.0, 1.0, math.inf, 2.5]),
       plants=st.lists(st.tuples(st.integers(0, 10**9), special), max_size=20),
       offset=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1))
def test_property_random_groups(sizes, dtype, norm_type, plants, offset, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for n in sizes:
        base = (torch.randn(n + offset, generator=g, dtype=torch.float64) * 3).to(dtype)
        tensors.append(base[offset:])
    for pos, value in plants:
        nonempty = [t for t in tensors if t.numel()]
        if nonempty:
            t = nonempty[pos % len(nonempty)]
            t[pos % t.numel()] = value
    assert_stats_close(tensors, ops.multi_tensor_stats(tensors, norm_type), norm_type)
