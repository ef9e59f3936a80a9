"""The exponent histogram (torch.ops.gradfuse.multi_tensor_exponent_histogram, gradfuse.stats /
tensor_stats(histogram=True)) against a torch.frexp reference, and the headroom columns against
real casts to float16, bfloat16, float8_e4m3fn and float8_e5m2."""
import math

import pytest
import torch
from hist_helpers import CHUNK, SIZES, every_exponent, expected_rows, frexp_histogram, random_bits
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradfuse
from gradfuse import headroom
from gradfuse import histogram as H
from gradfuse.ops import library

pytestmark = pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")
op = torch.ops.gradfuse.multi_tensor_exponent_histogram
DTYPE_EXPONENTS = {torch.float16: (-24, 15), torch.bfloat16: (-133, 127), torch.float32: (-149, 127)}


def check(tensors):
    got = op(tensors)
    assert got.dtype == torch.int64 and got.shape == (len(tensors), H.NUM_BINS)
    torch.testing.assert_close(got, expected_rows(tensors), rtol=0, atol=0)
    assert got.sum(1).tolist() == [t.numel() for t in tensors]
    return got


def test_layout_matches_python_constants():
    assert gradfuse.build_info()["histogram_bins"] == H.NUM_BINS
    labels = H.bin_labels()
    assert len(labels) == H.NUM_BINS and labels[H.bin_of_exponent(0)] == "2^0"
    assert labels[H.BIN_ZERO] == "0" and labels[H.BIN_NAN] == "nan"
    x = torch.tensor([0.0, -0.0, 1.0, 1.5, 2.0, 0.75, -3.0, math.inf, -math.inf, math.nan, 2.0 ** -149])
    h = op([x])[0]
    expect = torch.zeros(H.NUM_BINS, dtype=torch.int64)
    for b, count in [(H.BIN_ZERO, 2), (H.bin_of_exponent(0), 2), (H.bin_of_exponent(1), 2),
                     (H.bin_of_exponent(-1), 1), (H.BIN_POS_INF, 1), (H.BIN_NEG_INF, 1),
                     (H.BIN_NAN, 1), (H.bin_of_exponent(-149), 1)]:
        expect[b] = count
    assert h.tolist() == expect.tolist()


def test_every_bin_of_every_dtype(dtype):
    sizes = SIZES + [1000]
    tensors = [every_exponent(dtype, n, seed=i) for i, n in enumerate(sizes)]
    got = check(tensors)
    big = got[-2]  # 3 * CHUNK + 5 elements: every binade of the dtype is reached
    lo, hi = DTYPE_EXPONENTS.get(dtype, (-149, 127))
    assert (big[H.bin_of_exponent(lo):H.bin_of_exponent(hi) + 1] > 0).all()
    assert big[H.BIN_ZERO] >= 7 and big[H.BIN_NAN] == 4 and big[H.BIN_POS_INF] >= 3 and big[H.BIN_NEG_INF] >= 2
    if dtype == torch.float64:
        assert big[H.BIN_BELOW] > 0 and big[H.BIN_ABOVE] > 0
    else:
        assert big[H.BIN_BELOW] == 0 and big[H.BIN_ABOVE] == 0
        assert big[:H.bin_of_exponent(lo)].sum() == big[H.BIN_ZERO]


def test_random_bit_patterns(dtype):
    tensors = [random_bits(dtype, n, seed=n) for n in (5, CHUNK + 3, 2 * CHUNK)]
    got = check(tensors)
    assert got[2, H.BIN_NAN] > 0 and got[2, H.BIN_POS_INF] + got[2, H.BIN_NEG_INF] >= 0


def test_all_same_exponent_and_constants(dtype):
    tensors = [torch.full((3 * CHUNK + 5,), 1.25, dtype=dtype), torch.zeros(CHUNK + 1, dtype=dtype),
               torch.full((CHUNK,), -math.inf, dtype=dtype), torch.full((10,), math.nan, dtype=dtype)]
    got = check(tensors)
    assert got[0, H.bin_of_exponent(0)] == 3 * CHUNK + 5
    assert got[1, H.BIN_ZERO] == CHUNK + 1 and got[2, H.BIN_NEG_INF] == CHUNK and got[3, H.BIN_NAN] == 10


def test_many_tensors_and_views(dtype):
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 50, (1300,), generator=g).tolist()
    tensors = [every_exponent(dtype, n, seed=i) for i, n in enumerate(sizes)]
    base = every_exponent(dtype, 2 * CHUNK + 64, seed=9)
    tensors += [base[1:CHUNK + 3], base[3:], base.reshape(-1, 64).t(), base[::3]]  # views, strided
    check(tensors)


def test_empty_list_and_errors():
    assert H.multi_tensor_exponent_histogram([]).shape == (0, H.NUM_BINS)  # the dispatcher needs a tensor
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Int"):
        op([torch.ones(3), torch.ones(3, dtype=torch.int32)])
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Double but tensors\[0\] has Float"):
        op([torch.ones(3), torch.ones(3, dtype=torch.float64)])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
                          st.integers(0, 3000), st.integers(0, 10 ** 6), st.booleans()),
                min_size=0, max_size=6))
