"""gradfuse.attach on plain PyTorch loops, against the same loop with torch's own clipping."""
import math

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse.integrations.pytorch import StepGate


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def loss_of(model, x, y):
    return (model(x) - y).square().mean() * 50  # large enough that max_norm below clips


def snapshot(model, opt):
    """Parameters and optimizer state (momentum buffers, Adam moments, step counters)."""
    state = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
             for k, s in opt.state.items()}
    return [p.detach().clone() for p in model.parameters()], state


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sa.keys() == sb.keys()
    for k in sa:
        for n in sa[k]:
            va, vb = sa[k][n], sb[k][n]
            assert torch.equal(va, vb) if torch.is_tensor(va) else va == vb


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
], ids=["sgd_momentum_wd", "adamw"])
def test_clip_matches_torch_and_nan_step_is_skipped(make_opt):
    ref, ours = make_model(), make_model()
    opt_ref, opt = make_opt(ref.parameters()), make_opt(ours.parameters())
    handle = gradfuse.attach(opt, ours, max_norm=0.5, every=0, on_nonfinite="skip")
    nan_step, clipped = 3, 0
    for step, (x, y) in enumerate(batches(6)):
        loss_of(ours, x, y).backward()
        if step == nan_step:
            ours[2].weight.grad[1, 1] = math.nan
            before = snapshot(ours, opt)
            with pytest.warns(RuntimeWarning, match=r"optimizer step skipped: .*2\.weight \(nan=1"):
                opt.step()                              # the plain loop's call: gradfuse runs first
            assert_same(snapshot(ours, opt), before)    # no update, no momentum/decay, no step count
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        loss_of(ref, x, y).backward()
        norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        clipped += int(norm > 0.5)
        opt_ref.step()
        opt_ref.zero_grad()
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert clipped == 5  # every compared step was really clipped by torch too
    m = handle.monitor
    assert (m.step_count, m.skipped_steps, m.nonfinite_steps, m.clipped_steps) == (6, 1, 1, 5)
    assert handle.last_report.step == 5
    handle.detach()
    assert "step" not in opt.__dict__ and not hasattr(opt, "_gradfuse_gate")


def test_grad_scaler_loop_unchanged_fused_unscale_and_overflow():
    """scaler.scale(loss).backward(); scaler.step(opt); scaler.update(): gradfuse unscales, checks
    and clips in its own pass; an overflow is the scaler's to skip (counted, not an anomaly)."""
    ref, ours = make_model(), make_model()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    scaler_ref = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    handle = gradfuse.attach(opt, ours, scaler=scaler, max_norm=0.5, every=0)
    for step, (x, y) in enumerate(batches(5)):
        scaler.scale(loss_of(ours, x, y)).backward()
        if step == 2:
            ours[0].bias.grad[0] = math.inf   # what an fp16 overflow looks like
            before = snapshot(ours, opt)
        if step == 3:
            scaler.unscale_(opt)              # the documented order for clipping works too
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step == 2:
            assert_same(snapshot(ours, opt), before)
            assert handle.last_report.anomalies == ["amp_overflow"] and not handle.last_report.skip
            continue
        scaler_ref.scale(loss_of(ref, x, y)).backward()
        scaler_ref.unscale_(opt_ref)
        assert nn.utils.clip_grad_norm_(ref.parameters(), 0.5) > 0.5
        scaler_ref.step(opt_ref)
        scaler_ref.update()
        opt_ref.zero_grad()
        if step < 2:
            for p, q in zip(ours.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    m = handle.monitor
    assert (m.step_count, m.amp_overflow_steps, m.anomaly_steps, m.skipped_steps) == (5, 1, 0, 0)
    assert scaler.get_scale() == 2.0**9  # the scaler saw the overflow and backed off
    handle.detach()
    assert "step" not in scaler.__dict__


def test_several_optimizers_one_decision_per_round():
    ref, ours = make_model(), make_model()
    def two(model):
        return (torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(model[2].parameters(), lr=0.01))
    refs, opts = two(ref), two(ours)
    handle = gradfuse.attach(opts, ours, max_norm=0.5, every=0)
    for step, (x, y) in enumerate(batches(4)):
        loss_of(ours, x, y).backward()
        if step == 1:
            ours[0].weight.grad[0, 0] = math.nan
            before = [snapshot(ours, o) for o in opts]
        with pytest.warns(RuntimeWarning) if step == 1 else _nothing():
            for o in opts:
                o.step()
        for o in opts:
            o.zero_grad()
        if step == 1:  # both skipped: the decision covers the round
            assert all(_same(snapshot(ours, o), b) for o, b in zip(opts, before))
            continue
        loss_of(ref, x, y).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.5)  # one norm over both optimizers' params
        for o in refs:
            o.step()
            o.zero_grad()
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert handle.monitor.step_count == 4 and handle.monitor.skipped_steps == 1
    assert handle.last_report.stats.names == ["0.weight", "0.bias", "2.weight", "2.bias"]


