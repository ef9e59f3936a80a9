"""The CUDA exponent-histogram functor (csrc/cuda/hist_ops.cuh, launched by csrc/cuda/multi_tensor.cuh,
glue csrc/cuda/ops.h) run
on the CPU by the CUDA emulation of tests/cuda_emu, compared bin by bin with the torch.frexp
reference and with the CPU backend: every dtype, subnormals, zeros, +-inf, NaN, sizes across
chunk boundaries, many tensors (several launch tables), misaligned views, and the
all-same-exponent input (every lane of every warp adding to one bin).

test_grid_under_sanitizers runs this file a second time, built with ASan+UBSan.
"""
import math

import pytest
import torch
from emu_fixtures import SANITIZED, rerun_under_sanitizers
from hist_helpers import CHUNK, SIZES, every_exponent, expected_rows, random_bits

from gradfuse.ops import library

pytestmark = pytest.mark.skipif(library.extension is None,
                                reason="gradfuse._C (the CPU backend compared with) not built")
cpu_hist = torch.ops.gradfuse.multi_tensor_exponent_histogram




def check(emu, tensors):
    got = emu.multi_tensor_exponent_histogram(tensors)
    assert got.dtype == torch.int64 and got.shape == (len(tensors), 283)
    torch.testing.assert_close(got, expected_rows(tensors), rtol=0, atol=0)
    torch.testing.assert_close(got, cpu_hist(tensors), rtol=0, atol=0)
    assert got.sum(1).tolist() == [t.numel() for t in tensors]
    return got


def test_sizes_and_every_bin(emu, dtype):
    tensors = [every_exponent(dtype, n, seed=i) for i, n in enumerate(SIZES)]
    got = check(emu, tensors)
    big = got[-1]
    assert (big > 0).sum() > 30 and big[1] >= 7 and big[282] == 4 and big[280] >= 3 and big[281] >= 2
    fi = torch.finfo(dtype)
    sub = int(math.floor(math.log2(fi.smallest_normal))) - 3  # the planted subnormal's exponent
    if sub >= -149:
        assert big[sub + 151] >= 1


def test_random_bit_patterns(emu, dtype):
    check(emu, [random_bits(dtype, n, seed=n) for n in (3, CHUNK + 7, 2 * CHUNK + 1)])


def test_all_same_exponent(emu, dtype):
    # Every lane of every warp adds to one bin: the contention case (and zeros, Inf: pass 2).
    tensors = [torch.full((3 * CHUNK + 5,), -1.75, dtype=dtype), torch.zeros(CHUNK + 1, dtype=dtype),
               torch.full((CHUNK - 1,), math.inf, dtype=dtype)]
    got = check(emu, tensors)
    assert got[0, 151] == 3 * CHUNK + 5 and got[1, 1] == CHUNK + 1 and got[2, 280] == CHUNK - 1


def test_misaligned_views(emu, dtype):
    base = every_exponent(dtype, 3 * CHUNK + 64, seed=5)
    pack = 16 // base.element_size()
    views = []
    for offset in list(range(1, pack)) + [pack, 3 * pack]:
        for n in (1, 7, pack + 1, CHUNK + 3, 2 * CHUNK + offset):
            views.append(base[offset:offset + n])
    assert any(v.data_ptr() % 16 for v in views) and any(v.data_ptr() % 16 == 0 for v in views)
    views.append(base[: 64 * 64].reshape(64, 64).t())  # dense, permuted
    views.append(base[::5])  # strided: copied by the glue
    check(emu, views)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_many_tensors_over_launch_tables(emu, dtype):
    table = emu.max_tensors_per_launch()
    count = table + 70  # a full large table (> 1280), then a small one (> 64 needs the large one too)
    sizes = [(i * 37) % 90 if i % 11 else 0 for i in range(count)]
    sizes[table - 1] = CHUNK + 2
    sizes[table] = 2 * CHUNK + 1
    tensors = [every_exponent(dtype, n, seed=i) for i, n in enumerate(sizes)]
    got = check(emu, tensors)
    assert got[:, :].sum(1).tolist() == sizes


@pytest.mark.skipif(SANITIZED, reason="this is the sanitized run")
def test_grid_under_sanitizers():
    """This file again, with the emulated backend built with -fsanitize=address,undefined."""
    rerun_under_sanitizers(__file__, timeout=1800)
