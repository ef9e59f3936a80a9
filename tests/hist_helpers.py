"""The float64 / integer reference of the exponent histogram (torch.frexp), and inputs that
reach every bin a dtype has: for the CPU op tests (test_histogram.py) and the emulated CUDA
kernels (test_cuda_emulated_hist.py)."""
import math

import torch

CHUNK = 65536
SIZES = [0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
NUM_BINS = 283


def frexp_histogram(t: torch.Tensor) -> torch.Tensor:
    """Counts per bin, computed independently of gradfuse: torch.frexp on the float64 values
    (exact for every float dtype) gives floor(log2|x|) = exponent - 1; integer bin arithmetic."""
    x = t.detach().reshape(-1).cpu().to(torch.float64)
    counts = torch.zeros(NUM_BINS, dtype=torch.int64)
    nan, pinf, ninf, zero = x.isnan(), x == math.inf, x == -math.inf, x == 0
    finite = ~(nan | pinf | ninf | zero)
    _m, ex = torch.frexp(x[finite])
    e = ex.to(torch.int64) - 1
    below, above = e < -149, e > 127
    inside = ~(below | above)
    counts += torch.bincount(e[inside] + 151, minlength=NUM_BINS)
    counts[0] += int(below.sum())
    counts[1] += int(zero.sum())
    counts[279] += int(above.sum())
    counts[280] += int(pinf.sum())
    counts[281] += int(ninf.sum())
    counts[282] += int(nan.sum())
    return counts


def expected_rows(tensors) -> torch.Tensor:
    if not tensors:
        return torch.zeros((0, NUM_BINS), dtype=torch.int64)
    return torch.stack([frexp_histogram(t) for t in tensors])


def every_exponent(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` values of `dtype`: random signs and mantissas over every binade the dtype has
    (subnormals included, float64 also outside the bins' [-149, 127]), with zeros of both signs,
    +-inf and NaN planted at chunk boundaries and in the tail."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    lo = {torch.float16: -24, torch.bfloat16: -133, torch.float32: -149, torch.float64: -170}[dtype]
    hi = {torch.float16: 15, torch.bfloat16: 127, torch.float32: 127, torch.float64: 150}[dtype]
    e = torch.randint(lo, hi + 1, (n,), generator=g).to(torch.float64)
    u = 1 + torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    x = (sign * u * torch.exp2(e)).to(dtype)
    if n:
        at = lambda *idx: [i % n for i in idx]  # noqa: E731
        x[at(0, CHUNK - 1, CHUNK + 8, n - 1)] = math.nan
        x[at(1, CHUNK, 2 * CHUNK + 3 + seed)] = math.inf
        x[at(17, n - 2)] = -math.inf
        x[at(2, 3, CHUNK + 1, 2 * CHUNK, n - 3)] = 0.0
        x[at(4, CHUNK - 2)] = -0.0
        x[at(5, n - 6)] = fi.smallest_normal / 2 ** 3  # a subnormal of every dtype
    return x


def random_bits(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` uniformly random bit patterns viewed as `dtype`: every class of value, NaN payloads
    and both signs included."""
    g = torch.Generator().manual_seed(seed)
    width = torch.finfo(dtype).bits
    raw = torch.randint(-(2 ** 62), 2 ** 62, (n,), generator=g, dtype=torch.int64)
    int_type = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    return raw.to(int_type).view(dtype) if width < 64 else raw.view(dtype)
