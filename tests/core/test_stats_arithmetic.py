"""The per-element arithmetic of stats_math.h and its accumulation on the CPU backend: accuracy
against float64 on large magnitudes, the rare pass for NaN / Inf, signed zeros."""
import math

import pytest
import torch

from gradfuse.ops import library

pytestmark = pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")

stats_op = torch.ops.gradfuse.multi_tensor_stats
CHUNK = 65536
SUM, SUMSQ, MAXABS, POWSUM = range(4)


def signs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).double() * 2 - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_magnitudes_close_to_float64_on_huge_values(dtype, cpu_capability):
    # +-1e30: every square overflows float32, so each chunk also takes the NaN / Inf pass; one
    # magnitude everywhere is the worst case for a long sequential float sum (it was 2.3e-4 off).
    n = 3 * CHUNK + 5
    x = (signs(n) * 1e30).to(dtype)
    f, c = stats_op([x], 1.0)
    ref = x.double()
    assert c[0].tolist() == [0, 0, 0, n]  # no NaN / Inf counted: only finite values overflowed
    assert f[0, SUMSQ].item() == math.inf
    assert f[0, MAXABS].item() == ref.abs().max().item()
    assert abs(f[0, POWSUM].item() / ref.abs().sum().item() - 1) < 1e-5
    assert abs(f[0, SUM].item() - ref.sum().item()) < 1e-5 * ref.abs().sum().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sums_close_to_float64_on_one_long_tensor(dtype, cpu_capability):
    n = 40 * CHUNK + 3
    x = (torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5).to(dtype)
    f, _ = stats_op([x], 1.0)
    ref = x.double()
    for col, expect in ((SUM, ref.sum()), (SUMSQ, (ref * ref).sum()), (POWSUM, ref.abs().sum())):
        assert abs(f[0, col].item() / expect.item() - 1) < 1e-6, col


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_negative_zero_is_zero_for_negative_norm_types(dtype, cpu_capability):
    # Negative norm types reach the op only directly. |-0.0| must be +0.0: pow(-0.0, -1) is -inf,
    # and a chunk holding both zeros would sum +inf and -inf to NaN.
    x = torch.tensor([1.0, -0.0, 2.0, 0.0, -0.0] * 40, dtype=dtype)
    f, c = stats_op([x], -1.0)
    assert f[0, POWSUM].item() == math.inf
    assert f[0, MAXABS].item() == 2.0 and c[0, 2].item() == 120
    only_negative = torch.full((10,), -0.0, dtype=dtype)
    assert stats_op([only_negative], -1.0)[0][0, POWSUM].item() == math.inf


def test_nan_restored_into_max_whatever_its_position(cpu_capability):
    # Pass 1's max ignores NaN; pass 2 must restore it in every chunk and lane position.
    for pos in (0, 1, 7, 8, 15, 16, 31, CHUNK - 1, CHUNK, CHUNK + 100):
        x = torch.ones(CHUNK + 101)
        x[pos] = math.nan
        f, c = stats_op([x], 2.0)
        assert math.isnan(f[0, MAXABS].item()) and c[0, :2].tolist() == [1, 0], pos
