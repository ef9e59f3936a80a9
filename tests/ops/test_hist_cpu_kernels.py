"""The CPU histogram under each CPU capability the machine can select, against the reference.

The reference is torch.frexp's, at the sizes and value patterns where a chunk loop has edges: sizes around
8-element unroll steps and 16-element vectors, unaligned starts, one value everywhere (every
increment on one counter, and whole chunks in the lumped zero / Inf / NaN rows that pass 2 sorts
out), wide chunks between narrow ones in one call and across calls, 1 and 2 threads. (A pair-
counting AVX2 loop was tried and dropped: see benchmarks/RESULTS.md; these tests were written
for it and kept.)

The AVX2 kernel (csrc/cpu/hist_avx2.cpp) counts the eight hottest exponent fields of a
chunk in byte lanes (32 elements per vector, 64-vector blocks) and every other lane by its index;
it takes the hot fields from the worker's previous chunk or from a 256-element sample, samples
again after a block where more than 1/16 of the lanes missed, and counts 2048 elements with the
scalar loop when eight fields cover less than 7/8 of a sample. The tests below the line aim at
each of those edges, under both capabilities (the default loop must give the same counts).

The hot fields are a window of eight consecutive fields, and where the CPU has
AVX512BW, AVX512_BITALG and GFNI the AVX2 kernels count with an AVX-512 loop (64 elements per
group, 31-group blocks of byte counters, out-of-window lanes by their stored field byte); the
cpu_capability fixture here runs every test under that loop too ("avx512"), and the tests at the
end aim at its group and block edges."""
import math

import pytest
import torch
from hist_helpers import CHUNK, every_exponent, expected_rows, random_bits

from gradfuse.ops import library

pytestmark = pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")
op = torch.ops.gradfuse.multi_tensor_exponent_histogram
PAIR_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = lambda d: str(d).replace("torch.", "")  # noqa: E731
EDGE_SIZES = [1, 15, 16, 17, 31, 33, 255, 256, 257, 271, 4095, 4111, CHUNK - 17, CHUNK - 16, CHUNK + 15]


@pytest.fixture(params=["avx512", "avx2", "default"])
def cpu_capability(request):
    """Every CPU histogram loop this machine can run.

    The AVX-512 counting loop of the AVX2 kernels, their AVX2 loop, the default build. (Shadows
    tests/conftest.py's fixture.)
    """
    if library.extension is None:
        pytest.skip("gradfuse._C not built")
    info = library.extension.build_info()
    if request.param != "default" and info["best_cpu_capability"] != "avx2":
        pytest.skip("no AVX2 on this CPU")
    if request.param == "avx512" and not info["histogram_avx512"]:
        pytest.skip("no AVX512BW + AVX512_BITALG + GFNI on this CPU")
    before = library.extension.cpu_capability(), library.extension.histogram_avx512()
    library.extension.set_cpu_capability("default" if request.param == "default" else "avx2")
    library.extension.set_histogram_avx512(request.param == "avx512")
    yield request.param
    library.extension.set_cpu_capability(before[0])
    library.extension.set_histogram_avx512(before[1])


def check(tensors):
    got = op(tensors)
    expect = expected_rows(tensors)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    assert got.sum(1).tolist() == [t.numel() for t in tensors]
    return got


