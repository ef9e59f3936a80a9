"""The CPU kernels of the optimizer-update ops against the float64 reference and torch.optim.

multi_tensor_update_stats: every row against gradfuse.ops.update_reference on fresh random inputs for SGD
and Adam / AdamW configurations, each dtype, both CPU builds, odd sizes, empty tensors and
non-finite values; thread-count independence; argument errors; the update's sum of squares against
w_after - w_before taken around a real optimizer.step(). multi_tensor_update_clip_: the clipped
weights against w_before + c * (w_after - w_before) around a real step, and tensors whose
coefficient is not below 1 left as they are, bit for bit."""
import math
import re

import pytest
import torch

from gradfuse.ops import library, update_reference
from gradfuse.ops.layout import (
    EPS_DOMINATED,
    FLAG_AMSGRAD,
    FLAG_DECOUPLED,
    FLAG_MAXIMIZE,
    FLAG_NESTEROV,
    MOMENT1_SUMSQ,
    MOMENT2_SUMSQ,
    MOMENT_NONFINITE,
    NUM_HYPER,
    NUM_UPDATE_COUNT_STATS,
    NUM_UPDATE_FLOAT_STATS,
    RULE_ADAM,
    RULE_SGD,
    UPDATE_COUNT_NAMES,
    UPDATE_FLOAT_NAMES,
    UPDATE_NONFINITE,
    UPDATE_NUMEL,
    UPDATE_SUMSQ,
    WEIGHT_NONFINITE,
    WEIGHT_SUMSQ,
)

pytestmark = pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")

stats_op = torch.ops.gradfuse.multi_tensor_update_stats
clip_op = torch.ops.gradfuse.multi_tensor_update_clip_
CHUNK = 65536
SIZES = [1, 7, CHUNK + 3, 0, 2 * CHUNK + 17, 16, 33]

# SGD: (name, lr, weight_decay, momentum, dampening, flags, state present); Adam: (name, lr, weight_decay,
# beta1, beta2, eps, step t, flags, state present). CONFIGS: (name, rule, the hyper row, state present).
SGD_CONFIGS = [
    ("sgd", 0.1, 0.0, 0.0, 0.0, 0, False),
    ("sgd_wd", 0.05, 1e-2, 0.0, 0.0, 0, False),
    ("momentum", 0.1, 0.0, 0.9, 0.0, 0, True),
    ("momentum_first_step", 0.1, 1e-2, 0.9, 0.1, 0, False),
    ("dampening_wd_maximize", 0.02, 1e-2, 0.9, 0.3, FLAG_MAXIMIZE, True),
    ("nesterov_wd", 0.1, 1e-2, 0.9, 0.0, FLAG_NESTEROV, True),
    ("nesterov_maximize_first_step", 0.1, 0.0, 0.8, 0.0, FLAG_NESTEROV | FLAG_MAXIMIZE, False),
]
ADAM_CONFIGS = [
    ("adam_first_step", 1e-3, 0.0, 0.9, 0.999, 1e-8, 1, 0, False),
    ("adam", 1e-3, 0.0, 0.9, 0.999, 1e-8, 10, 0, True),
    ("amsgrad", 1e-2, 0.0, 0.8, 0.99, 1e-6, 3, FLAG_AMSGRAD, True),
    ("amsgrad_l2_maximize", 1e-3, 1e-2, 0.9, 0.999, 1e-8, 100, FLAG_AMSGRAD | FLAG_MAXIMIZE, True),
    ("adamw", 1e-3, 1e-2, 0.9, 0.999, 1e-8, 5, FLAG_DECOUPLED, True),
    ("adamw_amsgrad_first_step", 1e-2, 1e-1, 0.9, 0.95, 1e-8, 1, FLAG_DECOUPLED | FLAG_AMSGRAD, False),
    ("adamw_maximize_large_t", 3e-4, 1e-2, 0.6, 0.999, 1e-3, 1000, FLAG_DECOUPLED | FLAG_MAXIMIZE, True),
]
CONFIGS = ([(c[0], RULE_SGD, *c[1:5], 0.0, 0.0, *c[5:]) for c in SGD_CONFIGS]
           + [(c[0], RULE_ADAM, *c[1:]) for c in ADAM_CONFIGS])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def rand(n, dtype, seed, scale=1.0, positive=False):
    g = torch.Generator().manual_seed(seed)
    draw = torch.rand if positive else torch.randn
    x = draw(n, generator=g, dtype=torch.float64)
    return (x * scale).to(dtype)