def test_property_mixed_groups_equal_reference(specs):
    tensors = [random_bits(dt, n, seed) if bits else every_exponent(dt, n, seed) for dt, n, seed, bits in specs]
    got = H.exponent_histogram(tensors)
    torch.testing.assert_close(got, expected_rows(tensors), rtol=0, atol=0)


def test_reference_fallback_equals_op(dtype):
    tensors = [every_exponent(dtype, n, seed=n) for n in (0, 9, CHUNK + 1)]
    torch.testing.assert_close(H.reference_histogram(tensors), op(tensors), rtol=0, atol=0)


# ----- the public API


def test_stats_with_histogram_rows_follow_names():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[2].double()  # two (device, dtype) groups: rows ordered group by group
    x = torch.randn(5, 8)
    (model[2](model[1](model[0](x)).double())).sum().backward()
    model[0].weight.grad[0, :3] = torch.tensor([0.0, math.inf, math.nan])
    s = gradfuse.stats(model, histogram=True)
    assert s.exponent_histogram.shape == (4, H.NUM_BINS)
    grads = dict(model.named_parameters())
    for i, name in enumerate(s.names):
        assert s.exponent_histogram[i].tolist() == frexp_histogram(grads[name].grad).tolist(), name
    assert gradfuse.stats(model).exponent_histogram is None
    d = s.headroom_dict()
    assert set(d) == set(s.names) and set(d["0.weight"]) == set(headroom.COLUMNS)


def test_tensor_stats_histogram_on_activations():
    acts = {"a": torch.randn(100, 30) * 1e-6, "b": torch.zeros(7), "c": torch.randn(3, dtype=torch.bfloat16)}
    s = gradfuse.tensor_stats(acts, histogram=True)
    assert sorted(s.names) == ["a", "b", "c"]  # grouped by dtype: c (bf16) comes first
    for i, name in enumerate(s.names):
        assert s.exponent_histogram[i].tolist() == frexp_histogram(acts[name]).tolist()
    cols = {k: dict(zip(s.names, v.tolist())) for k, v in s.headroom.items()}
    # 1e-6 is below fp8 e4m3's smallest subnormal 2^-9 (and e5m2's 2^-16 within a few binades)
    assert cols["fp8_e4m3_underflow"]["a"] == 1.0 and cols["fp8_e4m3_underflow_scaled"]["a"] < 0.01
    assert cols["fp16_underflow"]["b"] == 0 and cols["fp16_subnormal"]["b"] == 0  # zeros are neither
    assert "fp8_e5m2" in headroom.table(s.names, s.headroom)


# ----- headroom against real casts

MANTISSA_BITS = {"fp16": 10, "bf16": 7, "fp8_e4m3": 3, "fp8_e5m2": 2}
CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
         "fp8_e5m2": torch.float8_e5m2}


def cast_reference(x: torch.Tensor, fmt: str, scale: float = 1.0) -> dict[str, float]:
    """What a cast to the format does to x * scale, counted on the cast's result: 0 from a
    non-zero value, a subnormal, and an overflow: Inf from a finite value, or, for torch's
    float8_e4m3fn cast, which saturates (448 for anything larger, Inf included), the maximum from
    a value beyond the format's rounding limit max + half an ulp (464), which the format itself
    (no Inf) maps to NaN."""
    f = headroom.FORMATS[fmt]
    y64 = x.to(torch.float64) * scale
    y = y64.to(CASTS[fmt]).to(torch.float64)
    finite_in = torch.isfinite(y64)
    half_ulp = 2.0 ** (f.max_exponent - MANTISSA_BITS[fmt] - 1)
    saturated = (y.abs() == f.max_value) & (y64.abs() > f.max_value + half_ulp)
    n = x.numel()
    return {
        "underflow": int(((y == 0) & (y64 != 0) & finite_in).sum()) / n,
        "subnormal": int(((y != 0) & (y.abs() < 2.0 ** f.min_normal_exponent) & finite_in).sum()) / n,
        "overflow": int(((~torch.isfinite(y) | saturated) & finite_in).sum()) / n,
    }


