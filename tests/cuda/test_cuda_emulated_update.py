"""The CUDA optimizer-update kernels without a GPU: UpdateStatsOp and UpdateClipOp of
csrc/cuda/update_ops.cuh on the several-list tables of csrc/cuda/multi_tensor.cuh, with the glue of
csrc/cuda/ops.h, run on the CPU by the CUDA emulation of tests/cuda_emu (see
test_cuda_emulated.py).

Each result is compared with the float64 reference (gradfuse/ops/update_reference.py), with a mirror
written here of the kernels' own arithmetic (update_math.h's operations in the same order in the
accumulation dtype: float32 for float32, bfloat16 and float16), which the clipped weights must
equal bitwise and the update statistics within the rounding of their summation order, and with
the CPU backend where the build has the ops. SGD and Adam /
AdamW configurations (momentum, dampening, nesterov, maximize, amsgrad, L2 or decoupled decay, the
first step's absent state), every dtype, NaN and Inf, empty tensors, sizes across chunks,
misaligned views, more tensors than one launch table, and clip coefficients below 1, at least 1
and NaN (those tensors untouched, their memory unread). test_update_grid_under_sanitizers runs this
file again, built with ASan+UBSan.
"""
import math

import cuda_emu
import numpy as np
import pytest
import torch
from emu_fixtures import FMA, SANITIZED, rerun_under_sanitizers, rerun_with_fma
from emu_grid import CHUNK, grid_params, plant, randn

from gradfuse.ops import update_reference

SGD, ADAM = 0, 1
MAXIMIZE, NESTEROV, AMSGRAD, DECOUPLED = 1, 2, 4, 8

# name: (rule, lr, weight_decay, beta1 | momentum, beta2 | dampening, eps, step, flags, state)
# state: which of moment1, moment2, moment2_max exist (the first step has none).
CONFIGS = {
    "sgd": (SGD, 0.1, 0.0, 0.0, 0.0, 0.0, 1, 0, ""),
    "sgd_wd": (SGD, 0.05, 0.01, 0.0, 0.0, 0.0, 1, 0, ""),
    "sgd_momentum": (SGD, 0.1, 0.0, 0.9, 0.0, 0.0, 3, 0, "m"),
    "sgd_momentum_first": (SGD, 0.1, 0.01, 0.9, 0.1, 0.0, 1, 0, ""),
    "sgd_dampening_wd": (SGD, 0.1, 0.01, 0.9, 0.25, 0.0, 5, 0, "m"),
    "sgd_nesterov_wd_maximize": (SGD, 0.1, 0.01, 0.9, 0.0, 0.0, 5, NESTEROV | MAXIMIZE, "m"),
    "adam": (ADAM, 1e-3, 0.0, 0.9, 0.999, 1e-8, 7, 0, "mv"),
    "adam_first": (ADAM, 1e-3, 0.0, 0.9, 0.999, 1e-8, 1, 0, ""),
    "adam_l2_maximize": (ADAM, 1e-3, 0.01, 0.9, 0.999, 1e-8, 4, MAXIMIZE, "mv"),
    "adamw": (ADAM, 1e-3, 0.1, 0.9, 0.99, 1e-6, 12, DECOUPLED, "mv"),
    "adamw_amsgrad": (ADAM, 2e-3, 0.1, 0.8, 0.999, 1e-3, 9, DECOUPLED | AMSGRAD, "mvx"),
    "adam_amsgrad_first": (ADAM, 1e-3, 0.0, 0.9, 0.999, 1e-8, 1, AMSGRAD, ""),
    "adam_eps_dominated": (ADAM, 1e-3, 0.0, 0.9, 0.999, 0.5, 30, 0, "mv"),
}



def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- The references: update_math.h's arithmetic, element-wise in PyTorch in the dtype `acc`


