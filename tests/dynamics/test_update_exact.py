"""The optimizer's update statistics (gradfuse.dynamics.update_plan, the fused update op) against
the real step: ``w_after - w_before`` taken around ``optimizer.step()``, and the optimizer's state
the step leaves, for every configuration of torch.optim.SGD / Adam / AdamW gradfuse supports and
float32, bfloat16 and float16 parameters (the state in the dtype torch keeps it: the parameter's).
"""
import inspect
import math

import pytest
import torch

from gradfuse.dynamics.update_plan import plan_updates
from gradfuse.ops.layout import (
    EPS_DOMINATED,
    MOMENT1_SUMSQ,
    MOMENT2_SUMSQ,
    MOMENT_NONFINITE,
    UPDATE_NONFINITE,
    UPDATE_NUMEL,
    UPDATE_SUMSQ,
    WEIGHT_NONFINITE,
    WEIGHT_SUMSQ,
)

ADAM_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters
CUDA = torch.cuda.is_available()

# name -> (optimizer class, keyword arguments, needs CUDA). ``lr`` is set per dtype (below).
CONFIGS = {
    "sgd_plain": (torch.optim.SGD, {}, False),
    "sgd_weight_decay": (torch.optim.SGD, {"weight_decay": 0.1}, False),
    "sgd_momentum_dampening": (torch.optim.SGD, {"momentum": 0.9, "dampening": 0.2, "weight_decay": 0.05}, False),
    "sgd_nesterov_maximize": (torch.optim.SGD, {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05,
                                                "maximize": True}, False),
    "sgd_momentum_foreach": (torch.optim.SGD, {"momentum": 0.9, "foreach": True}, False),
    "sgd_momentum_fused": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.01, "fused": True}, False),
    "adam": (torch.optim.Adam, {}, False),
    "adam_l2": (torch.optim.Adam, {"weight_decay": 0.1}, False),
    "adam_amsgrad_maximize": (torch.optim.Adam, {"amsgrad": True, "maximize": True, "betas": (0.8, 0.9)}, False),
    "adam_foreach": (torch.optim.Adam, {"foreach": True, "weight_decay": 0.01}, False),
    "adam_fused": (torch.optim.Adam, {"fused": True, "amsgrad": True}, False),
    "adam_tensor_lr": (torch.optim.Adam, {"lr_tensor": True}, False),
    "adam_decoupled": (torch.optim.Adam, {"weight_decay": 0.1, "decoupled_weight_decay": True}, False),
    "adam_large_eps": (torch.optim.Adam, {"eps": 1.0, "lr_scale": 5}, False),
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.1}, False),
    "adamw_amsgrad_foreach": (torch.optim.AdamW, {"amsgrad": True, "foreach": True, "weight_decay": 0.1}, False),
    "adamw_fused": (torch.optim.AdamW, {"fused": True, "weight_decay": 0.1}, False),
    "adam_capturable": (torch.optim.Adam, {"capturable": True, "lr_tensor": True}, True),
    "adamw_capturable_amsgrad": (torch.optim.AdamW, {"capturable": True, "amsgrad": True}, True),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPES = [(16, 12), (16,), (37, 29), (3,)]  # 29 * 37: a vector body and a scalar tail

# Learning rates per dtype. For 16-bit parameters the update must stand well above the rounding
# of the weights (|w| ~ 1: bfloat16 keeps |w| to 2^-9, float16 to 2^-12), else w_after - w_before
# measures the rounding, not the update.
LR = {torch.float32: (0.05, 1e-2), torch.bfloat16: (0.5, 0.1), torch.float16: (0.2, 0.05)}  # (SGD, Adam)
# The relative rounding of one 16-bit operation; torch rounds the state and each intermediate of
# the non-fused step to the parameter's dtype (5 roundings in Adam's update: exp_avg,
# exp_avg_sq, its sqrt, the division, eps added), the op keeps them in float32.
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}