def absent(dtype):
    return torch.empty(0, dtype=dtype)


def make_inputs(config, sizes, dtype, seed=0):
    """params, grads, moment1, moment2, moment2_max, hyper of one call: fresh random values, some
    zeros (a zero gradient on a zero second moment: eps-dominated), the state absent where the
    configuration says so."""
    _, rule, lr, wd, b1, b2, eps, t, flags, state = config
    params, grads, m1, m2, m2max = [], [], [], [], []
    for i, shape in enumerate(sizes):
        n, s = math.prod(shape) if isinstance(shape, tuple) else shape, seed * 1000 + 10 * i
        w, g = rand(n, dtype, s), rand(n, dtype, s + 1, 0.5)
        m = rand(n, dtype, s + 2, 0.1)
        v = rand(n, dtype, s + 3, 0.01, positive=True)
        vmax = (v.double() + rand(n, torch.float64, s + 4, 0.001, positive=True)).to(dtype)
        zeros = torch.arange(0, n, 5)
        g[zeros], v[zeros], vmax[zeros], m[zeros] = 0, 0, 0, 0
        w, g, m, v, vmax = (x.reshape(shape) for x in (w, g, m, v, vmax))
        params.append(w)
        grads.append(g)
        use_m = state and (rule == RULE_ADAM or b1 != 0)
        m1.append(m if use_m else absent(dtype))
        m2.append(v if state and rule == RULE_ADAM else absent(dtype))
        m2max.append(vmax if state and rule == RULE_ADAM and flags & FLAG_AMSGRAD else absent(dtype))
    hyper = torch.tensor([[lr, wd, b1, b2, eps, t, flags]] * len(sizes), dtype=torch.float64).reshape(-1, NUM_HYPER)
    return params, grads, m1, m2, m2max, hyper, rule


def assert_rows_match_reference(args, got):
    f, c = got
    rf, rc = update_reference.multi_tensor_update_stats(*args)
    n = len(args[0])
    assert f.dtype == torch.float64 and c.dtype == torch.int64
    assert f.shape == (n, NUM_UPDATE_FLOAT_STATS) and c.shape == (n, NUM_UPDATE_COUNT_STATS)
    torch.testing.assert_close(c, rc, rtol=0, atol=0)
    if n == 0:
        return
    # acc_t rounding (float, float64 for float64 input). AdamW's update holds w * (1 - lr * wd) - w,
    # whose rounding is that of the weight (as in torch's own step): |u_got - u| <= eps * |w| per
    # element, so the sum of squares may be off by 2 eps sqrt(sum u^2 sum w^2) + eps^2 sum w^2.
    eps = 2.0 ** -52 if args[0][0].dtype == torch.float64 else 2.0 ** -23
    rtol = 64 * eps if args[0][0].dtype == torch.float64 else 2e-5
    slack = torch.zeros_like(rf)
    wsq = rf[:, WEIGHT_SUMSQ].nan_to_num(posinf=0)
    slack[:, UPDATE_SUMSQ] = 2 * eps * (rf[:, UPDATE_SUMSQ].abs() * wsq).sqrt() + eps * eps * wsq
    finite = rf.isfinite() & f.isfinite()
    infinite = ~finite & ~rf.isnan()
    assert torch.equal(f.isnan(), rf.isnan()) and torch.equal(f[infinite], rf[infinite])
    err = (f - rf).abs()[finite]
    bound = (rtol * rf.abs() + slack + 1e-300)[finite]
    assert (err <= bound).all(), (f, rf)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_layout_matches_the_extension():
    info = library.extension.build_info()
    assert info["update_stats_layout"] == (list(UPDATE_FLOAT_NAMES), list(UPDATE_COUNT_NAMES))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c[0])
