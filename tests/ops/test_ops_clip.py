"""The clipping ops (gradfuse.ops: per-tensor / per-unit scale, unit statistics, clamp
by value): the pure-PyTorch reference against plain torch, and the compiled CPU ops (both CPU
builds) against the reference, bit for bit where the arithmetic is the same."""
import math

import pytest
import torch
from clip_helpers import assert_unit_stats_close
from helpers import assert_stats_close
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfuse import ops
from gradfuse.ops import library, reference

CHUNK = 65536
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
HAVE_CLIP_OPS = library.extension is not None and hasattr(torch.ops.gradfuse, "multi_tensor_clamp_")


def randn(shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def unit_rows_expected(t, u):
    """Float64 statistics per unit, from plain torch ops on each block."""
    x = t.detach().reshape(u, -1).double()
    return x.sum(1), (x * x).sum(1), torch.linalg.vector_norm(x, math.inf, dim=1) if x.shape[1] else x.new_zeros(u)


# ---------------------------------------------------------------- the reference vs plain torch

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_unit_stats_match_torch_norms(dtype):
    w = randn((37, 5, 3), dtype, seed=1)
    b = randn((11,), dtype, seed=2)
    e = torch.empty((0, 4), dtype=dtype)
    f, c = reference.multi_tensor_unit_stats([w, b, e, w], [37, 1, 0, 1], 3.0)
    assert f.shape == (37 + 1 + 0 + 1, 4) and c.shape == f.shape
    # timm's AGC norm: over dims 1.. per output unit
    expect = w.double().norm(2, dim=(1, 2))
    torch.testing.assert_close(f[:37, 1].sqrt(), expect, rtol=1e-12, atol=0)
    torch.testing.assert_close(f[:37, 3], w.double().abs().pow(3).sum((1, 2)), rtol=1e-12, atol=0)
    torch.testing.assert_close(f[:37, 2], w.double().abs().amax((1, 2)))
    torch.testing.assert_close(f[37, 1], b.double().square().sum())
    torch.testing.assert_close(f[38:], reference.multi_tensor_stats([w], 3.0)[0])
    assert c[:37, 3].tolist() == [15] * 37 and c[37, 3] == 11
    assert f[:, 1].gt(0).all()  # something was compared


def test_reference_unit_stats_special_values_and_bad_units():
    x = torch.zeros(4, 3)
    x[0, 1] = math.nan
    x[2, 2] = -math.inf
    x[3] = torch.tensor([1.0, -2.0, 0.0])
    f, c = reference.multi_tensor_unit_stats([x], [4])
    assert c.tolist() == [[1, 0, 2, 3], [0, 0, 3, 3], [0, 1, 2, 3], [0, 0, 1, 3]]
    assert math.isnan(f[0, 2]) and f[2, 2] == math.inf and f[3].tolist() == [-1.0, 5.0, 2.0, 0.0]
    with pytest.raises(RuntimeError, match=r"units\[0\] = 5 does not divide"):
        reference.multi_tensor_unit_stats([x], [5])
    with pytest.raises(RuntimeError, match="2 unit counts"):
        reference.multi_tensor_unit_stats([x], [4, 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("conditional", [True, False])
def test_reference_per_tensor_scale_matches_foreach_mul(dtype, conditional):
    tensors = [randn((n,), dtype, seed=n) for n in (5, 0, 130, CHUNK + 3)]
    coefs = torch.tensor([0.3, 0.7, 2.0, math.nan], dtype=torch.float64)
    expect = [t.clone() for t in tensors]
    acc = reference.acc_dtype(dtype)
    used = coefs.clamp(max=1.0) if conditional else coefs
    for t, c in zip(expect, used.to(acc)):
        t.copy_(t.to(acc) * c)
    reference.multi_tensor_scale_per_tensor_(tensors, coefs, conditional)
    for got, exp in zip(tensors, expect):
        torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
    # the coefficients did something: the first tensor shrank, the last is NaN
    assert tensors[3].isnan().all() and not torch.equal(tensors[0], randn((5,), dtype, seed=5))
    if dtype == torch.float32:  # a float32 coefficient: the same as torch._foreach_mul_
        ref = [randn((n,), dtype, seed=n) for n in (5, 130)]
        mine = [t.clone() for t in ref]
        c32 = torch.tensor([0.3, 0.7])
        torch._foreach_mul_(ref, list(c32.unbind()))
        reference.multi_tensor_scale_per_tensor_(mine, c32, conditional)
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reference_unit_scale_non_contiguous():
    base = randn((6, 8), torch.float32, seed=3)
    view = base.t()  # [8, 6], non-contiguous: units are its logical rows
    expect = view.clone() * torch.arange(8, dtype=torch.float32)[:, None] / 10
    coefs = torch.arange(8, dtype=torch.float32) / 10
    reference.multi_tensor_unit_scale_([view], [8], coefs, conditional=True)
    torch.testing.assert_close(view, expect, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="1-D tensor of 8 coefficients"):
        reference.multi_tensor_unit_scale_([view], [8], coefs[:3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("clip_value", [0.0, 0.1, 0.5, 1e6, math.inf])
def test_reference_clamp_matches_clip_grad_value(dtype, clip_value):
    tensors = [randn((n,), dtype, seed=n) for n in (1, 7, 1000, 0)]
    tensors[2][:6] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, -5.0])
    params = [torch.nn.Parameter(torch.zeros(t.shape, dtype=dtype)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    before = [t.clone() for t in tensors]
    if clip_value > torch.finfo(dtype).max and not math.isinf(clip_value):
        with pytest.raises(RuntimeError, match="overflow"):  # torch refuses; gradfuse clamps nothing
            torch.nn.utils.clip_grad_value_(params, clip_value, foreach=True)
    else:
        torch.nn.utils.clip_grad_value_(params, clip_value, foreach=True)
    f, c, clamped = reference.multi_tensor_clamp_(tensors, clip_value)
    for t, p, _ in zip(tensors, params, before):
        torch.testing.assert_close(t, p.grad, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(torch.signbit(t), torch.signbit(p.grad))
    expect_changed = [int(((t != b) & ~b.isnan()).sum()) for t, b in zip(tensors, before)]
    assert clamped.tolist() == expect_changed
    if clip_value == 0.5:
        assert clamped.sum() > 100  # clipping really happened
    assert_stats_close(before, (f, c))  # the statistics are of the values before clamping


def test_clip_value_checked():
    x = torch.ones(3)
    for bad in (-1.0, math.nan):
        with pytest.raises(RuntimeError, match="clip_value must be >= 0"):
            ops.multi_tensor_clamp_([x], bad)
    assert x.eq(1).all()


def test_ops_wrappers_answer_empty_lists_and_route():
    f, c = ops.multi_tensor_unit_stats([], [])
    assert f.shape == (0, 4) and c.shape == (0, 4)
    ops.multi_tensor_unit_scale_([], [], torch.empty(0))
    ops.multi_tensor_scale_per_tensor_([], torch.empty(0))
    f, c, clamped = ops.multi_tensor_clamp_([], 1.0)
    assert f.shape == (0, 4) and clamped.shape == (0,)
    w = randn((9, 4), torch.float32, seed=7)
    expect = w.clone() * torch.linspace(0.1, 0.9, 9)[:, None]
    ops.multi_tensor_unit_scale_([w], [9], torch.linspace(0.1, 0.9, 9))
    torch.testing.assert_close(w, expect, rtol=0, atol=0)


# ---------------------------------------------------------------- the compiled CPU ops

compiled = pytest.mark.skipif(not HAVE_CLIP_OPS, reason="gradfuse._C built without the clipping ops")


def unit_cases(dtype, seed=0):
    """(tensors, units): packed rows (short units), split rows (units over half a chunk, one or
    several pieces), whole tensors, empty tensors and empty units, rows of one element."""
    shapes_units = [((50, 768), 50), ((768,), 1), ((3, 70000), 3), ((5, 40000), 5), ((CHUNK * 3 + 5,), 1),
                    ((0, 5), 0), ((5, 0), 5), ((0,), 1), ((1000, 1), 1000), ((7, 3, 3), 7), ((1, 9), 1),
                    ((2, CHUNK // 2), 2), ((3, CHUNK // 2 + 1), 3), ((CHUNK + 1, 1), CHUNK + 1)]
    tensors = [randn(s, dtype, seed=seed + i) for i, (s, _) in enumerate(shapes_units)]
    return tensors, [u for _, u in shapes_units]


@compiled
@pytest.mark.parametrize("norm_type", [2.0, 3.0])
def test_unit_stats_matches_reference(dtype, cpu_capability, norm_type):
    tensors, units = unit_cases(dtype)
    got = ops.multi_tensor_unit_stats(tensors, units, norm_type)
    assert got[0].shape == (sum(units), 4)
    assert_unit_stats_close(tensors, units, got, norm_type)
    ref = reference.multi_tensor_unit_stats(tensors, units, norm_type)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    assert got[0][:, 1].gt(0).sum() > 50 + 1000  # non-trivial rows were compared


@compiled
def test_unit_stats_planted_values_and_views(dtype, cpu_capability):
    base = randn(40 * 3000 + 3, dtype, seed=4)
    w = base[3:].view(40, 3000)  # contiguous at an unaligned offset
    w[0, 5] = math.nan
    w[1, 7] = math.inf
    w[1, 8] = -math.inf
    w[2, :10] = 0.0
    w[3, 0] = -0.0
    w[39, 2999] = math.nan
    t = randn((300, 77), dtype, seed=5).t()  # non-contiguous: copied, units in logical order
    perm = randn((4, 6, 8), dtype, seed=6).permute(2, 0, 1)  # dense, permuted: units 1 needs no copy
    tensors, units = [w, t, perm, t], [40, 77, 1, 1]
    f, c = ops.multi_tensor_unit_stats(tensors, units)
    assert c[0].tolist() == [1, 0, 0, 3000] and c[1].tolist() == [0, 2, 0, 3000]
    assert c[2, 2] == 10 and c[3, 2] == 1 and c[39, 0] == 1 and math.isnan(f[0, 2]) and f[1, 2] == math.inf
    assert_unit_stats_close(tensors, units, (f, c))


@compiled
def test_unit_stats_deterministic_across_thread_counts(cpu_capability):
    tensors, units = unit_cases(torch.float32, seed=9)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(ops.multi_tensor_unit_stats(tensors, units))
    finally:
        torch.set_num_threads(before)
    for f, c in results[1:]:
        assert torch.equal(f, results[0][0]) and torch.equal(c, results[0][1])


def mixed_coefs(count, seed):
    """0.5, 1, 2, NaN and random values in (0, 1.5), spread over the units."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(count, generator=g, dtype=torch.float64) * 1.5
    fixed = torch.tensor([0.5, 1.0, 2.0, math.nan], dtype=torch.float64)
    c[: min(count, 4)] = fixed[: min(count, 4)]
    c[::7] = 1.0
    return c


@compiled
@pytest.mark.parametrize("conditional", [True, False], ids=["conditional", "always"])
def test_unit_scale_matches_reference_bitwise(dtype, cpu_capability, conditional):
    tensors, units = unit_cases(dtype, seed=3)
    tensors.append(randn((64, 33), dtype, seed=8).t())  # non-contiguous with units > 1: ATen path
    tensors.append(randn((5, 4, 3), dtype, seed=9).permute(1, 2, 0))  # dense, permuted, one unit
    units += [33, 1]
    coefs = mixed_coefs(sum(units), seed=1)
    expect = [t.clone() for t in tensors]
    before = [t.clone() for t in tensors]
    reference.multi_tensor_unit_scale_(expect, units, coefs, conditional)
    ops.multi_tensor_unit_scale_(tensors, units, coefs.float() if dtype != torch.float64 else coefs, conditional)
    for got, exp in zip(tensors, expect):
        torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
    changed = sum(int((~((a == b) | (a.isnan() & b.isnan()))).sum()) for a, b in zip(tensors, before))
    assert changed > 10000  # scaling happened


@compiled
def test_per_tensor_scale_matches_foreach_mul(dtype, cpu_capability):
    tensors = [randn((n,), dtype, seed=n) for n in (CHUNK + 3, 0, 5, 2 * CHUNK, 768)]
    tensors.append(randn((CHUNK + 10,), dtype)[3:])  # unaligned
    coefs = torch.tensor([0.25, 0.5, 0.75, 2.0, math.nan, 0.3])
    expect = [t.clone() for t in tensors]
    acc = reference.acc_dtype(dtype)
    for t, c in zip(expect, coefs.clamp(max=1.0).to(acc)):
        t.copy_(t.to(acc) * c)
    ops.multi_tensor_scale_per_tensor_(tensors, coefs)
    for a, b in zip(tensors, expect):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert tensors[4].isnan().all() and not tensors[0].isnan().any()


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conditional_scale_touches_no_memory_of_units_at_least_one(dtype, cpu_capability):
    import cuda_emu  # its page-guarded tensors serve the CPU op as well
    sizes = [1, 7, CHUNK + 1, 3 * CHUNK + 5, 0, 1000 * 8]
    guarded = cuda_emu.GuardedTensors(dtype, sizes, misalign=1)
    free = [randn((n,), dtype, seed=n) for n in (100, CHUNK + 3)]
    tensors = guarded.tensors[:5] + free + [guarded.tensors[5].view(1000, 8)]
    units = [1, 1, 1, 1, 1, 1, 1, 1000]
    coefs = torch.tensor([1.0, 2.0, math.inf, 1.0, 0.5, 0.5, 0.25] + [1.0] * 1000)
    before = [t.clone() for t in tensors]
    with guarded.unreadable():
        ops.multi_tensor_unit_scale_(tensors, units, coefs, conditional=True)
    for i in (0, 1, 2, 3, 7):
        assert torch.equal(tensors[i], before[i])
    torch.testing.assert_close(tensors[5], (before[5].float() * 0.5).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(tensors[6], (before[6].float() * 0.25).to(dtype), rtol=0, atol=0)


@compiled
@pytest.mark.parametrize("clip_value", [0.0, 0.1, 0.5, 3.0, 1e6, math.inf])
def test_clamp_matches_clip_grad_value_bitwise(dtype, cpu_capability, clip_value):
    tensors = [randn((n,), dtype, seed=n) for n in (1, 7, 1000, 0, CHUNK - 1, 3 * CHUNK + 5, 8191, 8193)]
    tensors[2][:7] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, -5.0, 65504.0])
    tensors[5][[0, CHUNK, 2 * CHUNK + 7, 3 * CHUNK + 4]] = math.nan
    tensors[5][[1, CHUNK + 8191, CHUNK + 8192]] = -math.inf
    tensors.append(randn((CHUNK + 20,), dtype, seed=3)[3:])  # unaligned
    tensors.append(randn((64, 33), dtype, seed=4)[:, ::2])  # non-dense: clamped in a copy
    tensors.append(randn((4, 6, 8), dtype, seed=5).permute(2, 0, 1))  # dense, permuted
    before = [t.clone() for t in tensors]
    expect = [t.clone() for t in tensors]
    if not (clip_value > torch.finfo(dtype).max and not math.isinf(clip_value)):
        torch._foreach_clamp_min_(expect, -clip_value)  # what clip_grad_value_(foreach=True) runs
        torch._foreach_clamp_max_(expect, clip_value)
    f, c, clamped = ops.multi_tensor_clamp_(tensors, clip_value)
    for got, exp in zip(tensors, expect):
        torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
        # NaN's sign: torch's vector / tail paths differ
        assert torch.equal(torch.signbit(got)[~exp.isnan()], torch.signbit(exp)[~exp.isnan()])
    assert clamped.tolist() == [int(((a != b) & ~b.isnan()).sum()) for a, b in zip(tensors, before)]
    assert_stats_close(before, (f, c))
    rf, rc = reference.multi_tensor_stats(before, 2.0)
    torch.testing.assert_close(c, rc, rtol=0, atol=0)
    if clip_value == 0.5:
        assert clamped.sum() > 100000  # clamping happened


@compiled
def test_clamp_matches_clip_grad_value_on_parameters(cpu_capability):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((300, 7), (5,), (CHUNK + 9,))]
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in ((300, 7), (5,), (CHUNK + 9,))]
    for i, (p, q) in enumerate(zip(params, ours)):
        p.grad = randn(p.shape, torch.float32, seed=i, scale=2.0)
        q.grad = p.grad.clone()
    torch.nn.utils.clip_grad_value_(params, 1.5, foreach=True)
    _, _, clamped = ops.multi_tensor_clamp_([q.grad for q in ours], 1.5)
    for p, q in zip(params, ours):
        assert torch.equal(p.grad, q.grad)
    assert clamped.sum() > 1000 and params[0].grad.abs().max() == 1.5


@compiled
def test_compiled_ops_refuse_bad_input_clearly():
    x = torch.ones(6)
    with pytest.raises(RuntimeError, match=r"units\[0\] = 4 does not divide tensors\[0\]'s 6 elements"):
        torch.ops.gradfuse.multi_tensor_unit_stats([x], [4], 2.0)
    with pytest.raises(RuntimeError, match="got 1 tensors but 2 unit counts"):
        torch.ops.gradfuse.multi_tensor_unit_scale_([x], [1, 1], torch.ones(2))
    with pytest.raises(RuntimeError, match="1-D tensor of 3 coefficients"):
        torch.ops.gradfuse.multi_tensor_unit_scale_([x], [3], torch.ones(2))
    with pytest.raises(RuntimeError, match="coefs must be floating point"):
        torch.ops.gradfuse.multi_tensor_unit_scale_([x], [3], torch.ones(3, dtype=torch.int64))
    for bad in (-0.5, math.nan):
        with pytest.raises(RuntimeError, match="clip_value must be >= 0 and not NaN"):
            torch.ops.gradfuse.multi_tensor_clamp_([x], bad)
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Double but tensors\[0\] has Float"):
        torch.ops.gradfuse.multi_tensor_clamp_([x, x.double()], 1.0)
    assert x.eq(1).all()


special = st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-30, 65504.0, -3.5])


@compiled
@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 700)), min_size=1, max_size=5),
       whole=st.lists(st.booleans(), min_size=5, max_size=5),
       dtype=st.sampled_from(DTYPES),
       plants=st.lists(st.tuples(st.integers(0, 10**9), special), max_size=12),
       coef_seed=st.integers(0, 2**31 - 1),
       clip_value=st.sampled_from([0.0, 0.3, 2.0]),
       seed=st.integers(0, 2**31 - 1))
def test_property_random_groups(shapes, whole, dtype, plants, coef_seed, clip_value, seed):
    tensors = [randn(s, dtype, seed=seed + i, scale=3.0) for i, s in enumerate(shapes)]
    for pos, value in plants:
        nonempty = [t for t in tensors if t.numel()]
        if nonempty:
            t = nonempty[pos % len(nonempty)].view(-1)
            t[pos % t.numel()] = value
    units = [1 if w and t.numel() else t.shape[0] for t, w in zip(tensors, whole)]
    assert_unit_stats_close(tensors, units, ops.multi_tensor_unit_stats(tensors, units, 2.0))
    coefs = mixed_coefs(sum(units), coef_seed)
    a, b = [t.clone() for t in tensors], [t.clone() for t in tensors]
    ops.multi_tensor_unit_scale_(a, units, coefs)
    reference.multi_tensor_unit_scale_(b, units, coefs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    r = reference.multi_tensor_clamp_(b, clip_value)
    g = ops.multi_tensor_clamp_(a, clip_value)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(g[2], r[2]) and torch.equal(g[1], r[1])


def test_benchmark_script_runs_untimed():
    # benchmarks/clip_ops.py on tiny shapes, one round: keeps it from rotting (timing is not tested).
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "clip_ops.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| per_tensor_scale |" in proc.stdout and "| clamp_with_stats |" in proc.stdout