class Hyper:
    """UpdateParams::from_row: the double-precision scalars rounded to acc."""

    def __init__(self, row, rule, acc):
        lr, wd, b1, b2, eps, t, flags = (float(v) for v in row)
        flags = int(flags)
        self.rule = rule
        self.maximize, self.nesterov = bool(flags & MAXIMIZE), bool(flags & NESTEROV)
        self.amsgrad, self.decoupled = bool(flags & AMSGRAD), bool(flags & DECOUPLED)

        def a(x):
            return torch.tensor(x, dtype=torch.float64).to(acc)

        self.lr, self.weight_decay, self.beta1, self.beta2, self.eps = a(lr), a(wd), a(b1), a(b2), a(eps)
        self.one_minus_beta1, self.one_minus_beta2, self.one_minus_dampening = a(1.0 - b1), a(1.0 - b2), a(1.0 - b2)
        self.step_size = a(lr / (1.0 - math.pow(b1, t)))
        self.inv_bias_correction2_sqrt = a(1.0 / math.sqrt(1.0 - math.pow(b2, t)))
        self.decay_factor = a(1.0 - lr * wd)
        outside = self.decoupled if rule == ADAM else (b1 == 0.0 or self.nesterov)
        self.decay = a(-lr * wd) if outside else a(0.0)
        self.one, self.half = a(1.0), a(0.5)


def sqrt(x):
    """The correctly rounded square root, as sqrt / sqrtf (torch's may be an ulp off)."""
    return torch.from_numpy(np.sqrt(x.contiguous().numpy()))


def adam_root(h, v):
    """adam_root: sqrt(v) times the reciprocal of sqrt(1 - beta2^t)."""
    return sqrt(v) * h.inv_bias_correction2_sqrt


def lerp(start, end, weight, one, half):
    if weight < half:
        return start + weight * (end - start)
    return end - (end - start) * (one - weight)


def update_element(h, w, g, m, v, v_max, has_buffer):
    """update_element: (update, moment1, root, moment2), each a tensor like w."""
    zero = torch.zeros_like(w)
    if h.maximize:
        g = -g
    if h.rule == ADAM:
        if h.weight_decay != 0 and not h.decoupled:
            g = g + h.weight_decay * w
        m1 = lerp(m, g, h.one_minus_beta1, h.one, h.half)
        v_new = v * h.beta2 + h.one_minus_beta2 * g * g
        if h.amsgrad:
            v_new = torch.where((v_max > v_new) | v_max.isnan(), v_max, v_new)  # nan_max
        root = adam_root(h, v_new)
        adam = -h.step_size * (m1 / (root + h.eps))
        update = (w * h.decay_factor - w) + adam if h.decoupled else adam
        return update, m1, root, v_new
    d = g + h.weight_decay * w if h.weight_decay != 0 else g
    m1 = zero
    if h.beta1 != 0:
        buf = m * h.beta1 + h.one_minus_dampening * d if has_buffer else d
        m1 = buf
        d = d + h.beta1 * buf if h.nesterov else buf
    return -h.lr * d, m1, zero, zero


def nonfinite(x):
    return int((~torch.isfinite(x)).sum())


def state_or_zeros(t, like, acc):
    return t.to(acc) if t.numel() else torch.zeros(like.shape, dtype=acc)


def update_stats_mirror(params, grads, m1s, m2s, maxs, hyper, rule, acc):
    """Rows of multi_tensor_update_stats computed element-wise in `acc`, summed in float64."""
    f = torch.zeros(len(params), 4, dtype=torch.float64)
    c = torch.zeros(len(params), 5, dtype=torch.long)
    for i, (w, g, m, v, vm) in enumerate(zip(params, grads, m1s, m2s, maxs)):
        h = Hyper(hyper[i].tolist(), rule, acc)
        wa = w.to(acc)
        u, m1, root, m2 = update_element(h, wa, g.to(acc), state_or_zeros(m, w, acc), state_or_zeros(v, w, acc),
                                         state_or_zeros(vm, w, acc), m.numel() > 0)
        f[i] = torch.stack([x.double().square().sum() for x in (u, wa, m1, root)])
        eps_dominated = int((root < h.eps).sum()) if rule == ADAM else 0
        moments_nonfinite = int((~(torch.isfinite(m1) & torch.isfinite(m2))).sum())
        c[i] = torch.tensor([nonfinite(u), nonfinite(wa), moments_nonfinite, eps_dominated, w.numel()])
    return f, c