def binade_values(lo: int, hi: int, n: int, seed: int) -> torch.Tensor:
    """``n`` float64 values u * 2^e, e in [lo, hi], u in (1, 1.5]: no cast rounds them across a binade
    edge (see gradfuse.headroom: the slivers the exponent cannot see)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(lo, hi + 1, (n,), generator=g).double()
    u = 1 + torch.randint(1, 5, (n,), generator=g).double() / 8
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return sign * u * torch.exp2(e)


@pytest.mark.parametrize("fmt", list(CASTS))
def test_headroom_unscaled_equals_cast(fmt):
    x = binade_values(-170, 140, 50_000, seed=1)
    x[:100] = 0.0
    x[100:110] = math.nan
    x[110:115] = -math.inf
    s = gradfuse.tensor_stats([x], histogram=True)
    ref = cast_reference(x, fmt)
    assert ref["underflow"] > 0.1 and ref["subnormal"] > 0.005 and ref["overflow"] > 0.02  # all three happen
    for kind in headroom.KINDS:
        assert s.headroom[f"{fmt}_{kind}"].item() == pytest.approx(ref[kind], abs=1e-12), kind


@pytest.mark.parametrize("fmt", list(CASTS))
def test_headroom_scaled_power_of_two_equals_cast(fmt):
    f = headroom.FORMATS[fmt]
    # amax = max_value * 2^-20: TransformerEngine's scale max_value / amax is 2^20
    # (not below 2^-149: float64's bin 0 is taken as one binade, see gradfuse.headroom)
    x = binade_values(max(f.min_subnormal_exponent - 25, -149), f.max_exponent - 21, 20_000, seed=2)
    x[0] = f.max_value * 2.0 ** -20
    s = gradfuse.tensor_stats({"t": x}, histogram=True)
    scale = headroom.amax_scale(torch.tensor([x.abs().max()]), f).item()
    assert scale == 2.0 ** 20
    ref = cast_reference(x, fmt, scale)
    assert (ref["underflow"] > 0 or fmt == "bf16") and ref["subnormal"] > 0 and ref["overflow"] == 0
    unscaled = cast_reference(x, fmt)
    assert unscaled["underflow"] + unscaled["subnormal"] > ref["underflow"] + ref["subnormal"]  # scaling mattered
    for kind in headroom.KINDS:
        assert s.headroom[f"{fmt}_{kind}_scaled"].item() == pytest.approx(ref[kind], abs=1e-12), kind
        assert s.headroom[f"{fmt}_{kind}"].item() == pytest.approx(unscaled[kind], abs=1e-12), kind


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp16"])
def test_headroom_scaled_any_amax_within_the_straddling_binades(fmt):
    """A scale that is not a power of two splits a binade at each threshold: the estimate can
    differ from the cast by at most the elements of the binades next to a threshold."""
    f = headroom.FORMATS[fmt]
    g = torch.Generator().manual_seed(4)
    # magnitudes spread over ~60 binades, so that every threshold has elements around it
    x = torch.randn(200_000, generator=g, dtype=torch.float64) * torch.exp2(6 * torch.randn(200_000, generator=g))
    x = x.float().double()
    s = gradfuse.tensor_stats([x.float()], histogram=True)
    scale = headroom.amax_scale(torch.tensor([x.abs().max()]), f).item()
    assert math.log2(scale) % 1 != 0
    ref = cast_reference(x, fmt, scale)
    h = s.exponent_histogram[0].double()
    k = math.log2(scale)
    near = set()
    for threshold in (f.min_subnormal_exponent - 1, f.min_normal_exponent):  # overflow: exactly 0 below
        e = math.floor(threshold - k)
        near |= {e - 1, e, e + 1}
    bound = sum(h[H.bin_of_exponent(e)].item() for e in near if -149 <= e <= 127) / x.numel()
    for kind in headroom.KINDS:
        got = s.headroom[f"{fmt}_{kind}_scaled"].item()
        assert abs(got - ref[kind]) <= bound + 1e-12, (kind, got, ref[kind], bound)
    assert s.headroom[f"{fmt}_overflow_scaled"].item() == 0 == ref["overflow"]
    assert ref["underflow"] > 0.001 and ref["subnormal"] > 0.001  # something to compare


def test_amax_scale_follows_transformer_engine():
    f = headroom.FORMATS["fp8_e4m3"]
    amax = torch.tensor([2.0, 0.0, math.inf, math.nan, 448.0])
    assert headroom.amax_scale(amax, f).tolist() == [224.0, 1.0, 1.0, 1.0, 1.0]


# ----- the monitor and the picture


def test_monitor_histogram_on_logging_steps(tmp_path):
    from gradfuse.sinks import metrics, read_jsonl
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    path = tmp_path / "run.jsonl"
    mon = gradfuse.GradMonitor(model, every=5, histogram=True, sinks=[gradfuse.JsonlSink(path)])
    for _ in range(11):
        x = torch.randn(16, 32)
        (model(x) - x[:, :1]).square().mean().backward()
        mon.step()
        if mon.step_count == 11:
            expect = {n: frexp_histogram(p.grad) for n, p in model.named_parameters()}
        model.zero_grad()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [0, 5, 10]
    last = records[-1]
    assert set(last["exponents"]) == {"0", "2"}
    e = last["exponents"]["0"]
    counts = torch.zeros(H.NUM_BINS, dtype=torch.int64)
    counts[e["first_bin"]:e["first_bin"] + len(e["counts"])] = torch.tensor(e["counts"])
    assert counts.tolist() == (expect["0.weight"] + expect["0.bias"]).tolist()
    m = metrics(last)
    assert 0 < m["headroom/0/fp8_e4m3_underflow"] + m["headroom/0/fp8_e4m3_subnormal"] <= 1
    assert m["headroom/0/fp8_e4m3_overflow_scaled"] == 0
    from gradfuse.viz.gradflow import plot_gradflow
    plot_gradflow(path, tmp_path / "flow.png")
    assert (tmp_path / "flow_exponents.png").stat().st_size > 10_000
