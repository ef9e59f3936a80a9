"""The CUDA clipping kernels without a GPU: the per-unit stats, scale and clamp functors of
csrc/cuda/stats_ops.cuh and csrc/cuda/clip_ops.cuh, the launcher of csrc/cuda/multi_tensor.cuh and
the glue of csrc/cuda/ops.h, run on the CPU by the CUDA emulation of tests/cuda_emu (see
test_cuda_emulated.py), compared with the float64 reference and with the CPU backend: per-unit
statistics, per-unit / per-tensor scale (bitwise) and the one-pass clamp (bitwise, with the
statistics before clamping and the clamped counts). test_clip_grid_under_sanitizers runs this file
again, built with ASan+UBSan.
"""
import math

import cuda_emu
import pytest
import torch
from clip_helpers import assert_unit_stats_close
from emu_fixtures import SANITIZED, rerun_under_sanitizers
from helpers import assert_stats_close

from gradfuse.ops import library, reference

pytestmark = pytest.mark.skipif(library.extension is None or not hasattr(torch.ops.gradfuse, "multi_tensor_clamp_"),
                                reason="gradfuse._C (the CPU backend compared with) not built with the clip ops")

CHUNK = 65536
SIZES = [0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]




def randn(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def plant(x, seed=0):
    """NaN, +-Inf, +-0 and 65504 at chunk / pack boundaries and in tails of a flat view."""
    v = x.view(-1)
    n = v.numel()
    if n == 0:
        return x
    at = lambda *idx: [i % n for i in idx]  # noqa: E731
    v[at(0, CHUNK - 1, n - 1)] = math.nan
    v[at(1, CHUNK + 2 + seed)] = math.inf
    v[at(17, n - 2)] = -math.inf
    v[at(2, 3, n - 3)] = 0.0
    v[at(4, CHUNK - 2)] = -0.0
    v[at(5, n - 4)] = 65504.0
    return x


def unit_grid(dtype):
    """Units of 1 (every size), of rows (packed: 768, 1, 3; split: over half a chunk, several
    pieces), many units, empty tensors and empty units, misaligned rows, planted values."""
    cases = [((n,), 1) for n in SIZES]
    cases += [((300, 768), 300), ((1000, 1), 1000), ((CHUNK + 3, 1), CHUNK + 3), ((77, 3), 77),
              ((3, 70000), 3), ((2, CHUNK // 2 + 1), 2), ((4, CHUNK // 2), 4), ((0, 5), 0), ((6, 0), 6),
              ((21, 5, 5), 21)]
    tensors = [plant(randn(s, dtype, seed=i), seed=i % 3) for i, (s, _) in enumerate(cases)]
    base = randn(50 * 769 + 1, dtype, seed=99)
    tensors.append(base[1:].view(50, 769))  # rows misaligned for 16-byte loads
    units = [u for _, u in cases] + [50]
    return tensors, units


def check_unit_stats(emu, tensors, units, norm_type):
    got = emu.multi_tensor_unit_stats(tensors, units, norm_type)
    assert got[0].shape == (sum(units), 4)
    assert_unit_stats_close(tensors, units, got, norm_type)
    cpu = torch.ops.gradfuse.multi_tensor_unit_stats(tensors, units, norm_type)
    assert_unit_stats_close(tensors, units, got, norm_type, expected=cpu)
    return got


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_unit_stats_grid(emu, dtype, norm_type):
    tensors, units = unit_grid(dtype)
    f, c = check_unit_stats(emu, tensors, units, norm_type)
    assert c[:, 0].sum() > 10 and c[:, 1].sum() > 10  # planted values were counted
    assert f[:, 1].gt(0).sum() > 1000


def launch_table_tensors(count, dtype, seed=0):
    sizes = [(1 + i % 9, 1 + i % 5) if i % 11 else (0, 3) for i in range(count)]
    sizes[5] = (3, CHUNK + 1)  # a split unit in the middle of a table
    return [randn(s, dtype, seed=seed + i) for i, s in enumerate(sizes)]


@pytest.mark.parametrize("count_of", ["small+1", "large+5", "1280+3"])
def test_several_launch_tables(emu, count_of):
    small, large = emu.unit_table_sizes()
    count = {"small+1": small + 1, "large+5": 2 * large + 5, "1280+3": 1283}[count_of]
    tensors = launch_table_tensors(count, torch.float32)
    units = [t.shape[0] if i % 2 else 1 for i, t in enumerate(tensors)]
    check_unit_stats(emu, tensors, units, 2.0)
    coefs = torch.rand(sum(units), generator=torch.Generator().manual_seed(1)) * 1.5
    a, b = [t.clone() for t in tensors], [t.clone() for t in tensors]
    emu.multi_tensor_unit_scale_(a, units, coefs, True)
    reference.multi_tensor_unit_scale_(b, units, coefs, True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    f, c, clamped = emu.multi_tensor_clamp_(a, 0.5)
    r = reference.multi_tensor_clamp_(b, 0.5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(clamped, r[2]) and torch.equal(c, r[1]) and clamped.sum() > 100


COEFS = [0.5, 1.0, 2.0, math.nan]


@pytest.mark.parametrize("conditional", [True, False], ids=["conditional", "always"])
@pytest.mark.parametrize("coef", COEFS + ["mixed"])
def test_unit_scale_grid(emu, dtype, conditional, coef):
    tensors, units = unit_grid(dtype)
    tensors.append(randn((64, 33), dtype, seed=4).t())  # non-contiguous, units > 1: ATen path
    tensors.append(randn((64, 33), dtype, seed=5)[:, ::2])  # non-dense, one unit: ATen path
    units += [33, 1]
    total = sum(units)
    if coef == "mixed":
        g = torch.Generator().manual_seed(7)
        coefs = torch.rand(total, generator=g, dtype=torch.float64) * 1.5
        coefs[::5] = 1.0
        coefs[1::9] = 2.0
        coefs[3] = math.nan
    else:
        coefs = torch.full((total,), coef, dtype=torch.float64)
    coefs = coefs.to(torch.float64 if dtype == torch.float64 else torch.float32)
    on_emu, on_cpu, expect = ([t.clone() for t in tensors] for _ in range(3))
    emu.multi_tensor_unit_scale_(on_emu, units, coefs, conditional)
    torch.ops.gradfuse.multi_tensor_unit_scale_(on_cpu, units, coefs, conditional)
    reference.multi_tensor_unit_scale_(expect, units, coefs, conditional)
    for got, cpu, ref in zip(on_emu, on_cpu, expect):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got, cpu, rtol=0, atol=0, equal_nan=True)


def test_per_tensor_scale_is_units_of_one(emu, dtype):
    tensors = [randn((n,), dtype, seed=n) for n in SIZES] + [randn((CHUNK + 20,), dtype, seed=3)[3:]]
    coefs = torch.tensor([0.5, 1.0, 2.0, math.nan, 0.25, 0.75, 0.1, 0.9])
    a, b = [t.clone() for t in tensors], [t.clone() for t in tensors]
    emu.multi_tensor_unit_scale_(a, [1] * len(a), coefs, True)
    reference.multi_tensor_scale_per_tensor_(b, coefs, True)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    assert a[3].isnan().all() and a[2].isnan().any() is not True


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conditional_scale_touches_no_memory_of_units_at_least_one(emu, dtype, packed):
    # Units whose coefficient is >= 1 lie on pages made unreadable while the kernels run;
    # the others (0.5) are scaled next to them in the same launch.
    sizes = [1, 7, CHUNK + 1, 3 * CHUNK + 5, 0, 1000 * 8]
    guarded = cuda_emu.GuardedTensors(dtype, sizes, misalign=1)
    free = [randn((n,), dtype, seed=n) for n in (100, CHUNK + 3)]
    rows = guarded.tensors[5].view(1000, 8) if packed else guarded.tensors[5]
    tensors = guarded.tensors[:5] + free + [rows]
    units = [1] * 7 + ([1000] if packed else [1])
    coefs = torch.tensor([1.0, 2.0, math.inf, 1.0, 0.5, 0.5, 0.25] + [1.0] * units[-1])
    before = [t.clone() for t in tensors]
    with guarded.unreadable():
        emu.multi_tensor_unit_scale_(tensors, units, coefs, True)
    for i in (0, 1, 2, 3, 7):
        assert torch.equal(tensors[i], before[i])
    acc = reference.acc_dtype(dtype)
    torch.testing.assert_close(tensors[5], (before[5].to(acc) * 0.5).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(tensors[6], (before[6].to(acc) * 0.25).to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("clip_value", [0.0, 0.5, 3.0, 1e6])
def test_clamp_grid(emu, dtype, clip_value):
    tensors = [plant(randn((n,), dtype, seed=n), seed=n % 3) for n in SIZES]
    tensors += [randn((n,), dtype, seed=n) for n in (3, 17, 255, 256, 257, 1000)]  # many small
    tensors.append(plant(randn((CHUNK + 20,), dtype, seed=3))[3:])  # misaligned
    tensors.append(randn((64, 33), dtype, seed=4)[:, ::2])  # non-dense: clamped in a copy
    before = [t.clone() for t in tensors]
    on_emu, on_cpu, expect = ([t.clone() for t in tensors] for _ in range(3))
    got = emu.multi_tensor_clamp_(on_emu, clip_value)
    cpu = torch.ops.gradfuse.multi_tensor_clamp_(on_cpu, clip_value)
    ref = reference.multi_tensor_clamp_(expect, clip_value)
    for g, c, r in zip(on_emu, on_cpu, expect):
        torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(g, c, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(torch.signbit(g)[~r.isnan()], torch.signbit(r)[~r.isnan()])
    assert torch.equal(got[2], ref[2]) and torch.equal(got[2], cpu[2])
    assert_stats_close(before, got[:2])
    assert_stats_close(before, got[:2], expected=cpu[:2])
    assert got[1][:, 0].sum() > 5  # the NaN planted were counted, before clamping
    if clip_value == 0.5:
        assert got[2].sum() > 100000


@pytest.mark.skipif(SANITIZED, reason="this is the sanitized run")
def test_clip_grid_under_sanitizers():
    """This file again with the emulated backend built with -fsanitize=address,undefined."""
    rerun_under_sanitizers(__file__, timeout=1800)