def update_clip_mirror_(params, grads, m1s, m2s, maxs, hyper, coefs, rule, acc):
    """multi_tensor_update_clip_ element-wise in `acc` (applied_update_part, clipped_weight)."""
    for i, (w, g, m, v, vm) in enumerate(zip(params, grads, m1s, m2s, maxs)):
        coef = float(coefs[i])
        if not coef < 1.0:
            continue
        h = Hyper(hyper[i].tolist(), rule, acc)
        c = torch.tensor(coef, dtype=torch.float64).to(acc)
        g, m_after = g.to(acc), state_or_zeros(m, w, acc)
        v_after = state_or_zeros(v, w, acc)
        if h.amsgrad:  # without moment2_max, the max of a first amsgrad step: max(0, moment2)
            v_after = state_or_zeros(vm, w, acc) if vm.numel() else torch.where(v_after < 0, 0.0, v_after)
        if rule == ADAM:
            a = -h.step_size * (m_after / (adam_root(h, v_after) + h.eps))
        elif h.beta1 != 0 and not h.nesterov:
            a = -h.lr * m_after
        else:
            if h.maximize:
                g = -g
            a = -h.lr * (g + h.beta1 * m_after if h.beta1 != 0 else g)
        w_before = (w.to(acc) - a) / (h.one + h.decay)
        w.copy_((w_before + c * (a + h.decay * w_before)).to(w.dtype))


# ---- Inputs


def hyper_rows(config, n, seed=0):
    """The config's row for n tensors, the learning rate varied per tensor (a per-row table)."""
    rule, lr, wd, b1, b2, eps, t, flags, _ = CONFIGS[config]
    rows = torch.tensor([[lr, wd, b1, b2, eps, t, flags]] * n, dtype=torch.float64)
    rows[:, 0] *= 1 + torch.arange(n, dtype=torch.float64) % 5 / 4
    return rule, rows


def make_state(config, params, dtype, seed=0, plant_values=False):
    """grads, moment1, moment2, moment2_max for params (empty where the config has no state)."""
    present = CONFIGS[config][8]
    grads, m1s, m2s, maxs = [], [], [], []
    for i, w in enumerate(params):
        grads.append(randn(w.shape, dtype, seed + 1000 + i))
        m = randn(w.shape, dtype, seed + 2000 + i) * 0.1
        v = randn(w.shape, dtype, seed + 3000 + i).square() * 0.01
        vm = torch.maximum(v, randn(w.shape, dtype, seed + 4000 + i).square() * 0.01)
        if plant_values and w.numel() > 8:
            plant(grads[-1], i)
            m.view(-1)[[3 % w.numel(), (CHUNK + 3) % w.numel()]] = math.nan
            v.view(-1)[5 % w.numel()] = math.inf
        empty = torch.empty(0, dtype=dtype)
        m1s.append(m if "m" in present else empty)
        m2s.append(v if "v" in present else empty)
        maxs.append(vm if "x" in present else empty)
    return grads, m1s, m2s, maxs


def misaligned_like(ts, shift=1):
    """Copies of ts (non-empty ones) in storage shifted by `shift` elements."""
    out = []
    for t in ts:
        if t.numel() == 0:
            out.append(t)
            continue
        buf = torch.empty(t.numel() + shift, dtype=t.dtype)
        view = buf[shift:].view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


def bits(t):
    """The elements of t as integers of their width (bitwise comparisons, NaN included)."""
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def cpu_op(name):
    ops = torch.ops.gradfuse
    try:
        return getattr(ops, name) if hasattr(ops, name) else None
    except (AttributeError, RuntimeError):
        return None