def test_stats_match_reference(config, dtype, cpu_capability):
    args = make_inputs(config, SIZES, dtype, seed=CONFIGS.index(config))
    assert_rows_match_reference(args, stats_op(*args))


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 31, CHUNK - 1, CHUNK, CHUNK + 3, 2 * CHUNK + 5])
@pytest.mark.parametrize("config", [CONFIGS[4], CONFIGS[-3]], ids=lambda c: c[0])
def test_odd_sizes(config, n, cpu_capability):
    for dtype in (torch.float32, torch.bfloat16):
        args = make_inputs(config, [n], dtype, seed=n)
        assert_rows_match_reference(args, stats_op(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("config", [CONFIGS[4], CONFIGS[6], CONFIGS[8], CONFIGS[11]], ids=lambda c: c[0])
def test_non_finite_counts(config, dtype, cpu_capability):
    args = make_inputs(config, [CHUNK + 40, 9, 100], dtype, seed=7)
    params, grads, m1 = args[0], args[1], args[2]
    params[0][[3, CHUNK + 1]] = math.inf
    params[0][5] = -math.inf
    params[0][CHUNK + 20] = math.nan
    grads[0][[10, CHUNK + 30]] = math.nan
    grads[1][2] = -math.inf
    if m1[2].numel():
        m1[2][[0, 50]] = math.nan
    params[2][7] = -0.0
    f, c = stats_op(*args)
    assert_rows_match_reference(args, (f, c))
    assert c[0, WEIGHT_NONFINITE] == 4 and c[1, WEIGHT_NONFINITE] == 0
    assert c[0, UPDATE_NONFINITE] >= 2 and c[1, UPDATE_NONFINITE] == 1  # the NaN gradients, the infinite one
    assert math.isnan(f[0, UPDATE_SUMSQ]) and math.isnan(f[0, WEIGHT_SUMSQ])


def test_amsgrad_running_max_propagates_nan_like_torch_maximum(cpu_capability):
    # v_max NaN where the new second moment is finite: torch.maximum gives NaN
    config = CONFIGS[len(SGD_CONFIGS) + 2]
    args = make_inputs(config, [40], torch.float32)
    args[4][0][[1, 33]] = math.nan
    f, c = stats_op(*args)
    assert_rows_match_reference(args, (f, c))
    assert c[0, MOMENT_NONFINITE] == 2 and c[0, UPDATE_NONFINITE] == 2
    assert math.isnan(f[0, MOMENT2_SUMSQ])


def test_empty_list_and_empty_tensors(cpu_capability):
    f, c = stats_op([], [], [], [], [], torch.empty(0, NUM_HYPER, dtype=torch.float64), RULE_ADAM)
    assert f.shape == (0, NUM_UPDATE_FLOAT_STATS) and c.shape == (0, NUM_UPDATE_COUNT_STATS)
    for config in (CONFIGS[2], CONFIGS[-2]):
        args = make_inputs(config, [0, 0], torch.float32)
        f, c = stats_op(*args)
        assert f.tolist() == [[0.0] * NUM_UPDATE_FLOAT_STATS] * 2 and c.tolist() == [[0] * NUM_UPDATE_COUNT_STATS] * 2
        clip_op(*args[:6], torch.full((2,), 0.5, dtype=torch.float64), args[6])


def test_eps_dominated_and_numel(cpu_capability):
    config = CONFIGS[len(SGD_CONFIGS) + 1]
    args = make_inputs(config, [CHUNK + 3, 10], torch.float32)
    f, c = stats_op(*args)
    assert c[:, UPDATE_NUMEL].tolist() == [CHUNK + 3, 10]
    assert c[0, EPS_DOMINATED] == len(range(0, CHUNK + 3, 5)) and c[1, EPS_DOMINATED] == 2
    sgd = make_inputs(CONFIGS[2], [100], torch.float32)
    assert stats_op(*sgd)[1][0, EPS_DOMINATED] == 0
    assert stats_op(*sgd)[0][0, MOMENT2_SUMSQ] == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("op", ["stats", "clip"])
def test_one_and_two_threads_bitwise_equal(op, dtype, cpu_capability, threads):
    sizes = [5 * CHUNK + 3, 17, 2 * CHUNK, 300_001, 0]
    args = make_inputs(CONFIGS[-2], sizes, dtype, seed=3)
    coefs = torch.tensor([0.5, 0.9, 2.0, 0.1, 0.3], dtype=torch.float64)
    results = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        if op == "stats":
            results.append(stats_op(*args))
        else:
            params = [p.clone() for p in args[0]]
            clip_op(params, *args[1:6], coefs, args[6])
            results.append(params)
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0], strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cpu_builds_agree_closely(dtype):
    if library.extension.build_info()["best_cpu_capability"] != "avx2":
        pytest.skip("only one CPU build on this machine")
    before = library.extension.cpu_capability()
    for config in (CONFIGS[5], CONFIGS[-1]):
        args = make_inputs(config, [3 * CHUNK + 3, 100], dtype, seed=11)
        got = {}
        try:
            for isa in ("avx2", "default"):
                library.extension.set_cpu_capability(isa)
                got[isa] = stats_op(*args)
        finally:
            library.extension.set_cpu_capability(before)
        torch.testing.assert_close(got["avx2"][1], got["default"][1], rtol=0, atol=0)
        torch.testing.assert_close(got["avx2"][0], got["default"][0], rtol=1e-5, atol=0)


# ---- Argument errors: the kernel and the reference raise the same message


def error_cases():
    base = make_inputs(CONFIGS[len(SGD_CONFIGS) + 2], [(4, 5), (3,)], torch.float32)
    params, grads, m1, m2, m2max, hyper, rule = base

    cases = {}
    cases["grads_length"] = ((params, grads[:1], m1, m2, m2max, hyper, rule), "grads has 1 tensors but params has 2")
    cases["moment2_max_length"] = ((params, grads, m1, m2, m2max + [m2max[0]], hyper, rule),
                                   "moment2_max has 3 tensors but params has 2")
    cases["grad_shape"] = ((params, [grads[0], torch.zeros(4)], m1, m2, m2max, hyper, rule),
                           "grads[1] must be contiguous with params[1]'s shape [3] and dtype Float on cpu, "
                           "got shape [4], dtype Float on cpu")
    cases["state_dtype"] = ((params, grads, [m1[0].double(), m1[1]], m2, m2max, hyper, rule),
                            "moment1[0] must be contiguous with params[0]'s shape [4, 5] and dtype Float on cpu "
                            "(or empty: absent), got shape [4, 5], dtype Double on cpu")
    cases["state_not_contiguous"] = ((params, grads, m1, [torch.zeros(5, 4).t(), m2[1]], m2max, hyper, rule),
                                     "moment2[0] must be contiguous with params[0]'s shape [4, 5] and dtype Float on "
                                     "cpu (or empty: absent), got shape [4, 5], dtype Float on cpu, not contiguous")
    cases["param_dtype"] = (([params[0], params[1].double()], grads, m1, m2, m2max, hyper, rule),
                            "params[1] is Double on cpu but params[0] is Float on cpu")
    cases["param_not_contiguous"] = (([torch.zeros(5, 4).t(), params[1]], grads, m1, m2, m2max, hyper, rule),
                                     "params[0] must be a dense contiguous float16, bfloat16, float32 or float64 "
                                     "tensor, got shape [4, 5], dtype Float on cpu, not contiguous")
    cases["param_int"] = (([params[0], torch.zeros(3, dtype=torch.int32)], grads, m1, m2, m2max, hyper, rule),
                          "params[1] must be a dense contiguous float16, bfloat16, float32 or float64 tensor, got "
                          "shape [3], dtype ")
    cases["hyper_shape"] = ((params, grads, m1, m2, m2max, hyper[:1], rule),
                            "hyper must be a contiguous float64 [2, 7] tensor on cpu, got shape [1, 7], dtype Double "
                            "on cpu")
    cases["hyper_dtype"] = ((params, grads, m1, m2, m2max, hyper.float(), rule),
                            "hyper must be a contiguous float64 [2, 7] tensor on cpu, got shape [2, 7], dtype Float "
                            "on cpu")
    cases["hyper_not_contiguous"] = ((params, grads, m1, m2, m2max, hyper.t().contiguous().t(), rule),
                                     "hyper must be a contiguous float64 [2, 7] tensor on cpu, got shape [2, 7], dtype "
                                     "Double on cpu, not contiguous")
    cases["rule"] = ((params, grads, m1, m2, m2max, hyper, 2), "rule must be 0 (SGD) or 1 (Adam, AdamW), got 2")
    return cases


@pytest.mark.parametrize("case", list(error_cases()))
@pytest.mark.parametrize("op", ["multi_tensor_update_stats", "multi_tensor_update_clip_"])
def test_argument_errors(op, case):
    args, message = error_cases()[case]
    if op == "multi_tensor_update_clip_":
        args = (*args[:6], torch.full((len(args[0]),), 0.5, dtype=torch.float64), args[6])
    pattern = re.escape(f"{op}: {message}")
    with pytest.raises(RuntimeError, match=pattern):
        getattr(torch.ops.gradfuse, op)(*args)
    with pytest.raises(RuntimeError, match=pattern):
        getattr(update_reference, op)(*args)


@pytest.mark.parametrize("coefs, message", [
    (torch.full((3,), 0.5, dtype=torch.float64),
     "coefs must be a float64 [2] tensor on cpu, got shape [3], dtype Double on cpu"),
    (torch.full((2,), 0.5), "coefs must be a float64 [2] tensor on cpu, got shape [2], dtype Float on cpu"),
    (torch.full((2, 1), 0.5, dtype=torch.float64), "coefs must be a float64 [2] tensor on cpu, got shape [2, 1], dtype "
                                                   "Double on cpu"),
])
def test_clip_coefs_errors(coefs, message):
    params, grads, m1, m2, m2max, hyper, rule = make_inputs(CONFIGS[-2], [4, 3], torch.float32)
    pattern = re.escape(f"multi_tensor_update_clip_: {message}")
    with pytest.raises(RuntimeError, match=pattern):
        clip_op(params, grads, m1, m2, m2max, hyper, coefs, rule)
    with pytest.raises(RuntimeError, match=pattern):
        update_reference.multi_tensor_update_clip_(params, grads, m1, m2, m2max, hyper, coefs, rule)


# ---- Against torch.optim: a real step on copies

# (name, optimizer class, options, warm-up steps before the measured one)
TORCH_CONFIGS = [
    ("sgd", torch.optim.SGD, dict(lr=0.1), 0),
    ("sgd_wd_maximize", torch.optim.SGD, dict(lr=0.1, weight_decay=1e-2, maximize=True), 0),
    ("momentum_first_step", torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2), 0),
    ("momentum", torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2), 2),
    ("nesterov", torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2), 1),
    ("nesterov_maximize", torch.optim.SGD, dict(lr=0.1, momentum=0.8, nesterov=True, maximize=True), 1),
    ("adam_first_step", torch.optim.Adam, dict(lr=1e-2), 0),
    ("adam", torch.optim.Adam, dict(lr=1e-2), 3),
    ("adam_l2_amsgrad", torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2, amsgrad=True), 2),
    ("adam_maximize", torch.optim.Adam, dict(lr=1e-2, maximize=True, betas=(0.8, 0.99)), 1),
    ("adamw", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), 2),
    ("adamw_first_step", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), 0),
    ("adamw_amsgrad_maximize", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True), 4),
]


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def optimizer_hyper(opt, params):
    """The rule, the hyper table and the state lists (as the op reads them) of `opt` now."""
    group = opt.param_groups[0]
    adam = "betas" in group
    rows, m1, m2, m2max = [], [], [], []
    for p in params:
        st = opt.state.get(p, {})
        flags = FLAG_MAXIMIZE if group["maximize"] else 0
        if adam:
            flags |= FLAG_AMSGRAD if group["amsgrad"] else 0
            flags |= FLAG_DECOUPLED if group["decoupled_weight_decay"] else 0
            t = float(st["step"]) + 1 if "step" in st else 1.0
            rows.append([group["lr"], group["weight_decay"], *group["betas"], group["eps"], t, flags])
            m1.append(st.get("exp_avg", absent(p.dtype)))
            m2.append(st.get("exp_avg_sq", absent(p.dtype)))
            m2max.append(st.get("max_exp_avg_sq", absent(p.dtype)))
        else:
            flags |= FLAG_NESTEROV if group["nesterov"] else 0
            rows.append([group["lr"], group["weight_decay"], group["momentum"], group["dampening"], 0.0, 0.0, flags])
            buf = st.get("momentum_buffer")
            m1.append(buf if buf is not None else absent(p.dtype))
            m2.append(absent(p.dtype))
            m2max.append(absent(p.dtype))
    hyper = torch.tensor(rows, dtype=torch.float64).reshape(-1, NUM_HYPER)
    return (RULE_ADAM if adam else RULE_SGD), hyper, m1, m2, m2max


