"""GradMonitor(fused_step=True): the clip rides a gradfuse.optim optimizer's fused step (its
grad_scale), so clipping costs no pass of its own. Against clipping first: the same weights,
state, records and counters, bit for bit; p.grad keeps the unclipped gradient. The update
statistics ride the step's rows, and max_update_rms the step's own update clipping."""
import contextlib
import json
import math
import warnings

import pytest
import torch
from torch import nn

import gradfuse
import gradfuse.optim
from gradfuse import GradMonitor, JsonlSink


def model_and_batches(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3))
    g = torch.Generator().manual_seed(seed + 1)
    return model, [torch.randn(8, 12, generator=g) for _ in range(6)]


def backward(model, x, planted_nan=False):
    """A step's gradients (large enough to need clipping), a NaN planted in one when asked."""
    model(x).square().sum().mul(10.0).backward()
    if planted_nan:
        model[0].bias.grad[0] = math.nan


def train(tmp_path, fused_step, blocking=True, nan_at=None, clip="max_norm"):
    """``clip``: ``"max_norm"`` (0.5), ``"ZClip"`` (one capped at 0.5), or ``"layer"`` / ``"param"``
    (max_norm=0.5 per layer or parameter). The optimizer holds the last layer first, in a group of
    its own: its order is not the model's."""
    model, xs = model_and_batches()
    opt = gradfuse.optim.AdamW([{"params": model[2].parameters(), "lr": 3e-2}, {"params": model[0].parameters()}],
                               lr=1e-2, weight_decay=0.1)
    log = tmp_path / f"{fused_step}-{blocking}.jsonl"
    max_norm = gradfuse.ZClip(warmup_steps=2, z_thresh=1.0, max_grad_norm=0.5) if clip == "ZClip" else 0.5
    monitor = GradMonitor(model, max_norm=max_norm, every=1, sinks=[JsonlSink(log)],
                          per=clip if clip in ("layer", "param") else None,
                          optimizer=opt if fused_step or not blocking else None,
                          fused_step=fused_step, blocking=blocking)
    grads_after_step = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skip warns
        for step, x in enumerate(xs):
            backward(model, x, planted_nan=step == nan_at)
            report = monitor.step()
            if blocking and report.skip:
                opt.zero_grad()
                continue
            before = [p.grad.clone() for p in model.parameters()]
            opt.step()
            grads_after_step.append((before, [p.grad.clone() for p in model.parameters()]))
            opt.zero_grad()
        monitor.close()
    return model, opt, monitor, [json.loads(line) for line in log.read_text().splitlines()], grads_after_step


@pytest.mark.parametrize("clip", ["max_norm", "ZClip", "layer", "param"])
@pytest.mark.parametrize("blocking, nan_at", [(True, None), (True, 3), (False, 3)])
def test_the_clip_in_the_step_is_the_clip_before_it(tmp_path, blocking, nan_at, clip):
    m0, o0, mon0, rec0, _ = train(tmp_path, False, blocking, nan_at, clip)
    m1, o1, mon1, rec1, grads = train(tmp_path, True, blocking, nan_at, clip)
    assert mon0.counters()["clipped_steps"] == mon1.counters()["clipped_steps"] >= 4  # there was clipping
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    for k, state in o0.state_dict()["state"].items():
        assert all(torch.equal(v, o1.state_dict()["state"][k][key]) for key, v in state.items())
    assert json.dumps(rec0) == json.dumps(rec1) and len(rec0) == 6
    assert all(r["clipped"] for r in rec1 if not r["skipped"])
    if clip in ("layer", "param"):  # each row its own coefficient, some clipped and some not
        coefs = [row["clip_coef"] for row in rec1[0]["params"].values()]
        assert min(coefs) < 1 and len(set(coefs)) > 1
    # p.grad keeps the unclipped gradient, which the statistics describe
    (before, after), record = grads[0], rec1[0]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before])).item()
    assert total == pytest.approx(record["total_norm"], rel=1e-6) and total > 0.5