def assert_rows_close(got, expected, rtol, what):
    f, c = got
    ef, ec = expected
    assert f.shape == ef.shape and c.shape == ec.shape, what
    assert torch.equal(c, ec), f"{what}: counts\n{c}\n{ec}"
    torch.testing.assert_close(f, ef, rtol=rtol, atol=0, equal_nan=True, msg=what)


STATS_RTOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}


def check_stats(emu, params, state, hyper, rule, dtype, what):
    got = emu.multi_tensor_update_stats(params, *state, hyper, rule)
    assert got[0].dtype == torch.float64 and got[1].dtype == torch.long
    mirror = update_stats_mirror(params, *state, hyper, rule, acc_dtype(dtype))
    # A build that contracts a * b + c into an FMA (nvcc's default) differs by an ulp in a few
    # products of update_element (update_math.h), within STATS_RTOL.
    assert_rows_close(got, mirror, STATS_RTOL[dtype], what + " (acc-dtype mirror)")
    f64 = update_reference.multi_tensor_update_stats(params, *state, hyper, rule)
    if dtype == torch.float64:
        torch.testing.assert_close(got[0], f64[0], rtol=1e-12, atol=0, equal_nan=True,
                                   msg=what + " (float64)")
    else:
        torch.testing.assert_close(got[0][:, 1:], f64[0][:, 1:], rtol=1e-4, atol=0, equal_nan=True,
                                   msg=what + " (float64)")
        # In float32, AdamW's (w * (1 - lr * wd) - w) keeps a few bits, as in torch's own step: the
        # update's norm is within a part in 1e3, or 1e-6 of the weight's norm.
        norm, ref = got[0][:, 0].sqrt(), f64[0][:, 0].sqrt()
        ok = ((norm - ref).abs() <= 1e-3 * ref + 1e-6 * f64[0][:, 1].sqrt()) | (norm.isnan() & ref.isnan())
        assert ok.all(), f"{what} (float64): update_sumsq {got[0][~ok, 0]} vs {f64[0][~ok, 0]}"
    assert torch.equal(got[1][:, :3], f64[1][:, :3]) and torch.equal(got[1][:, 4], f64[1][:, 4]), what
    cpu = cpu_op("multi_tensor_update_stats")
    if cpu is not None:
        assert_rows_close(got, cpu(params, *state, hyper, rule), STATS_RTOL[dtype], what + " (CPU backend)")
    return got


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_update_stats_grid(emu, dtype, config):
    params = grid_params(dtype)
    state = make_state(config, params, dtype)
    rule, hyper = hyper_rows(config, len(params))
    f, c = check_stats(emu, params, state, hyper, rule, dtype, config)
    assert c[:, 4].tolist() == [p.numel() for p in params]
    assert f[:, 0].gt(0).sum() == sum(p.numel() > 0 for p in params)
    if config == "adam_eps_dominated":
        assert c[:, 3].sum() > 1000


@pytest.mark.parametrize("config", ["sgd_nesterov_wd_maximize", "sgd_momentum_first", "adamw_amsgrad", "adam_first"])
def test_update_stats_nonfinite(emu, dtype, config):
    params = [plant(p, i) if p.numel() > 8 else p for i, p in enumerate(grid_params(dtype, seed=5))]
    state = make_state(config, params, dtype, seed=5, plant_values=True)
    rule, hyper = hyper_rows(config, len(params))
    f, c = check_stats(emu, params, state, hyper, rule, dtype, config)
    assert c[:, 0].sum() > 10 and c[:, 1].sum() > 10
    if CONFIGS[config][8]:
        assert c[:, 2].sum() > 10
    assert f[:, 0].isnan().sum() > 3


@pytest.mark.parametrize("config", ["sgd_dampening_wd", "adamw_amsgrad"])
def test_misaligned_state(emu, dtype, config):
    # Each list misaligned on its own: the aligned path needs every list aligned.
    params = [randn((n,), dtype, seed=n) for n in (CHUNK + 9, 4 * 8 + 3, 1000)]
    grads, m1s, m2s, maxs = make_state(config, params, dtype)
    for shifted in range(5):
        lists = [params, grads, m1s, m2s, maxs]
        lists[shifted] = misaligned_like(lists[shifted])
        rule, hyper = hyper_rows(config, len(params))
        check_stats(emu, lists[0], lists[1:], hyper, rule, dtype, f"{config}, list {shifted} misaligned")