def optimizer_for(config, dtype, sizes, seed):
    _, cls, options, warmup = config
    if dtype == torch.float16 and cls is not torch.optim.SGD:
        options = {**options, "eps": 1e-4}  # 1e-8 is 0 in float16: torch's step divides by zero
    params = [rand(n, dtype, seed + i).requires_grad_() for i, n in enumerate(sizes)]
    opt = cls(params, foreach=False, **options)
    for k in range(warmup):
        for i, p in enumerate(params):
            p.grad = rand(p.numel(), dtype, seed + 100 * (k + 1) + i, 0.5)
        opt.step()
    for i, p in enumerate(params):
        p.grad = rand(p.numel(), dtype, seed + 7 + i, 0.5)
    return params, opt


@pytest.mark.parametrize("config", TORCH_CONFIGS, ids=lambda c: c[0])
def test_update_stats_equal_those_of_a_real_step(config, cpu_capability):
    sizes = [CHUNK + 5, 4099, 33]
    params, opt = optimizer_for(config, torch.float32, sizes, seed=5)
    rule, hyper, m1, m2, m2max = optimizer_hyper(opt, params)
    with torch.no_grad():
        f, c = stats_op(params, [p.grad for p in params], m1, m2, m2max, hyper, rule)
        before = [p.detach().clone() for p in params]
        opt.step()
    for i, p in enumerate(params):
        u = p.detach().double() - before[i].double()
        torch.testing.assert_close(f[i, UPDATE_SUMSQ].item(), (u * u).sum().item(), rtol=1e-5, atol=0)
        torch.testing.assert_close(f[i, WEIGHT_SUMSQ].item(), (before[i].double() ** 2).sum().item(), rtol=1e-6, atol=0)
        st = opt.state[p]
        m_after = st.get("exp_avg", st.get("momentum_buffer"))
        want_m1 = 0.0 if m_after is None else (m_after.double() ** 2).sum().item()
        torch.testing.assert_close(f[i, MOMENT1_SUMSQ].item(), want_m1, rtol=1e-5, atol=0)
        if rule == RULE_ADAM:
            group = opt.param_groups[0]
            v_after = st["max_exp_avg_sq"] if group["amsgrad"] else st["exp_avg_sq"]
            bc2 = 1 - group["betas"][1] ** float(st["step"])
            torch.testing.assert_close(f[i, MOMENT2_SUMSQ].item(), (v_after.double() / bc2).sum().item(), rtol=1e-5,
                                       atol=0)
        assert c[i].tolist() == [0, 0, 0, 0, sizes[i]]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("config", TORCH_CONFIGS, ids=lambda c: c[0])