def uniform(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) * 2 - 1).to(dtype)


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_edge_sizes_and_unaligned_starts(dtype, cpu_capability):
    tensors = [every_exponent(dtype, n, seed=n) for n in EDGE_SIZES]
    base = every_exponent(dtype, CHUNK + 300, seed=1)
    tensors += [base[k:] for k in (1, 3, 7)]  # starts off any 32-byte boundary
    got = check(tensors)
    assert (got > 0).sum(1).min() >= 1 and (got[-1] > 0).sum() > 30  # many bins, not one


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_random_bit_patterns(dtype, cpu_capability):
    got = check([random_bits(dtype, n, seed=n) for n in (257, CHUNK, 2 * CHUNK + 99)])
    assert got[:, 280:].sum() > 0 and (got[-1] > 0).sum() > 40  # NaN / Inf and most exponents


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_one_value_everywhere(dtype, cpu_capability):
    # A chunk of one value (every increment on one counter), then a chunk of zeros, of NaN, of
    # -Inf, of one subnormal: the lumped rows pass 2 sorts out.
    tiny = torch.finfo(dtype).smallest_normal / 4
    tensors = [torch.full((CHUNK,), v, dtype=dtype) for v in (0.75, 0.0, math.nan, -math.inf, tiny)]
    tensors.append(torch.full((3 * CHUNK + 5,), -3.0, dtype=dtype))
    got = check(tensors)
    assert got.max(1).values.tolist() == [t.numel() for t in tensors]


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_no_count_leaks_between_chunks_and_calls(dtype, cpu_capability):
    # A wide chunk (every field) between narrow ones, twice, and the same call repeated: a
    # counter left over from one chunk or call would show in a later count.
    wide = every_exponent(dtype, CHUNK, seed=5)
    narrow = uniform(dtype, CHUNK + 1000, seed=6)
    first = check([narrow, wide, narrow, wide, narrow[:100]])
    again = check([narrow, wide, narrow, wide, narrow[:100]])
    assert torch.equal(first, again) and torch.equal(first[0], first[2])
    check([uniform(dtype, 40000, seed=7)])


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_builds_agree_across_threads(dtype):
    from gradfuse.ops import library as ext
    if ext.extension.build_info()["best_cpu_capability"] != "avx2":
        pytest.skip("no AVX2 on this CPU")
    tensors = [uniform(dtype, n, seed=n) for n in (768, 2304 * 768, 3 * CHUNK + 7, 50, 0, CHUNK)]
    tensors[2][::1000] = 0.0
    before_isa, before_threads = ext.extension.cpu_capability(), torch.get_num_threads()
    before_wide = ext.extension.histogram_avx512()
    loops = [("default", False), ("avx2", False)] + [("avx2", True)] * ext.extension.build_info()["histogram_avx512"]
    results = {}
    try:
        for isa, wide in loops:
            ext.extension.set_cpu_capability(isa)
            ext.extension.set_histogram_avx512(wide)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                results[isa, wide, threads] = op(tensors)
    finally:
        ext.extension.set_cpu_capability(before_isa)
        ext.extension.set_histogram_avx512(before_wide)
        torch.set_num_threads(before_threads)
    expect = expected_rows(tensors)
    for got in results.values():
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
    assert expect[1].count_nonzero() > 10 and expect[2, 1] > 0  # many binades; zeros (pass 2)


# ---- the hot-field AVX2 kernel ---------------------------------------------------------------
SAMPLE, VEC, BLOCK = 256, 32, 64 * 32