def test_empty_call_and_empty_tensors(emu):
    f, c = emu.multi_tensor_update_stats([], [], [], [], [], torch.empty(0, 7, dtype=torch.float64), ADAM)
    assert f.shape == (0, 4) and c.shape == (0, 5)
    emu.multi_tensor_update_clip_([], [], [], [], [], torch.empty(0, 7, dtype=torch.float64),
                                  torch.empty(0, dtype=torch.float64), ADAM)
    params = [torch.empty(0, 3), torch.empty(0)]
    rule, hyper = hyper_rows("adam", 2)
    f, c = emu.multi_tensor_update_stats(params, [p.clone() for p in params], *[[torch.empty(0)] * 2] * 3, hyper, rule)
    assert torch.equal(f, torch.zeros(2, 4, dtype=torch.float64))
    assert torch.equal(c, torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("present", ["m", "v", "mv", "mx", "vx", "x"])
@pytest.mark.parametrize("config", ["adam", "adamw_amsgrad"])
def test_unusual_state_combinations(emu, dtype, config, present):
    # Adam's state partly absent (zeros): the loop for any combination, which checks each pointer.
    params = [randn((n,), dtype, seed=n) for n in (CHUNK + 9, 35, 1000)]
    grads, m1s, m2s, maxs = make_state("adamw_amsgrad", params, dtype)
    empty = [torch.empty(0, dtype=dtype)] * len(params)
    state = (grads, m1s if "m" in present else empty, m2s if "v" in present else empty,
             maxs if "x" in present else empty)
    rule, hyper = hyper_rows(config, len(params))
    check_stats(emu, params, state, hyper, rule, dtype, f"{config}, state {present}")
    coefs = torch.tensor([0.5, 0.25, 0.75], dtype=torch.float64)
    check_clip(emu, params, state, hyper, coefs, rule, dtype, f"{config}, state {present}")


def amsgrad_row(n):
    # lr, weight_decay, beta1, beta2, eps, t, flags
    return torch.tensor([[1e-3, 0.0, 0.9, 0.999, 1e-8, 3.0, AMSGRAD]] * n, dtype=torch.float64)


def test_clip_amsgrad_without_moment2_max_reads_max_of_zero_and_moment2(emu, dtype):
    # No moment2_max with amsgrad: a first amsgrad step's state, whose running max is
    # torch.maximum(zeros, exp_avg_sq); the root of max(0, moment2), not of zeros.
    n = CHUNK + 37
    params = [torch.ones(n, dtype=dtype), torch.ones(n + 1, dtype=dtype)[1:]]  # aligned, misaligned
    grads = [torch.full_like(p, 0.01) for p in params]
    m1s = [torch.full_like(p, 0.01) for p in params]
    m2s = [torch.full_like(p, 1e-4) for p in params]
    for v in m2s:
        v[[5, CHUNK + 30]] = -1e-4
        v[6] = 0.0
    empty = [torch.empty(0, dtype=dtype)] * 2
    coefs = torch.tensor([0.5, 0.5], dtype=torch.float64)
    got = check_clip(emu, params, (grads, m1s, m2s, empty), amsgrad_row(2), coefs, ADAM, dtype, "amsgrad, mv")
    explicit = [p.clone() for p in params]
    emu.multi_tensor_update_clip_(explicit, grads, m1s, m2s, [v.clamp(min=0) for v in m2s], amsgrad_row(2), coefs,
                                  ADAM)
    for g, e, v in zip(got, explicit, m2s):
        assert torch.equal(bits(g), bits(e))
        # w_before = 1 + 2.02e-4 and half its update: 1.0001 (the root of zeros gives 1846)
        assert (g[v > 0].double() - 1.0001).abs().max() < 1e-2 and g[v <= 0].double().min() > 1000


def test_stats_amsgrad_without_moment2_max_takes_the_max_of_a_negative_moment2_and_zero(emu, dtype):
    # torch.maximum(zeros, v') with v' < 0 is 0: a finite root, where the loop without the max
    # would take the root of a negative number
    params = [randn((n,), dtype, seed=n) for n in (2 * CHUNK + 21, 1000)]
    grads, m1s, m2s, _ = make_state("adamw_amsgrad", params, dtype)
    for v in m2s:
        v[[1, 17, v.numel() - 1]] = -1.0
    empty = [torch.empty(0, dtype=dtype)] * 2
    rule, hyper = hyper_rows("adamw_amsgrad", 2)
    f, c = check_stats(emu, params, (grads, m1s, m2s, empty), hyper, rule, dtype, "amsgrad, mv, negative moment2")
    assert f.isfinite().all() and c[:, :3].sum() == 0 and (c[:, 3] >= 3).all()


def test_moment_nonfinite_tests_each_moment_not_their_sum(emu, dtype):
    # m' + v' overflows for finite moments near the dtype's largest value: neither is counted
    params = [randn((n,), dtype, seed=n) for n in (CHUNK + 19, 40)]
    grads, m1s, m2s, _ = make_state("adam", params, dtype)
    big = torch.finfo(dtype).max * 0.9
    for m, v in zip(m1s, m2s):
        m[[0, 9, m.numel() - 1]] = big
        v[[0, 9, v.numel() - 1]] = big
    m1s[0][12], m2s[0][CHUNK + 3] = math.inf, math.nan
    empty = [torch.empty(0, dtype=dtype)] * 2
    rule, hyper = hyper_rows("adam", 2)
    state = (grads, m1s, m2s, empty)
    # The counts only: the squares of such moments overflow the float32 sums (not float64's).
    _, c = emu.multi_tensor_update_stats(params, *state, hyper, rule)
    assert c[:, 2].tolist() == [2, 0]
    assert torch.equal(c, update_stats_mirror(params, *state, hyper, rule, acc_dtype(dtype))[1])
    assert torch.equal(c, update_reference.multi_tensor_update_stats(params, *state, hyper, rule)[1])
    cpu = cpu_op("multi_tensor_update_stats")
    if cpu is not None:
        assert torch.equal(c, cpu(params, *state, hyper, rule)[1])


@pytest.mark.parametrize("count_of", ["small+1", "large+5"])
@pytest.mark.parametrize("config", ["sgd_momentum", "adamw_amsgrad"])
def test_several_launch_tables(emu, config, count_of):
    small, large = emu.list_table_sizes()
    count = {"small+1": small + 1, "large+5": 2 * large + 5}[count_of]
    sizes = [(1 + i % 9, 1 + i % 5) if i % 11 else (0, 3) for i in range(count)]
    sizes[5] = (3, CHUNK + 1)  # several chunks in the middle of a table
    params = [randn(s, torch.float32, seed=i) for i, s in enumerate(sizes)]
    state = make_state(config, params, torch.float32)
    rule, hyper = hyper_rows(config, count)
    check_stats(emu, params, state, hyper, rule, torch.float32, f"{config}, {count} tensors")
    coefs = torch.rand(count, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 1.5
    check_clip(emu, params, state, hyper, coefs, rule, torch.float32, f"{config}, {count} tensors")


# ---- The clip


def check_clip(emu, params, state, hyper, coefs, rule, dtype, what):
    on_emu = [p.clone() for p in params]
    emu.multi_tensor_update_clip_(on_emu, *state, hyper, coefs, rule)
    mirror = [p.clone() for p in params]
    update_clip_mirror_(mirror, *state, hyper, coefs, rule, acc_dtype(dtype))
    f64 = [p.clone() for p in params]
    update_reference.multi_tensor_update_clip_(f64, *state, hyper, coefs, rule)
    for i, (got, m, r, before) in enumerate(zip(on_emu, mirror, f64, params)):
        if not float(coefs[i]) < 1.0:
            assert torch.equal(bits(got), bits(before)), f"{what}: params[{i}] was touched"
        # Bitwise, whether or not the build contracts a * b + c into an FMA (the clip's products
        # are rounded on their own, update_math.h's mul_rn).
        torch.testing.assert_close(got, m, rtol=0, atol=0, equal_nan=True, msg=f"{what}: params[{i}]")
        assert torch.equal(torch.signbit(got)[~m.isnan()], torch.signbit(m)[~m.isnan()])
        tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
        torch.testing.assert_close(got, r, rtol=tol, atol=tol, equal_nan=True, msg=f"{what}: params[{i}] vs float64")
    cpu = cpu_op("multi_tensor_update_clip_")
    if cpu is not None:
        on_cpu = [p.clone() for p in params]
        cpu(on_cpu, *state, hyper, coefs, rule)
        for got, c in zip(on_emu, on_cpu):
            torch.testing.assert_close(got, c, rtol=0, atol=0, equal_nan=True, msg=what + " (CPU backend)")
    return on_emu


COEF_CASES = {"half": 0.5, "one": 1.0, "two": 2.0, "nan": math.nan, "mixed": None}


@pytest.mark.parametrize("coef", sorted(COEF_CASES))
@pytest.mark.parametrize("config", ["sgd", "sgd_momentum", "sgd_nesterov_wd_maximize", "sgd_dampening_wd", "adam",
                                    "adam_l2_maximize", "adamw", "adamw_amsgrad"])
def test_update_clip_grid(emu, dtype, config, coef):
    params = grid_params(dtype, seed=7)
    state = make_state(config, params, dtype, seed=7)
    rule, hyper = hyper_rows(config, len(params))
    n = len(params)
    if COEF_CASES[coef] is None:
        coefs = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1.5
        coefs[1::4] = 1.0
        coefs[2] = math.nan
        coefs[3] = 0.0
    else:
        coefs = torch.full((n,), COEF_CASES[coef], dtype=torch.float64)
    got = check_clip(emu, params, state, hyper, coefs, rule, dtype, f"{config}, coef {coef}")
    if coef == "half":  # every tensor but the empty one (in 2-byte dtypes, small updates may round away)
        changed = sum(not torch.equal(g, p) for g, p in zip(got, params))
        assert changed >= (n - 1 if dtype in (torch.float32, torch.float64) else n // 2)


def test_update_clip_nonfinite(emu, dtype):
    params = [plant(p, i) if p.numel() > 8 else p for i, p in enumerate(grid_params(dtype, seed=9))]
    for config in ("sgd_momentum", "adamw_amsgrad"):
        state = make_state(config, params, dtype, seed=9, plant_values=True)
        rule, hyper = hyper_rows(config, len(params))
        coefs = torch.full((len(params),), 0.3, dtype=torch.float64)
        check_clip(emu, params, state, hyper, coefs, rule, dtype, config)


@pytest.mark.parametrize("config", ["sgd_momentum", "adamw_amsgrad"])
def test_clip_touches_no_memory_of_tensors_not_clipped(emu, dtype, config):
    # Every list of the tensors whose coefficient is >= 1 or NaN lies on pages made unreadable
    # while the kernel runs; the others (0.5) are clipped next to them in the same launch.
    sizes = [1, 7, CHUNK + 1, 3 * CHUNK + 5, 1000]
    guarded = [cuda_emu.GuardedTensors(dtype, sizes, misalign=m) for m in (1, 0, 0, 0, 0)]
    lists = [list(g.tensors) for g in guarded]
    for v in lists[3] + lists[4]:
        v.abs_()
    free = [randn((n,), dtype, seed=n) for n in (100, CHUNK + 3)]
    fstate = make_state(config, free, dtype)
    present = CONFIGS[config][8]
    for k, src in enumerate([free, *fstate]):
        lists[k] += src if k < 2 or "mvx"[k - 2] in present else [torch.empty(0, dtype=dtype)] * 2
    for k in range(2, 5):
        if "mvx"[k - 2] not in present:
            lists[k][:len(sizes)] = [torch.empty(0, dtype=dtype)] * len(sizes)
    rule, hyper = hyper_rows(config, len(lists[0]))
    coefs = torch.tensor([1.0, 2.0, math.inf, math.nan, 1.0, 0.5, 0.5], dtype=torch.float64)
    before = [t.clone() for t in lists[0]]
    expect = [t.clone() for t in lists[0]]
    update_clip_mirror_(expect, *lists[1:], hyper, coefs, rule, acc_dtype(dtype))
    with guarded[0].unreadable(), guarded[1].unreadable(), guarded[2].unreadable(), guarded[3].unreadable(), \
            guarded[4].unreadable():
        emu.multi_tensor_update_clip_(lists[0], *lists[1:], hyper, coefs, rule)
    for i in range(len(sizes)):
        assert torch.equal(lists[0][i], before[i])
    for i in (5, 6):
        torch.testing.assert_close(lists[0][i], expect[i], rtol=0, atol=0)
        assert not torch.equal(lists[0][i], before[i])


# ---- Argument checks


def test_argument_checks(emu):
    """The emulated CUDA glue makes the checks of every backend (csrc/common/engine.h): the same
    message as the reference for each bad argument."""
    params = [torch.randn(4, 5), torch.randn(3)]
    grads = [torch.randn(4, 5), torch.randn(3)]
    empty = [torch.empty(0), torch.empty(0)]
    rule, hyper = hyper_rows("adam", 2)
    ones = torch.ones(2, dtype=torch.float64)
    cases = {
        "moment1 not contiguous": (params, grads, [torch.randn(5, 4).t(), torch.empty(0)], empty, empty, hyper, rule),
        "moment2 dtype": (params, grads, empty, [torch.empty(0), torch.randn(3, dtype=torch.float64)], empty, hyper,
                          rule),
        "grads shape": (params, [grads[0], torch.randn(4)], empty, empty, empty, hyper, rule),
        "moment2_max length": (params, grads, empty, empty, empty[:1], hyper, rule),
        "hyper dtype": (params, grads, empty, empty, empty, hyper.float(), rule),
        "rule": (params, grads, empty, empty, empty, hyper, 2),
        "params dtype": ([params[0], params[1].double()], grads, empty, empty, empty, hyper, rule),
        "params not contiguous": ([torch.randn(5, 4).t(), params[1]], grads, empty, empty, empty, hyper, rule),
    }
    clip_cases = {"coefs dtype": (params, grads, empty, empty, empty, hyper, torch.ones(2), rule)}
    clip_cases.update({k: (*args[:6], ones, args[6]) for k, args in cases.items()})
    for op, table in (("multi_tensor_update_stats", cases), ("multi_tensor_update_clip_", clip_cases)):
        for case, args in table.items():
            with pytest.raises(RuntimeError) as want:
                getattr(update_reference, op)(*args)
            with pytest.raises(RuntimeError) as got:
                getattr(emu, op)(*args)
            message = str(want.value).split(f"{op}: ", 1)[1]
            assert f"gradfuse_emu.{op}: {message}" in str(got.value), (case, str(got.value))


@pytest.mark.skipif(SANITIZED or FMA, reason="this is a rerun")
def test_update_grid_with_fma_contraction():
    """Grid tests of this file again with the emulated backend built with -mfma -ffp-contract=fast
    (nvcc's default contraction): the statistics within their tolerances, the clip bitwise."""
    rerun_with_fma(__file__, "grid and (adamw or sgd_momentum or sgd_nesterov_wd_maximize or sgd_dampening_wd)")


@pytest.mark.skipif(SANITIZED or FMA, reason="this is a rerun")
def test_update_grid_under_sanitizers():
    """This file again with the emulated backend built with -fsanitize=address,undefined."""
    rerun_under_sanitizers(__file__, timeout=2400)
