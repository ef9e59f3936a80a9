"""The inputs of the emulated grids of the optimizer-side ops (the update ops and the fused step):
sizes around the chunk, seeded values, non-finite values planted at chunk and pack boundaries,
views whose storage offset misaligns them."""
import math

import torch

CHUNK = 65536
SIZES = [0, 1, 7, 33, CHUNK - 1, CHUNK + 1, 2 * CHUNK + 5]


def randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def plant(x, seed):
    """NaN, +-Inf and zeros at chunk / pack boundaries and in tails of a flat view."""
    v = x.view(-1)
    n = v.numel()
    at = lambda *idx: [i % n for i in idx]  # noqa: E731
    v[at(0, CHUNK - 1, n - 1)] = math.nan
    v[at(1, CHUNK + 2 + seed)] = math.inf
    v[at(17, n - 2)] = -math.inf
    v[at(2, 3, n - 3)] = 0.0
    return x


def grid_params(dtype, seed=0):
    """Every size, a 2-D one, and views whose storage offset misaligns them for 16-byte loads."""
    params = [randn((n,), dtype, seed + i) for i, n in enumerate(SIZES)]
    params.append(randn((300, 77), dtype, seed + 50))
    params.append(randn(CHUNK + 41, dtype, seed + 51)[3:CHUNK + 40])  # misaligned, across chunks
    params.append(randn(1000, dtype, seed + 52)[1:])
    return params