def binade_values(dtype, exps, n, seed):
    """N values of `dtype` with floor(log2|x|) drawn from `exps` (cycled), random signs and
    mantissas: exactly the fields those exponents have."""
    g = torch.Generator().manual_seed(seed)
    e = torch.tensor(exps, dtype=torch.float64).repeat(n // len(exps) + 1)[:n]
    u = 1 + torch.rand(n, generator=g, dtype=torch.float64) * 0.9
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return (sign * u * torch.exp2(e)).to(dtype)


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_hot_field_boundaries(dtype, cpu_capability):
    # Exactly 8 fields (every lane hot), 9 fields (the ninth always misses), 7 fields (a hot
    # field that never occurs), one field per vector lane pattern, and 8 fields whose counts
    # tie; every size past the sample in whole vectors, plus tails.
    top = 12 if dtype == torch.float16 else 20
    tensors = []
    for k in (7, 8, 9):
        exps = list(range(top - k, top))
        for n in (SAMPLE + VEC - 1, SAMPLE + VEC, SAMPLE + BLOCK, SAMPLE + BLOCK + 33, CHUNK, CHUNK + 95):
            tensors.append(binade_values(dtype, exps, n, seed=n + k))
    got = check(tensors)
    assert (got[:6] > 0).sum(1).eq(7).all() and (got[-6:] > 0).sum(1).eq(9).all()


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_a_missing_lane_at_every_position(dtype, cpu_capability):
    # After the sample, vector v holds one element of a field outside the hot eight, at lane
    # position v % 32 (of 32 elements): the lane -> element map of the packed fields is exercised
    # at every byte lane (and a wrong map counts a hot field twice).
    n = SAMPLE + 64 * VEC
    x = binade_values(dtype, [0, -1, -2, -3, -4, -5, -6, -7], n, seed=3)
    far = binade_values(dtype, [8, 9, 10], 64, seed=4)
    for v in range(64):
        x[SAMPLE + v * VEC + v % VEC] = far[v]
    tensors = [x, x[1:], x[: n - 5]]
    got = check(tensors)
    assert got[0, 8 + 151:11 + 151].sum() == 64


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_hot_fields_shift_within_and_across_chunks(dtype, cpu_capability):
    # The distribution moves every few blocks (a new sample each time), between chunks of one
    # tensor (the carried hot fields are all wrong for the next chunk's first block) and between
    # tensors; blocks of values spread over every field (the scalar run) in between.
    lo, hi = (-12, 12) if dtype == torch.float16 else (-100, 100)
    parts = []
    for i, base in enumerate([0, hi - 8, lo + 2, 0, hi - 8]):
        parts.append(binade_values(dtype, list(range(base, base + 8)), 3 * BLOCK + 17 * i, seed=i))
        parts.append(every_exponent(dtype, BLOCK + 5, seed=i))
    x = torch.cat(parts)
    y = torch.cat([binade_values(dtype, [hi - 1], CHUNK, seed=1), binade_values(dtype, [lo + 1], CHUNK + 77, seed=2)])
    got = check([x, y, x[3:], y[5:]])
    assert (got[0] > 0).sum() > 30 and got[1, lo + 1 + 151] == CHUNK + 77


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_all_outlier_vectors(dtype, cpu_capability):
    # Every field equally often (no eight cover 7/8): the scalar runs and samples alternate; and
    # a sample of one value followed by a block where every lane misses.
    spread = random_bits(dtype, 3 * CHUNK + 11, seed=9)
    flip = torch.cat([torch.full((SAMPLE,), 0.75, dtype=dtype), random_bits(dtype, 5 * BLOCK, seed=10)])
    got = check([spread, flip])
    assert (got[0] > 0).sum() > 40


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_special_values_in_pass_two(dtype, cpu_capability):
    # Pass 2 counts zeros in vector lanes and sends subnormals / Inf / NaN one by one: mostly-
    # zero chunks (embedding-like), zeros of both signs, subnormals, +-Inf and NaN (payloads of
    # both signs) at every lane position of a vector and in the tail, among normal values.
    tiny = torch.finfo(dtype).smallest_normal
    n = CHUNK + 3 * VEC + 7
    x = torch.zeros(n, dtype=dtype)
    x[::97] = binade_values(dtype, [-3, -4, -5], len(x[::97]), seed=1)
    specials = [-0.0, tiny / 2, -tiny / 64, math.inf, -math.inf, math.nan, tiny, 0.0]
    for p in range(40):
        x[p * 33 % n] = specials[p % len(specials)]
        x[n - 1 - p] = specials[(p + 3) % len(specials)]
    nan_neg = torch.tensor([-math.nan], dtype=dtype)
    x[1000:1016] = nan_neg
    y = binade_values(dtype, [0, -1], n, seed=5)
    y[7::500] = 0.0
    y[11::777] = tiny / 8
    got = check([x, y, x[1:], y[3:]])
    assert got[0, 1] > CHUNK // 2 and got[0, 280:].sum() > 20 and got[1, 1] > 100


@pytest.mark.parametrize("dtype", PAIR_DTYPES + [torch.float64], ids=IDS)
def test_many_tensors_of_mixed_distributions(dtype, cpu_capability):
    g = torch.Generator().manual_seed(0)
    tensors = []
    for i in range(120):
        n = int(torch.randint(0, 5000, (1,), generator=g)) if i % 10 else CHUNK + i
        kind = i % 4
        if kind == 0:
            t = (torch.randn(n, generator=g) * 1e-3).to(dtype)
        elif kind == 1:
            t = uniform(dtype, n, seed=i)
        elif kind == 2:
            t = torch.full((n,), 2.0 ** (i % 9), dtype=dtype)
        else:
            t = every_exponent(dtype, n, seed=i)
        tensors.append(t)
    got = check(tensors)
    assert got.sum() > 100000 and (got.sum(0) > 0).sum() > 30


# ---- the AVX-512 counting loop ---------------------------------------------------------------
GROUP, GROUPS = 64, 31  # elements per AVX-512 step, steps per block of byte counters


def test_avx512_loop_is_the_default_where_the_cpu_has_it():
    info = library.extension.build_info()
    if not info["histogram_avx512"]:
        with pytest.raises(RuntimeError, match="AVX512BW"):
            library.extension.set_histogram_avx512(True)
        assert not library.extension.histogram_avx512()
        return
    import os
    assert library.extension.histogram_avx512() == (os.environ.get("GRADFUSE_HISTOGRAM_AVX512") != "0")


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_a_missing_lane_at_every_position_of_a_group(dtype, cpu_capability):
    # One out-of-window element per 64-element group, at lane position g % 64, over three blocks of
    # 31 groups; the field bytes the loop stores for such lanes must be the element's field.
    n = SAMPLE + 3 * GROUPS * GROUP
    x = binade_values(dtype, [0, -1, -2, -3, -4, -5, -6, -7], n, seed=13)
    far = binade_values(dtype, [8, 9, 10, -9, -10], 3 * GROUPS, seed=14)
    for g in range(3 * GROUPS):
        x[SAMPLE + g * GROUP + g % GROUP] = far[g]
    got = check([x, x[7:], x[: n - 33]])
    assert got[0, [8 + 151, 9 + 151, 10 + 151, -9 + 151, -10 + 151]].sum() == 3 * GROUPS


@pytest.mark.parametrize("dtype", PAIR_DTYPES, ids=IDS)
def test_byte_counters_full_at_block_ends(dtype, cpu_capability):
    # One field in every lane: each byte counter reaches 8 per group, 248 at the end of a
    # 31-group block (a block of 32 would wrap past 255); sizes at block and group edges.
    sizes = [SAMPLE + GROUPS * GROUP * k + r for k in (1, 2, 33) for r in (-1, 0, 1, GROUP - 1, GROUP)]
    tensors = [torch.full((n,), -0.375, dtype=dtype) for n in sizes]
    got = check(tensors)
    assert got[:, -2 + 151].tolist() == sizes