def test_clip_matches_the_explicit_reference(config, dtype, cpu_capability):
    sizes = [CHUNK + 5, 4099, 33, 0, 70, 17]
    coefs = torch.tensor([0.5, 0.25, 1.0, 0.5, math.nan, 3.0], dtype=torch.float64)
    params, opt = optimizer_for(config, dtype, sizes, seed=9)
    with torch.no_grad():
        before = [p.detach().clone() for p in params]
        opt.step()
        after = [p.detach().clone() for p in params]
        rule, hyper, m1, m2, m2max = optimizer_hyper(opt, params)
        hyper[:, 5] -= 1  # the step t just taken (optimizer_hyper gives the next one)
        if rule == RULE_SGD:
            hyper[:, 5] = 0
        clip_op(params, [p.grad for p in params], m1, m2, m2max, hyper, coefs, rule)
    # ulps of the weights: w_before is formed again from the weight the step rounded
    tol = {torch.float64: 1e-12, torch.float32: 4e-7, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for i, p in enumerate(params):
        c = coefs[i].item()
        if not c < 1:
            assert torch.equal(bits(p.detach()), bits(after[i]))
            continue
        w0, w1 = before[i].double(), after[i].double()
        want = w0 + c * (w1 - w0)
        scale = w0.abs() + w1.abs()
        err = (p.detach().double() - want).abs()
        assert (err <= tol * scale + 1e-30).all(), (err / scale).max()


def test_clip_sgd_nesterov_first_step_and_hyper_step_ignored(cpu_capability):
    # SGD reads no step number: a table with any t clips alike
    config = TORCH_CONFIGS[4]
    params, opt = optimizer_for(config, torch.float32, [1000], seed=1)
    with torch.no_grad():
        opt.step()
        after = params[0].detach().clone()
        rule, hyper, m1, m2, m2max = optimizer_hyper(opt, params)
        other = hyper.clone()
        other[:, 5] = 123.0
        a, b = after.clone(), after.clone()
        coefs = torch.tensor([0.3], dtype=torch.float64)
        clip_op([a], [params[0].grad], m1, m2, m2max, hyper, coefs, rule)
        clip_op([b], [params[0].grad], m1, m2, m2max, other, coefs, rule)
    assert torch.equal(a, b) and not torch.equal(a, after)


# ---- Edge cases of the state: the kernels as the reference


def amsgrad_row(t=3.0):
    # lr, weight_decay, beta1, beta2, eps, t, flags
    return torch.tensor([[1e-3, 0.0, 0.9, 0.999, 1e-8, t, FLAG_AMSGRAD]], dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_clip_amsgrad_without_moment2_max_reads_max_of_zero_and_moment2(dtype, cpu_capability):
    # No moment2_max with amsgrad: the state of a first amsgrad step, whose running max is
    # torch.maximum(zeros, exp_avg_sq), so the clip divides by the root of max(0, moment2), not of 0.
    n = CHUNK + 37  # vector steps and a scalar tail
    w, g, m = (torch.full((n,), x, dtype=dtype) for x in (1.0, 0.01, 0.01))
    v = torch.full((n,), 1e-4, dtype=dtype)
    v[[5, CHUNK + 30]] = -1e-4  # below the zero max: the max is 0
    v[[6, CHUNK + 31]] = 0.0
    coefs = torch.tensor([0.5], dtype=torch.float64)
    got, explicit, ref = w.clone(), w.clone(), w.clone()
    clip_op([got], [g], [m], [v], [absent(dtype)], amsgrad_row(), coefs, RULE_ADAM)
    clip_op([explicit], [g], [m], [v], [v.clamp(min=0)], amsgrad_row(), coefs, RULE_ADAM)
    update_reference.multi_tensor_update_clip_([ref], [g], [m], [v], [absent(dtype)], amsgrad_row(), coefs, RULE_ADAM)
    assert torch.equal(bits(got), bits(explicit))
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 1e-2)
    torch.testing.assert_close(got, ref, rtol=tol, atol=0)
    # w_before = 1 + 2.02e-4, its update halved: 1.0001 (the root of 0 would give 1846)
    step_size, root = 1e-3 / (1 - 0.9 ** 3), math.sqrt(float(v[0])) / math.sqrt(1 - 0.999 ** 3)
    a = -step_size * float(m[0]) / (root + 1e-8)
    positive = v > 0
    want = torch.full((int(positive.sum()),), 1 - a + 0.5 * a, dtype=torch.float64)
    torch.testing.assert_close(got[positive].double(), want, rtol=tol, atol=0)
    assert got[~positive].double().min() > 1000


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_stats_amsgrad_without_moment2_max_takes_the_max_of_a_negative_moment2_and_zero(dtype, cpu_capability):
    # torch.maximum(zeros, v') with v' < 0 is 0: a finite root, not sqrt of a negative number
    n = 2 * CHUNK + 21
    args = make_inputs(CONFIGS[len(SGD_CONFIGS) + 2], [n], dtype, seed=4)
    params, grads, m1, m2, _, hyper, rule = args
    m2[0][[1, 17, CHUNK + 2, n - 1]] = -1.0
    f, c = stats_op(params, grads, m1, m2, [absent(dtype)], hyper, rule)
    assert_rows_match_reference((params, grads, m1, m2, [absent(dtype)], hyper, rule), (f, c))
    assert f.isfinite().all() and c[0, UPDATE_NONFINITE] == c[0, MOMENT_NONFINITE] == 0
    assert c[0, EPS_DOMINATED] >= 4 + len(range(0, n, 5))  # the zero max, and the zero gradients on zero state
    zeros = torch.zeros_like(m2[0])
    assert torch.equal(f, stats_op(params, grads, m1, m2, [zeros], hyper, rule)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_moment_nonfinite_tests_each_moment_not_their_sum(dtype, cpu_capability):
    # m' + v' overflows for finite moments near the dtype's largest value: neither is counted
    n = CHUNK + 19
    args = make_inputs(CONFIGS[len(SGD_CONFIGS) + 1], [n], dtype, seed=6)
    params, grads, m1, m2, m2max, hyper, rule = args
    big = torch.finfo(dtype).max * 0.9
    m1[0][[0, 40, n - 1]] = big
    m2[0][[0, 40, n - 1]] = big
    m1[0][8], m2[0][CHUNK + 9] = math.inf, math.nan  # one non-finite moment each
    f, c = stats_op(*args)
    _, rc = update_reference.multi_tensor_update_stats(*args)
    assert c[0, MOMENT_NONFINITE] == rc[0, MOMENT_NONFINITE] == 2
    assert torch.equal(c, rc)