def make_optimizer(name, params, dtype):
    cls, kw, _cuda = CONFIGS[name]
    kw = dict(kw)
    if kw.get("decoupled_weight_decay") and not ADAM_HAS_DECOUPLED:
        pytest.skip(f"torch {torch.__version__}: Adam has no decoupled_weight_decay")
    lr = LR[dtype][0 if cls is torch.optim.SGD else 1] * kw.pop("lr_scale", 1)
    if kw.pop("lr_tensor", False):
        lr = torch.tensor(lr)
    if dtype == torch.float16 and cls is not torch.optim.SGD and "eps" not in kw:
        # torch's float16 step adds eps in float16, where 1e-8 is 0: a zero gradient element
        # then gives 0 / 0. float16 training uses a larger eps.
        kw["eps"] = 1e-4
    return cls(params, lr=lr, **kw)


MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}


def spacing(t: torch.Tensor) -> torch.Tensor:
    """The distance between t's neighbouring values of its dtype, per element, in float64."""
    x = t.double().abs().clamp(min=torch.finfo(t.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(x)) - MANTISSA[t.dtype])


def first_moment(opt, p):
    st = opt.state[p]
    return st.get("exp_avg", st.get("momentum_buffer"))


def adam_root(opt, group, p):
    st = opt.state[p]
    v = st["max_exp_avg_sq"] if group["amsgrad"] else st["exp_avg_sq"]
    t = float(st["step"])
    return v.double().sqrt() / math.sqrt(1 - group["betas"][1] ** t)


def check_against_step(opt, params, device, dtype, steps=3, seed=0):
    """Runs ``steps`` steps; at each, the op's rows against the real step. Returns how many
    parameter updates were compared."""
    gen = torch.Generator().manual_seed(seed)
    compared = 0
    for _ in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            if dtype == torch.float16:
                # Adam's (1 - beta2) g^2 must be a normal float16 (>= 2^-14) where torch stores
                # it: below, float16's subnormals round it by far more than a relative unit
                g = g.sign() * (0.5 + g.abs())
            else:  # exact zeros (in float16 with L2 weight decay they leave Adam's g^2 below the normals)
                g[torch.rand(p.shape, generator=gen) < 0.05] = 0
            p.grad = g.to(device, dtype)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
        rows = plan_updates([opt])
        assert [id(p) for p in rows.params] == [id(p) for p in params]
        floats, counts = rows.floats.cpu(), rows.counts.cpu()
        before = [p.detach().clone() for p in params]
        opt.step()
        for i, (p, b) in enumerate(zip(params, before)):
            group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
            real = p.detach().double() - b.double()
            real_norm = float(real.norm())
            assert real_norm > 0 and float(real.abs().max()) > 0  # something moved
            op_norm = math.sqrt(float(floats[i, UPDATE_SUMSQ]))
            assert counts[i, UPDATE_NUMEL] == p.numel()
            assert counts[i, UPDATE_NONFINITE] == counts[i, WEIGHT_NONFINITE] == counts[i, MOMENT_NONFINITE] == 0
            assert float(floats[i, WEIGHT_SUMSQ]) == pytest.approx(float(b.double().square().sum()), rel=1e-5)
            m = first_moment(opt, p)
            adam = "exp_avg" in opt.state[p]
            if dtype == torch.float32:
                assert op_norm == pytest.approx(real_norm, rel=1e-5), (i, op_norm, real_norm)
                moment_tol = 1e-5
            else:
                # w_after is w_before + u rounded to the dtype: each element of the real update
                # is off by at most half the spacing at w_after (twice with decoupled weight
                # decay: torch rounds w * (1 - lr * wd) first), and torch's step rounds its
                # intermediates to the dtype (UNIT each; the op keeps them in float32). So the
                # two norms differ by at most roundings * ||spacing(w_after)|| / 2 + k * UNIT * ||u||.
                k = 6 if adam else 3
                roundings = 2 if group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)) \
                    and group["weight_decay"] else 1
                rounding = 0.5 * roundings * float(spacing(p.detach()).norm())
                bound = rounding + k * UNIT[dtype] * real_norm
                assert abs(op_norm - real_norm) <= bound, (i, op_norm, real_norm, bound)
                assert rounding < 0.25 * real_norm  # the update stands well above the rounding of the weights
                moment_tol = 2 * UNIT[dtype]
            if m is not None:
                want = float(m.double().square().sum())
                assert float(floats[i, MOMENT1_SUMSQ]) == pytest.approx(want, rel=2 * moment_tol)
            else:
                assert float(floats[i, MOMENT1_SUMSQ]) == 0
            if adam:
                r = adam_root(opt, group, p)
                assert float(floats[i, MOMENT2_SUMSQ]) == pytest.approx(float(r.square().sum()), rel=4 * moment_tol)
                dominated = int((r < group["eps"]).sum())
                assert abs(int(counts[i, EPS_DOMINATED]) - dominated) <= (0 if dtype == torch.float32
                                                                          else max(2, p.numel() // 50))
            else:
                assert float(floats[i, MOMENT2_SUMSQ]) == 0 and counts[i, EPS_DOMINATED] == 0
            compared += 1
    return compared


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_update_statistics_equal_the_real_step(config, dtype, backend):
    device = "cuda" if CONFIGS[config][2] else "cpu"
    if device == "cuda" and not CUDA:
        pytest.skip("capturable needs CUDA")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(device, dtype)) for s in SHAPES]
    opt = make_optimizer(config, params, dtype)
    assert check_against_step(opt, params, device, dtype) == 3 * len(SHAPES)
    if config == "adam_large_eps":  # eps-dominated elements were there to count
        assert sum(int((adam_root(opt, opt.param_groups[0], p) < 1.0).sum()) for p in params) > 10


