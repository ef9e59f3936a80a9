"""Update clipping (gradfuse.clip_update_rms, GradMonitor(max_update_rms=...)): each parameter's
update limited to an RMS of d, against the explicit rule applied to torch's own step on a copy:
``w = w_before + min(1, d / rms(u)) * u`` with ``u = w_after - w_before``."""
import copy
import math

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse.dynamics.update_plan import plan_updates
from gradfuse.sinks import metrics

CONFIGS = {
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_weight_decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.05),
    "sgd_nesterov_maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True,
                                                       weight_decay=0.05, maximize=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_l2_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_fused_maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True, maximize=True),
    "adam_tensor_lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2)),
}
SHAPES = [(16, 12), (16,), (37, 29), (3,), (8, 8)]
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}



def spacing(t: torch.Tensor) -> torch.Tensor:
    x = t.double().abs().clamp(min=torch.finfo(t.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(x)) - MANTISSA[t.dtype])


def rounding_scale(*ts: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at the largest magnitude of ``ts`` per element: the clip op forms
    w_before again from w_after, which carries w_after's rounding, and the update, which carries
    its own (where the update is larger than the weight)."""
    return spacing(torch.stack([t.double().abs() for t in ts]).amax(0).to(dtype))


def clip_bound(want, w_after, w_before, c, dtype, k=4):
    """How far the clipped weight may be from the explicit rule, per element.

    - the op forms w_before again from w_after, which carries w_after's rounding, and rounds its
      result once: two spacings at the largest of the weights and the update;
    - the op's coefficient comes from the update it predicted before the step, the rule's from
      w_after - w_before, which carries w_after's rounding (half a spacing per element): the two
      RMS differ relatively by at most ||spacing(w_after)|| / (2 ||u||), plus k rounding units:
      of float32 (the op's arithmetic), of the dtype for 16-bit weights (torch's step rounds
      its intermediates to the dtype, the op keeps them in float32); and c * u moves by that much.
    """
    u = w_after.double() - w_before
    scale = rounding_scale(want, w_after, w_before, u, dtype=dtype)
    rel = 0.5 * float(spacing(w_after).norm()) / float(u.norm()) + k * 2.0 ** -(MANTISSA[dtype] + 1)
    return 2 * scale + c * rel * u.abs()


def explicit_reference(params, opt, grads, d):
    """Torch's step on a copy (the parameters and the optimizer with its state), then
    w_before + min(1, d / rms(u)) * u per tensor, in float64."""
    params_copy, opt_copy = copy.deepcopy((params, opt))
    for q, g in zip(params_copy, grads):
        q.grad = g.clone()  # deepcopy of an nn.Parameter drops .grad
    before = [q.detach().double().clone() for q in params_copy]
    opt_copy.step()
    out, coefs = [], []
    for q, w in zip(params_copy, before):
        u = q.detach().double() - w
        rms = float(u.square().mean().sqrt())
        c = min(1.0, d / rms)
        coefs.append(c)
        out.append((w + c * u, q.detach().clone(), w))
    return out, coefs


def run_clipped(make, dtype, steps=3, seed=0):
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]
    opt = make(params)
    gen = torch.Generator().manual_seed(seed + 1)
    d = None
    limit = None
    results = []
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen) * (1 + i) for i, p in enumerate(params)]
        if dtype == torch.float16:
            # Adam's (1 - beta2) g^2 must be a normal float16 where torch stores it: below 2^-14
            # float16's subnormals round it to 0 and the step divides by eps alone
            grads = [g.sign() * (0.5 + g.abs()) for g in grads]
        grads = [g.to(dtype) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if d is None:  # a limit between the smallest and the largest update RMS: some clipped, some not
            d = 0.93 * float(plan_updates([opt]).rms().median())  # not one tensor's RMS itself
            limit = gradfuse.clip_update_rms(opt, d)
        ref, coefs = explicit_reference(params, opt, grads, d)
        opt.step()
        results.append((ref, coefs, [p.detach().clone() for p in params]))
    return limit, d, results


@pytest.mark.parametrize("config", list(CONFIGS))
def test_clipped_step_equals_the_explicit_rule(config, backend):
    limit, d, results = run_clipped(CONFIGS[config], torch.float32)
    clipped = kept = 0
    for ref, coefs, got in results:
        for (want, unclipped, w_before), c, w in zip(ref, coefs, got):
            if c < 1:
                clipped += 1
                err = (w.double() - want).abs()
                bound = clip_bound(want, unclipped, w_before, c, torch.float32)
                assert bool((err <= bound).all()), (config, float((err / bound).max()))
            else:
                kept += 1
                assert torch.equal(w, unclipped)  # not touched: bit for bit torch's own step
    assert clipped >= 3 and kept >= 3
    n = limit.counts()
    assert n["update_clipped_params"] == clipped and 1 <= n["update_clipped_steps"] <= 3
    limit.remove()


CONFIGS_16 = {
    "sgd_momentum": CONFIGS["sgd_momentum"],
    # float16 adds eps in float16, where 1e-8 is 0; float16 training uses a larger eps
    "adamw": lambda p: torch.optim.AdamW(p, lr=5e-2, weight_decay=0.1, eps=1e-4),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("config", list(CONFIGS_16))
def test_clipped_16_bit_within_the_rounding_of_the_weights(config, dtype, backend):
    _limit, _d, results = run_clipped(CONFIGS_16[config], dtype)
    clipped = 0
    for ref, coefs, got in results:
        for (want, unclipped, w_before), c, w in zip(ref, coefs, got):
            if c < 1:
                clipped += 1
                err = (w.double() - want).abs()
                bound = clip_bound(want, unclipped, w_before, c, dtype, k=6)
                assert bool((err <= bound).all()), (config, float((err / bound).max()))
            else:
                assert torch.equal(w, unclipped)
    assert clipped >= 3


def test_the_update_rms_is_at_most_the_limit_after_the_step(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    limit = gradfuse.clip_update_rms(opt, 1e-2)
    x, y = torch.randn(64, 12), torch.randn(64, 3)
    for _ in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        for p, b in zip(model.parameters(), before):
            rms = float((p.detach().double() - b.double()).square().mean().sqrt())
            assert 0 < rms <= 1e-2 * (1 + 1e-4)
    assert limit.counts()["update_clipped_steps"] == 4
    limit.remove()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # hooks removed: the plain step
    assert max(float((p.detach() - b).square().mean().sqrt()) for p, b in zip(model.parameters(), before)) > 1e-2


def test_monitor_limits_counts_and_logs(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    logged = []
    sink = type("Keep", (), {"write": lambda self, r: logged.append(r)})()
    mon = gradfuse.GradMonitor(model, every=2, max_norm=1.0, update_ratios=opt, max_update_rms=1e-2, sinks=[sink])
    x, y = torch.randn(64, 12), torch.randn(64, 3)
    for _ in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        report = mon.step()
        assert report.updates is not None and "coefs" in report.updates  # taken every step
        opt.step()
        for p, b in zip(model.parameters(), before):
            assert float((p.detach().double() - b.double()).square().mean().sqrt()) <= 1e-2 * (1 + 1e-4)
    assert [r["step"] for r in logged] == [0, 2]
    r = logged[-1]
    assert r["update_clipped"] == 4  # every parameter of this model moves more than 1e-2 at lr 0.05
    assert all(v <= 1e-2 * (1 + 1e-6) for v in r["update_rms"].values())  # the update as applied
    c = mon.counters()
    assert c["update_clipped_steps"] == 4 and c["update_clipped_params"] == 16
    m = metrics(r)
    assert m["grad/update_clipped"] == 4 and m["grad/update_clipped_steps"] == 3  # counters of step 2
    state = mon.state_dict()
    again = gradfuse.GradMonitor(model, update_ratios=opt, max_update_rms=1e-2)
    again.load_state_dict(state)
    assert again.counters()["update_clipped_params"] == 16


def test_monitor_skipped_step_clips_nothing(backend):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    mon = gradfuse.GradMonitor(model, every=0, update_ratios=opt, max_update_rms=1e-6)
    model(torch.randn(3, 4)).sum().backward()
    model.weight.grad[0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="skipped"):
        assert mon.step().skip
    assert mon.counters()["update_clipped_params"] == 0


def test_attach_passes_max_update_rms(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, y = torch.randn(64, 12), torch.randn(64, 3)
    with gradfuse.attach(opt, model, every=0, max_update_rms=1e-3) as handle:
        for _ in range(3):
            nn.functional.mse_loss(model(x), y).backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            for p, b in zip(model.parameters(), before):
                assert float((p.detach().double() - b.double()).square().mean().sqrt()) <= 1e-3 * (1 + 1e-4)
        assert handle.monitor.counters()["update_clipped_steps"] == 3


def test_bad_arguments():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    for bad in (0, -1.0, math.nan, math.inf, True):
        with pytest.raises(ValueError, match="max_update_rms"):
            gradfuse.clip_update_rms(opt, bad)
    with pytest.raises(NotImplementedError, match="update clipping is not available for RMSprop"):
        gradfuse.clip_update_rms(torch.optim.RMSprop([nn.Parameter(torch.ones(2))]), 1.0)
    with pytest.raises(ValueError, match="needs the optimizer"):
        gradfuse.GradMonitor(nn.Linear(2, 2), max_update_rms=1.0)