def _same(a, b):
    try:
        assert_same(a, b)
        return True
    except AssertionError:
        return False


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_closure_lbfgs_and_lr_schedulers_before_and_after():
    model = make_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    sched_before = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    handle = gradfuse.attach(opt, model, max_norm=1.0, every=0)
    sched_after = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # wraps our step
    x, y = batches(1)[0]
    evaluations = []

    def closure():
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        evaluations.append(loss.item())
        return loss

    w0 = model[0].weight.detach().clone()
    loss = opt.step(closure)
    assert loss.item() == evaluations[0] and len(evaluations) > 1  # LBFGS re-evaluated it
    assert not torch.equal(model[0].weight, w0) and handle.monitor.step_count == 1
    sched_before.step()
    sched_after.step()
    # A planted NaN inside the closure: the step is skipped, the closure ran once.
    evaluations.clear()

    def bad_closure():
        loss = closure()
        model[2].bias.grad[0] = math.nan
        return loss

    w1 = model[0].weight.detach().clone()
    with pytest.warns(RuntimeWarning, match="skipped"):
        assert opt.step(bad_closure).item() == evaluations[0]
    assert len(evaluations) == 1 and torch.equal(model[0].weight, w1)
    handle.detach()  # the later scheduler's wrapper stays; the gate passes calls through
    assert opt.step(closure) is not None and handle.monitor.step_count == 2


def test_detach_restores_and_double_attach_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # puts its wrapper on opt.step
    wrapper = opt.__dict__["step"]
    with gradfuse.attach(opt, model) as handle:
        assert isinstance(opt._gradfuse_gate, StepGate)
        with pytest.raises(RuntimeError, match="already has a gradfuse step gate"):
            gradfuse.attach(opt, model)
    assert opt.__dict__["step"] is wrapper and handle.monitor.step_count == 0
    loss_of(model, *batches(1)[0]).backward()
    opt.step()
    sched.step()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        gradfuse.attach(model, model)