def test_several_groups_and_optimizers(backend):
    torch.manual_seed(1)
    a = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    b = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES[:2]]
    c = [torch.nn.Parameter(torch.randn(7, 5))]
    adam = torch.optim.AdamW([{"params": a[:2], "lr": 1e-2}, {"params": a[2:], "lr": 2e-2, "weight_decay": 0.5,
                                                              "betas": (0.5, 0.99), "amsgrad": True}])
    sgd = torch.optim.SGD([{"params": b, "momentum": 0.9}, {"params": c, "nesterov": True, "momentum": 0.5}],
                          lr=0.05, weight_decay=0.01)
    everything = a + b + c
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p in everything:
            p.grad = torch.randn(p.shape, generator=gen)
        rows = plan_updates([adam, sgd])
        assert [id(p) for p in rows.params] == [id(p) for p in everything]
        assert rows.adam == [True] * len(a) + [False] * (len(b) + len(c))
        before = [p.detach().clone() for p in everything]
        adam.step()
        sgd.step()
        for i, (p, w) in enumerate(zip(everything, before)):
            real = float((p.detach().double() - w.double()).norm())
            assert real > 0
            assert math.sqrt(float(rows.floats[i, UPDATE_SUMSQ])) == pytest.approx(real, rel=1e-5)


def test_a_parameter_without_gradient_is_left_out_and_a_subclass_counts_as_its_base(backend):
    class Tracked(torch.optim.AdamW):
        pass

    p, q = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(3))
    opt = Tracked([p, q], lr=1e-2)
    p.grad = torch.randn(4, 4)
    rows = plan_updates([opt])
    assert rows.params == [p] and rows.adam == [True]
    w = p.detach().clone()
    opt.step()
    assert math.sqrt(float(rows.floats[0, UPDATE_SUMSQ])) == pytest.approx(float((p.detach() - w).norm()), rel=1e-5)


def test_the_hyper_table_reads_no_device_tensor(backend, monkeypatch):
    """A tensor lr and Adam's step counters go into the table by device copies: ``item`` and
    ``tolist`` of a tensor are never called while planning (CPU step counters are read as floats)."""
    p = torch.nn.Parameter(torch.randn(5, 5))
    opt = torch.optim.Adam([p], lr=torch.tensor(1e-2))
    p.grad = torch.randn(5, 5)
    opt.step()
    calls = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(self) or real_item(self))
    p.grad = torch.randn(5, 5)
    plan_updates([opt])
    assert not [t for t in calls if t.data_ptr() == opt.param_groups[0]["lr"].data_ptr()]