def test_attach_adopts_the_torch_optimizer(tmp_path):
    def run(fused_step):
        model, xs = model_and_batches()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        handle = gradfuse.attach(opt, model, max_norm=0.5, fused_step=fused_step)
        for x in xs:
            model(x).square().sum().mul(10.0).backward()
            opt.step()
            opt.zero_grad()
        handle.detach()
        return model, opt, handle.monitor

    m0, o0, mon0 = run(False)
    m1, o1, mon1 = run(True)
    assert type(o1) is gradfuse.optim.AdamW and type(o0) is torch.optim.AdamW
    assert mon0.counters()["clipped_steps"] == mon1.counters()["clipped_steps"] >= 4
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer="torch"), "needs optimizer= a gradfuse.optim optimizer"),
    (dict(max_norm=None), "numeric, schedule or ZClip max_norm"),
    (dict(per="layer", scaler=torch.amp.GradScaler("cpu")), "a ZClip or per= needs fused_step=False"),
    (dict(max_norm=None, clip_value=0.1), "not a tensor's scale"),
    (dict(recorder=gradfuse.FlightRecorder(record_updates=True)), r"record_updates=True\) with fused_step=True needs"),
])
def test_what_fused_step_refuses(kwargs, match):
    model, _ = model_and_batches()
    opt = gradfuse.optim.SGD(model.parameters(), lr=0.1)
    if kwargs.get("optimizer") == "torch":
        kwargs = {**kwargs, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with pytest.raises(ValueError, match=match):
        GradMonitor(model, **{"max_norm": 1.0, "optimizer": opt, "fused_step": True, **kwargs})


def test_the_update_statistics_ride_the_step(tmp_path):
    """With update_ratios (and a flight recorder recording the updates), the step's own rows
    replace the update-statistics pass: the records hold the same per-layer values, within float32
    rounding (the pass predicts the update in its own arithmetic; the step's rows measure the
    update it applied)."""
    def run(fused_step):
        model, xs = model_and_batches()
        opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-2)
        log = tmp_path / f"updates-{fused_step}.jsonl"
        recorder = gradfuse.FlightRecorder(optimizer=opt, record_updates=True, dump_dir=tmp_path)
        monitor = GradMonitor(model, max_norm=0.5, every=2, sinks=[JsonlSink(log)], update_ratios=opt,
                              recorder=recorder, optimizer=opt if fused_step else None, fused_step=fused_step)
        for x in xs:
            model(x).square().sum().mul(10.0).backward()
            monitor.step()
            opt.step()
            opt.zero_grad()
        monitor.close()
        records = [json.loads(line) for line in log.read_text().splitlines()]
        return model, monitor, records, recorder.unroll()[1]

    m0, mon0, rec0, ring0 = run(False)
    m1, mon1, rec1, ring1 = run(True)
    assert mon0.dynamics.update_ratios.passes >= 3 and mon1.dynamics.update_ratios.passes == 0
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    logged = [r for r in rec1 if "update_rms" in r]
    assert len(logged) == len(rec0) >= 3 and [r["step"] for r in rec0] == [r["step"] for r in rec1]
    for a, b in zip(rec0, rec1, strict=True):
        for field in ("update_ratio", "update_rms", "weight_norm", "moment1_rms", "moment2_rms", "eps_dominated"):
            assert a[field].keys() == b[field].keys() and a[field], field
            for layer, value in a[field].items():
                assert b[field][layer] == pytest.approx(value, rel=1e-5, abs=1e-12), (field, layer)
    assert torch.allclose(ring0["layers"], ring1["layers"], rtol=1e-5, atol=1e-12, equal_nan=True)
    assert torch.isfinite(ring1["layers"][:, :, 3]).any()  # the update columns were filled


# ---- max_update_rms rides the step: the step applies the limit itself, from its first read-only
# pass; no update-clipping hooks, no pass before or after the step.

UPDATE_CLIP_CASES = {  # a limit some tensors' updates exceed at some steps and others never do
    "adamw": (lambda p: gradfuse.optim.AdamW(p, lr=1e-2, weight_decay=0.1), 9e-3),
    "sgd_momentum": (lambda p: gradfuse.optim.SGD(p, lr=1e-2, momentum=0.9), 3e-3),
}