def test_names_without_model_come_from_the_optimizer():
    model = make_model()
    opt = torch.optim.SGD(model.named_parameters(), lr=0.1)
    handle = gradfuse.attach(opt, every=0)
    loss_of(model, *batches(1)[0]).backward()
    opt.step()
    assert handle.last_report.stats.names == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_unscale_clip_names_parameters_without_names_by_param():
    """unscale_clip_ used to name rows group0.N unless names_by_param= was given."""
    model = make_model()
    x, y = batches(1)[0]
    for opt, kw, expected in [
            (torch.optim.SGD(model.named_parameters(), lr=0.1), {}, "0.weight"),  # the optimizer's names
            (torch.optim.SGD(model.parameters(), lr=0.1), {"names_by_param": model}, "0.weight"),
            (torch.optim.SGD(model.parameters(), lr=0.1), {}, "group0.0")]:
        scaler = torch.amp.GradScaler("cpu")
        model.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        s = gradfuse.unscale_clip_(opt, scaler, max_norm=1.0, **kw)
        assert s.names[0] == expected and len(s.names) == 4


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("order", ["scheduler_first", "attach_first", "both_sides"])
def test_lr_scheduler_keeps_its_view_of_the_step_in_any_order(order):
    """An LR scheduler built before or after attach (or both): no warning from torch, the same
    learning rates and counts as the same loop without gradfuse, and detach leaves it working."""
    ref, ours = make_model(), make_model()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    sched_ref = _scheduler(opt_ref)
    scheds = [_scheduler(opt)] if order != "attach_first" else []
    handle = gradfuse.attach(opt, ours, max_norm=1e3, every=0)
    if order != "scheduler_first":
        scheds.append(_scheduler(opt))
    for x, y in batches(3):
        for model, o, ss in ((ref, opt_ref, [sched_ref]), (ours, opt, scheds)):
            loss_of(model, x, y).backward()
            o.step()
            o.zero_grad()
            for s in ss:
                s.step()
    assert opt._opt_called and handle.monitor.step_count == 3
    for s in scheds:
        assert (s._step_count, s.last_epoch, s.get_last_lr()) == (
            sched_ref._step_count, sched_ref.last_epoch, sched_ref.get_last_lr())
    handle.detach()
    loss_of(ours, *batches(1)[0]).backward()
    opt.step()
    for s in scheds:
        s.step()
    assert scheds[0].last_epoch == 4


@pytest.mark.filterwarnings("error")
def test_a_skipped_first_step_counts_as_called_for_the_scheduler():
    """The policy skips the very first step: the scheduler built before attach still sees the
    optimizer's step called (torch warns otherwise that the scheduler stepped first)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = _scheduler(opt)
    handle = gradfuse.attach(opt, model, every=0, on_nonfinite="skip")
    loss_of(model, *batches(1)[0]).backward()
    model[0].bias.grad[0] = math.nan
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        opt.step()
    sched.step()
    assert handle.monitor.skipped_steps == 1 and sched.last_epoch == 1
    handle.detach()
    assert hasattr(opt.step, "_wrapped_by_lr_sched")  # the scheduler's own wrapper is back


@pytest.mark.parametrize("kind", ["gradfuse.optim", "torch fused", "torch foreach"])
def test_the_default_never_waits_where_the_optimizer_takes_the_skip(kind):
    from sync_guard import SyncGuard

    def train(blocking):
        model = make_model()
        if kind == "gradfuse.optim":
            opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=kind == "torch fused")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        handle = gradfuse.attach(opt, model, max_norm=1.0, on_nonfinite="skip",
                                 **({} if blocking is None else {"blocking": blocking}))
        guard = SyncGuard(allowed=None, host_copies=True)
        with pytest.warns(RuntimeWarning, match="gradfuse step 3: optimizer step skipped"), guard:
            for step, (x, y) in enumerate(batches(8)):
                loss_of(model, x, y).backward()
                if step == 3:
                    model[0].bias.grad[1] = math.nan
                opt.step()
                opt.zero_grad()
                sched.step()
            handle.detach()
        return model, opt, handle, guard

    model_b, opt_b, handle_b, _ = train(True)
    model_d, opt_d, handle_d, guard = train(None)
    waits = kind == "torch foreach"  # takes no skip on the device: the monitor decides on the host
    assert handle_d.monitor._defers is not waits
    assert (guard.reads != []) is waits
    assert handle_b.monitor.counters() == handle_d.monitor.counters()
    assert handle_d.monitor.counters()["skipped_steps"] == 1 and handle_d.last_report.settled
    assert all(torch.equal(a, b) for a, b in zip(model_b.parameters(), model_d.parameters(), strict=True))
    sb, sd = opt_b.state_dict()["state"], opt_d.state_dict()["state"]
    assert len(sb) == len(sd) == 4 and all(torch.equal(sb[k][n], sd[k][n]) for k in sb for n in sb[k])
    assert float(sd[0]["step"]) == 7
    assert opt_d.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] == 1e-2 / 16  # the scheduler stepped 8 times
