"""The CUDA backend without a GPU: the real stats and scale functors of csrc/cuda/stats_ops.cuh and
csrc/cuda/clip_ops.cuh, the launcher of csrc/cuda/multi_tensor.cuh and the glue of csrc/cuda/ops.h,
run on the CPU by the CUDA emulation of tests/cuda_emu, compared column by column with the CPU
backend and with the float64 reference.

The first run builds the emulated backend (about 40 s, cached in build/cuda_emu/).
test_grid_under_sanitizers runs this file a second time, built with ASan+UBSan.
"""
import math
import os
import subprocess
import sys
import textwrap

import cuda_emu
import pytest
import torch
from emu_fixtures import FMA, SANITIZED, rerun_under_sanitizers, rerun_with_fma
from helpers import assert_moments_close, assert_stats_close

from gradfuse.ops import library
from gradfuse.ops.layout import M2, NAN

pytestmark = pytest.mark.skipif(library.extension is None,
                                reason="gradfuse._C (the CPU backend compared with) not built")

CHUNK = 65536
SIZES = [0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
NORM_TYPES = [2.0, 1.0, 3.0, 0.5, math.inf, 0.0, -1.5]
cpu_stats = torch.ops.gradfuse.multi_tensor_stats
cpu_scale = torch.ops.gradfuse.multi_tensor_scale_
cpu_moments = torch.ops.gradfuse.multi_tensor_moments




def randn(n, dtype, seed=0, nonzero=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    return (x.abs() + 1 if nonzero else x).to(dtype)


def small_sizes(count, high, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (count,), generator=g).tolist()


def check_stats(emu, tensors, norm_type):
    got = emu.multi_tensor_stats(tensors, norm_type)
    assert_stats_close(tensors, got, norm_type)
    assert_stats_close(tensors, got, norm_type, expected=cpu_stats(tensors, norm_type))
    return got


def plant(x, seed):
    """NaN, Inf, -Inf, +-0 and +-65504 (fp16 max) at chunk and pack boundaries and in tails."""
    n = x.numel()
    at = lambda *idx: [i % n for i in idx]  # noqa: E731
    x[at(0, CHUNK - 1, CHUNK + 8, n - 1)] = math.nan
    x[at(1, CHUNK, 2 * CHUNK + 3 + seed)] = math.inf
    x[at(17, n - 2)] = -math.inf
    x[at(2, 3, CHUNK + 1, 2 * CHUNK, n - 3)] = 0.0
    x[at(4, CHUNK - 2)] = -0.0
    x[at(5, CHUNK + 2, n - 4)] = 65504.0
    x[at(6, n - 5)] = -65504.0
    return x


def planted_tensors(dtype):
    x = plant(randn(3 * CHUNK + 5, dtype, nonzero=True), seed=0)
    only_inf = randn(CHUNK + 9, dtype, seed=1)
    only_inf[[7, CHUNK + 3]] = -math.inf
    fp16_max = torch.full((CHUNK + 3,), 65504.0, dtype=dtype)
    return [x, only_inf, fp16_max, torch.zeros(1000, dtype=dtype), plant(randn(100, dtype, seed=2), seed=1)]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_sizes_and_planted_values(emu, dtype, norm_type):
    sizes = SIZES + small_sizes(40, 300, seed=1)
    tensors = [randn(n, dtype, seed=i) for i, n in enumerate(sizes)] + planted_tensors(dtype)
    f, c = check_stats(emu, tensors, norm_type)
    assert c[len(sizes)].tolist() == [4, 5, 7, 3 * CHUNK + 5]  # the planted counts, exactly


def test_many_small_tensors(emu, dtype):
    sizes = small_sizes(150, 2000, seed=2)
    check_stats(emu, [randn(n, dtype, seed=i) for i, n in enumerate(sizes)], 3.0)


def test_misaligned_views(emu, dtype):
    base = plant(randn(3 * CHUNK + 64, dtype, nonzero=True), seed=5)
    pack = 16 // base.element_size()
    views = []
    for offset in list(range(1, pack)) + [pack, 3 * pack]:  # misaligned, then aligned at an offset
        for n in (1, 7, pack + 1, CHUNK + 3, 2 * CHUNK + offset):
            views.append(base[offset:offset + n])
    assert any(v.data_ptr() % 16 for v in views) and any(v.data_ptr() % 16 == 0 for v in views)
    for norm_type in (2.0, 3.0):
        check_stats(emu, views, norm_type)


@pytest.mark.parametrize("dtype, layout", [
    (torch.float32, "empty_at_boundaries"), (torch.float32, "filled_at_boundaries"),
    (torch.float32, "empty_table"), (torch.float16, "empty_at_boundaries"),
    (torch.bfloat16, "filled_at_boundaries"), (torch.float64, "empty_table")],
    ids=lambda v: str(v).replace("torch.", ""))
def test_several_launch_tables(emu, dtype, layout):
    table = emu.max_tensors_per_launch()
    count = 2 * table + 5
    boundaries = {table - 1, table, 2 * table - 1, 2 * table}
    filled = {0, 5, table - 2, table + 1, table + 3, 2 * table - 2, 2 * table + 1, count - 1}
    if layout == "filled_at_boundaries":
        filled |= boundaries
    elif layout == "empty_table":
        filled = {i for i in filled if i >= table} | {table, table + 7}
    big = {5: CHUNK + 1, table + 3: 2 * CHUNK + 9}
    sizes = [big.get(i, 1 + i % 97) if i in filled else 0 for i in range(count)]
    assert {i for i in boundaries if sizes[i]} == (boundaries if layout == "filled_at_boundaries" else
                                                   {table} if layout == "empty_table" else set())
    tensors = [randn(n, dtype, seed=i) for i, n in enumerate(sizes)]
    f, c = check_stats(emu, tensors, 2.0)
    assert c[:, 3].tolist() == sizes


def test_full_launch_tables_of_tiny_tensors(emu):
    # Every block of a full table looks its chunk up among 1280 tensors.
    count = emu.max_tensors_per_launch() + 1
    sizes = [1 + i % 8 for i in range(count)]
    check_stats(emu, [randn(n, torch.float32, seed=i) for i, n in enumerate(sizes)], 1.0)


def check_moments(emu, tensors):
    """The emulated multi_tensor_moments against the float64 two-pass M2 and the CPU backend."""
    got = emu.multi_tensor_moments(tensors)
    assert_moments_close(tensors, got)
    assert_moments_close(tensors, got, expected=cpu_moments(tensors))
    return got


@pytest.mark.parametrize("offset", [0.0, 1e3, 1e6])
def test_moments(emu, dtype, offset):
    """A shift per tensor, read by every block of it and used once by the finalize."""
    spread = 1.0
    if dtype in (torch.float16, torch.bfloat16):  # within their range and spacing
        offset = min(offset, 1e3)
        spread = max(1.0, offset / 32)
    sizes = SIZES + small_sizes(30, 300, seed=3)
    tensors = [(offset + spread * randn(n, torch.float64, seed=i)).to(dtype) for i, n in enumerate(sizes)]
    f, _ = check_moments(emu, tensors)
    assert (f[[i for i, n in enumerate(sizes) if n > 1], 3] > 0).all()  # there was a spread


def test_moments_planted_views_and_tables(emu, dtype):
    tensors = planted_tensors(dtype)
    base = randn(2 * CHUNK + 64, dtype, seed=9) + 40
    far = randn(CHUNK + 77, dtype, seed=10) + 40
    far[[0, -1]] = 340  # two of the five positions the shift is read from: the median holds
    tensors += [base[1:], base[3:CHUNK + 20], base[5:6], far]
    check_moments(emu, tensors)
    table = emu.max_tensors_per_launch()
    sizes = [0 if i % 5 == 0 else 1 + i % 37 for i in range(table + 9)]
    check_moments(emu, [randn(n, dtype, seed=i) + 7 for i, n in enumerate(sizes)])


def test_moments_whose_spread_overflows(emu):
    """[1, 2, 1e300] in float64: sum * (sum / n) overflows, and the finish gives the two-pass's
    +Inf, not Inf - Inf = NaN, whether or not the compiler contracts it into an FMA (the test below
    runs these tests again with the emulation built to contract, as nvcc does)."""
    x = torch.tensor([1.0, 2.0, 1e300], dtype=torch.float64)
    f, c = emu.multi_tensor_moments([x, -x, x[:2]])
    assert f[:, M2].tolist() == [math.inf, math.inf, 0.5]
    assert torch.equal(f, cpu_moments([x, -x, x[:2]])[0])
    assert c[:, NAN].tolist() == [0, 0, 0]


@pytest.mark.skipif(SANITIZED or FMA, reason="this is a rerun")
def test_moments_with_fma_contraction():
    """The moments tests of this file again, with the emulated backend built with -mfma
    -ffp-contract=fast (nvcc's default contraction): the results must not depend on it."""
    rerun_with_fma(__file__, "moments")


# A regression test for |x| by fabs: as `x < 0 ? -x : x` it kept -0.0, so pow(-0.0, p) was -inf for
# odd integer p < 0 (raw op only), and +0.0 with -0.0 in one chunk gave NaN.
@pytest.mark.parametrize("norm_type", [-1.0, -3.0])
def test_negative_norm_type_with_signed_zeros(emu, dtype, norm_type):
    tensors = [torch.tensor([0.0, -0.0, 1.0], dtype=dtype), torch.full((5,), -0.0, dtype=dtype)]
    assert_stats_close(tensors, emu.multi_tensor_stats(tensors, norm_type), norm_type)


COEFS = [0.5, 1.0, 2.0, math.nan]


def scale_inputs(dtype):
    """Dense tensors of every size, a misaligned view and a non-dense one (scaled by ATen)."""
    tensors = [randn(n, dtype, seed=n) for n in SIZES]
    tensors.append(plant(randn(CHUNK + 20, dtype, seed=3), seed=2)[3:])
    tensors.append(randn(64 * 33, dtype, seed=4).reshape(64, 33)[:, ::2])
    return tensors


@pytest.mark.parametrize("conditional", [True, False], ids=["conditional", "always"])
@pytest.mark.parametrize("coef", COEFS)
def test_scale(emu, dtype, conditional, coef):
    tensors = scale_inputs(dtype)
    on_cpu = [t.clone() for t in tensors]
    factor = min(coef, 1.0) if conditional and not math.isnan(coef) else coef
    expect = [(t.double() * factor).to(dtype) for t in tensors]
    emu.multi_tensor_scale_(tensors, torch.tensor(coef), conditional)
    cpu_scale(on_cpu, torch.tensor(coef), conditional)
    for got, cpu, ref in zip(tensors, on_cpu, expect):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got, cpu, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("coef", [1.0, 2.0, math.inf])
def test_conditional_scale_touches_no_memory_when_coef_at_least_one(emu, dtype, coef):
    # The gradients lie on pages of their own, unreadable while the kernels run: touching them
    # would crash the process.
    guarded = cuda_emu.GuardedTensors(dtype, [1, 7, CHUNK + 1, 3 * CHUNK + 5, 0, 1000], misalign=1)
    before = [t.clone() for t in guarded.tensors]
    with guarded.unreadable():
        emu.multi_tensor_scale_(guarded.tensors, torch.tensor(coef), True)
    for t, b in zip(guarded.tensors, before):
        assert torch.equal(t, b)


@pytest.mark.skipif(SANITIZED, reason="ASan reports the fault itself")
def test_guarded_memory_does_fault_when_touched():
    # The control for the test above: the same guard, with a coefficient that must scale.
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import cuda_emu
        emu = cuda_emu.load()
        guarded = cuda_emu.GuardedTensors(torch.float32, [{CHUNK + 1}], misalign=0)
        with guarded.unreadable():
            emu.multi_tensor_scale_(guarded.tensors, torch.tensor(0.5), True)
        print("not touched")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -11 and "not touched" not in proc.stdout, proc.stderr[-3000:]


def test_emulated_warp_operations_follow_cuda(emu):
    out = emu.selftest("warp_ops")
    expect = []
    for t in list(range(64)) * 2:
        lane, first = t % 32, t - t % 32
        expect.append([
            first + lane * 7 % 32,
            t - 3 if lane >= 3 else t,
            t + 5 if lane + 5 < 32 else t,
            first + (lane ^ 9),
            t + 5 if lane % 8 + 5 < 8 else t,
            t ^ 1,
            sum(1 << i for i in range(0, 32, 3)),
            int(first == 32) + 2 * int(first == 0),
            first + (lane + 2) % 32 if lane % 2 == 0 else -1,
            (63 - t) ** 2,
        ])
    assert out.tolist() == expect
    assert emu.selftest("atomics").tolist() == [64 * 256] * 2


@pytest.mark.parametrize("name, message", [
    ("divergent_shuffle", r"block \(0,0,0\).*thread \(16,0,0\): exited while lanes 0-15 of its warp "
                          r"wait for it in __shfl_down_sync"),
    ("barrier_in_divergent_code", r"block \(0,0,0\).*deadlock.*threads 0-15, 32-47 wait at "
                                  r"__syncthreads; threads 16-31, 48-63 wait in __shfl_down_sync"),
    ("mismatched_warp_ops", r"calls __ballot_sync \(mask 0xffffffff\) while lanes 0 of its warp wait "
                            r"in __shfl_xor_sync"),
    ("reads_lane_outside_mask", r"lane 0 reads lane 20, which is not in the mask"),
    ("empty_grid", r"invalid launch .* grid \(0,1,1\)"),
    ("too_many_threads", r"invalid launch .* block \(1025,1,1\)"),
    ("huge_argument", r"kernel parameters take 40000 bytes, more than 32764"),
])
def test_emulator_reports_divergence_deadlock_and_bad_launches(emu, name, message):
    with pytest.raises(RuntimeError, match=message):
        emu.selftest(name)
    emu.selftest("warp_ops")  # and runs the next kernel normally


@pytest.mark.skipif(SANITIZED, reason="this is the sanitized run")
def test_grid_under_sanitizers():
    """This file again, with the emulated backend built with -fsanitize=address,undefined:
    out-of-bounds and misaligned accesses, and undefined behaviour, abort the run."""
    rerun_under_sanitizers(__file__, timeout=1200)