class OpCalls:
    """Counts the calls of the update and step ops (the passes a step makes)."""

    def __init__(self, monkeypatch):
        self.calls = {"multi_tensor_update_stats": 0, "multi_tensor_update_clip_": 0, "multi_tensor_optim_step_": 0}
        for name in self.calls:
            monkeypatch.setattr(gradfuse.ops, name, self._counted(name, getattr(gradfuse.ops, name)))

    def _counted(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return counted


def train_update_clip(tmp_path, case, mode, update_ratios=False, nan_at=None):
    """Mode "ride": GradMonitor(fused_step=True, max_update_rms=d); "hooks": the monitor clips the
    gradients and an UpdateClip (its max_update_rms) rescales after the step; "explicit": the
    monitor clips the gradients and the loop passes max_update_rms=d to the step itself."""
    make, d = UPDATE_CLIP_CASES[case]
    model, xs = model_and_batches()
    opt = make(model.parameters())
    log = tmp_path / f"{case}-{mode}-{update_ratios}.jsonl"
    monitor = GradMonitor(model, max_norm=0.5, every=2, sinks=[JsonlSink(log)],
                          optimizer=opt if mode != "explicit" else None, fused_step=mode == "ride",
                          max_update_rms=d if mode != "explicit" else None,
                          update_ratios=opt if update_ratios else False)
    coefs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skip warns
        for step, x in enumerate(xs):
            backward(model, x, planted_nan=step == nan_at)
            report = monitor.step()
            if not report.skip:
                opt.step(**({"max_update_rms": d} if mode == "explicit" else {}))
                got = (monitor.dynamics.update_clip.last_coefs if mode != "explicit"
                       else torch.cat([c.coefs for c in opt.last_update_coefs]))
                coefs.append(got[:len(list(model.parameters()))].clone())
            opt.zero_grad()
        monitor.close()
    return model, opt, monitor, [json.loads(line) for line in log.read_text().splitlines()], coefs


@pytest.mark.parametrize("case", list(UPDATE_CLIP_CASES))
def test_update_clipping_in_the_step_is_the_step_given_max_update_rms(tmp_path, case, monkeypatch):
    """Bit for bit the loop that clips the gradients and passes max_update_rms to the step itself;
    the update-clipping hooks are not installed, and neither the update-statistics pass nor the
    update-clipping pass runs: the step makes its two passes (the read-only one for the
    coefficients, then the step), nothing else."""
    m0, o0, _, _, coefs0 = train_update_clip(tmp_path, case, "explicit")
    calls = OpCalls(monkeypatch)
    m1, o1, mon1, _, coefs1 = train_update_clip(tmp_path, case, "ride")
    assert calls.calls == {"multi_tensor_update_stats": 0, "multi_tensor_update_clip_": 0,
                           "multi_tensor_optim_step_": 2 * 6}
    assert mon1.dynamics.update_clip._handles == [] and len(o1._optimizer_step_pre_hooks) == 0  # closed
    coefs = torch.stack(coefs1)
    assert torch.equal(coefs, torch.stack(coefs0))
    assert (coefs < 1).any() and (coefs == 1).any()  # some updates clipped, some not
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    s0, s1 = o0.state_dict()["state"], o1.state_dict()["state"]
    assert s0.keys() == s1.keys() and len(s0) == 4
    for k, state in s0.items():
        assert all(torch.equal(v, s1[k][key]) for key, v in state.items())


def test_the_monitor_hands_the_limit_to_every_step_while_open(tmp_path):
    """Every step of the optimizer gets the monitor's limit (as the UpdateClip hooks clip every
    step); a limit the caller passes too: the smaller applies; after close, none."""
    model, xs = model_and_batches()
    opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = GradMonitor(model, max_norm=0.5, every=0, optimizer=opt, fused_step=True, max_update_rms=1e-3)
    assert len(opt._optimizer_step_pre_hooks) == 1  # the monitor's handoff; no UpdateClip hook pair

    def update_rms(**kwargs):
        opt.zero_grad()
        model(xs[0]).square().sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step(**kwargs)
        return [float((p.detach().double() - b.double()).square().mean().sqrt())
                for p, b in zip(model.parameters(), before)]

    monitor.step()
    assert all(r == pytest.approx(1e-3, rel=1e-4) for r in update_rms())  # Adam's first updates: 1e-2
    assert all(r == pytest.approx(5e-4, rel=1e-4) for r in update_rms(max_update_rms=5e-4))
    assert all(r == pytest.approx(1e-3, rel=1e-4) for r in update_rms(max_update_rms=1.0))
    with pytest.raises(ValueError, match="max_update_rms must be a finite number > 0"):
        update_rms(max_update_rms=-1.0)
    assert monitor.counters()["update_clipped_steps"] == 3
    monitor.close()
    assert len(opt._optimizer_step_pre_hooks) == 0
    assert max(update_rms()) > 1e-3 and opt.last_update_coefs == []


@pytest.mark.parametrize("nan_at", [None, 3])
@pytest.mark.parametrize("case", list(UPDATE_CLIP_CASES))
def test_update_clipping_in_the_step_against_the_update_clip_hooks(tmp_path, case, nan_at):
    """Against the UpdateClip hooks (a pass before the step, one after it that forms w_before again
    from the weight the step left): the same coefficients within float rounding, so the same
    updates clipped, the same counters and ``update_clipped`` records; the weights a tensor's
    clipping writes differ in the last bit (the hooks round w_before + c * u once, from a
    w_before formed again; the step forms it from the weight it holds), and through the gradients
    every later step, so the weights and the records' values agree within float32 rounding."""
    m0, o0, mon0, rec0, coefs0 = train_update_clip(tmp_path, case, "hooks", nan_at=nan_at)
    m1, o1, mon1, rec1, coefs1 = train_update_clip(tmp_path, case, "ride", nan_at=nan_at)
    c0, c1 = torch.stack(coefs0), torch.stack(coefs1)
    torch.testing.assert_close(c1, c0, rtol=1e-6, atol=0)
    assert torch.equal(c0 < 1, c1 < 1) and (c1 < 1).any() and (c1 == 1).any()
    assert mon0.counters() == mon1.counters() and mon1.counters()["update_clipped_params"] >= 2
    assert len(c1) == (5 if nan_at is not None else 6)  # the skipped step clips nothing
    assert [r["step"] for r in rec0] == [r["step"] for r in rec1] and len(rec1) >= 3
    for a, b in zip(rec0, rec1, strict=True):
        assert a.keys() == b.keys() and a["counters"] == b["counters"]
        assert a.get("update_clipped") == b.get("update_clipped")
        assert a["total_norm"] == pytest.approx(b["total_norm"], rel=1e-5, nan_ok=True)
    assert any(r.get("update_clipped") for r in rec1)
    for a, b in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_update_clipping_and_statistics_ride_the_step_together(tmp_path, monkeypatch):
    """With update_ratios too, the step's rows serve the statistics (the update as applied,
    clipped) and its coefficients the clipping: no update pass at all; the records hold the
    per-layer values of the hooks' path within float32 rounding, and the same update_clipped."""
    _, _, mon0, rec0, _ = train_update_clip(tmp_path, "adamw", "hooks", update_ratios=True)
    calls = OpCalls(monkeypatch)
    _, _, mon1, rec1, _ = train_update_clip(tmp_path, "adamw", "ride", update_ratios=True)
    assert calls.calls["multi_tensor_update_stats"] == calls.calls["multi_tensor_update_clip_"] == 0
    assert mon0.dynamics.update_ratios.passes == 6 and mon1.dynamics.update_ratios.passes == 0
    logged = [r for r in rec1 if "update_rms" in r]
    assert len(logged) == len(rec0) == 4  # every second step, and the last one at close
    assert [r["update_clipped"] for r in rec1] == [r["update_clipped"] for r in rec0]
    assert rec1[0]["update_clipped"] == 4 and rec1[-1]["update_clipped"] < 4  # clipped and not clipped
    for a, b in zip(rec0, rec1, strict=True):
        for field in ("update_ratio", "update_rms", "weight_norm", "moment1_rms", "moment2_rms"):
            assert a[field].keys() == b[field].keys() and a[field], field
            for layer, value in a[field].items():
                assert b[field][layer] == pytest.approx(value, rel=1e-5, abs=1e-12), (field, layer)
    assert max(max(r["update_rms"].values()) for r in rec1) <= 9e-3 * (1 + 1e-5)  # the update as applied


def test_attach_rides_max_update_rms(monkeypatch):
    def run(fused_step):
        model, xs = model_and_batches()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        calls = OpCalls(monkeypatch)
        with gradfuse.attach(opt, model, max_norm=0.5, every=0, max_update_rms=9e-3, fused_step=fused_step) as h:
            for x in xs:
                model(x).square().sum().mul(10.0).backward()
                opt.step()
                opt.zero_grad()
        counters = h.monitor.counters()  # detached: the last step settled (the ride never waits)
        return model, counters, dict(calls.calls)

    m0, n0, calls0 = run(False)
    m1, n1, calls1 = run(True)
    assert calls0["multi_tensor_update_clip_"] == 6 and calls1["multi_tensor_update_clip_"] == 0
    assert calls1["multi_tensor_update_stats"] == 0
    assert n0 == n1 and n1["update_clipped_params"] >= 3 and n1["update_clipped_steps"] < 6
    for a, b in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("blocking", [True, False])
def test_amp_rides_the_step_unscaled_as_it_reads_the_gradients(tmp_path, blocking, monkeypatch):
    """GradScaler with a gradfuse.optim optimizer: the inverse scale and the clip coefficient
    are one factor the step applies, the overflow is skipped on the device, and the scaler's
    own update runs as it does: the weights, state and scale of unscaling and clipping first,
    bit for bit, with no read of the step's tensors under blocking=False."""
    from sync_guard import SyncGuard

    scales = []  # the unscaling passes over the gradients
    real_scale = gradfuse.ops.multi_tensor_scale_
    monkeypatch.setattr(gradfuse.ops, "multi_tensor_scale_", lambda *a, **k: (scales.append(1), real_scale(*a, **k)))

    def train(fused_step, guard=None):
        scales.clear()
        model, xs = model_and_batches()
        opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
        monitor = GradMonitor(model, max_norm=0.5, every=0, scaler=scaler, optimizer=opt,
                              fused_step=fused_step, blocking=blocking and not guard)
        with warnings.catch_warnings(), guard if guard is not None else contextlib.nullcontext():
            warnings.simplefilter("ignore")
            for step, x in enumerate(xs + xs):
                scaler.scale(model(x).square().sum().mul(10.0)).backward()
                if step == 3:  # an overflow: the scaler's to skip, and to halve its scale
                    model[0].bias.grad[0] = math.inf
                report = monitor.step()
                if not report.skip:
                    scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            monitor.close()
        return model, opt, scaler, monitor, len(scales)

    m0, o0, s0, mon0, passes0 = train(False)
    guard = SyncGuard(allowed=None, host_copies=True) if not blocking else None
    m1, o1, s1, mon1, passes1 = train(True, guard)
    assert passes0 >= 11 and passes1 == 0  # riding, nothing scales the gradients in place
    if guard is not None:
        assert guard.reads == [] and guard.saw_gradfuse_op()
    assert mon0.counters() == mon1.counters() and mon1.counters()["amp_overflow_steps"] == 1
    assert mon1.counters()["clipped_steps"] >= 4
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    for k, state in o0.state_dict()["state"].items():
        assert all(torch.equal(v, o1.state_dict()["state"][k][key]) for key, v in state.items())
    assert float(o1.state_dict()["state"][0]["step"]) == 11 and s0.get_scale() == s1.get_scale() != 2.0 ** 12


def test_attach_rides_amp_with_a_torch_optimizer():
    def run(fused_step):
        model, xs = model_and_batches()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with gradfuse.attach(opt, model, max_norm=0.5, scaler=scaler, fused_step=fused_step) as handle:
                for step, x in enumerate(xs):
                    scaler.scale(model(x).square().sum().mul(10.0)).backward()
                    if step == 2:
                        model[0].bias.grad[0] = math.inf
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
        return model, handle.monitor.counters(), scaler.get_scale()

    (m0, c0, s0), (m1, c1, s1) = run(False), run(True)
    assert c0 == c1 and c1["amp_overflow_steps"] == 1 and c1["clipped_steps"] == 5 and s0 == s1 == 2.0 ** 11
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
