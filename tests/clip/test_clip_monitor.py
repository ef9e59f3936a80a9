"""Clipping in the monitor and attach: max_norm schedules (logged, bad values under the policy),
per=, clip_value=, agc=, and the double-clipping warning."""
import math
import warnings

import pytest
import torch
from helpers import ListSink
from torch import nn

import gradfuse
from gradfuse import GradientAnomaly, GradMonitor


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def backward(model, scale=1.0, seed=0):
    model.zero_grad()
    torch.manual_seed(seed)
    (model(torch.randn(4, 8)).square().mean() * scale).backward()


def total_norm(model):
    return torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()


def test_schedule_applied_and_logged_each_logging_step():
    model = make_model()
    sink = ListSink()
    schedule = lambda step: 1.0 if step < 3 else 0.25  # noqa: E731
    mon = GradMonitor(model, max_norm=schedule, every=1, sinks=[sink], on_nonfinite="ignore")
    for step in range(5):
        backward(model, scale=20.0, seed=step)
        before = total_norm(model)
        mon.step()
        assert before > 1.0  # clipping happened at both values
        assert total_norm(model) == pytest.approx(schedule(step), rel=1e-5)
    assert [r["max_norm"] for r in sink.records] == [1.0, 1.0, 1.0, 0.25, 0.25]
    assert all(r["clipped"] for r in sink.records)


@pytest.mark.parametrize("bad", [math.nan, -1.0, "x", "raises"])
def test_bad_schedule_value_raise_names_the_step(bad):
    def schedule(step):
        if step < 2:
            return 1.0
        if bad == "raises":
            raise ZeroDivisionError("boom")
        return bad

    model = make_model()
    mon = GradMonitor(model, max_norm=schedule, every=0, on_nonfinite="raise")
    for _ in range(2):
        backward(model, 10.0)
        mon.step()
    backward(model, 10.0)
    with pytest.raises(ValueError, match="max_norm schedule .* step 2"):
        mon.step()


def test_bad_schedule_value_skip_and_warn_policies():
    model = make_model()
    mon = GradMonitor(model, max_norm=lambda step: math.nan, every=0)  # on_nonfinite="skip"
    backward(model, 10.0)
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="step 0"):
        r = mon.step()
    assert r.skip and "max_norm" in r.anomalies
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))  # not clipped
    mon = GradMonitor(model, max_norm=lambda step: -2.0, every=0, on_nonfinite="warn")
    with pytest.warns(RuntimeWarning, match="step 0"):
        r = mon.step()
    assert not r.skip and all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_monitor_per_layer_matches_clip_():
    model, ref = make_model(), make_model()
    backward(model, 10.0)
    backward(ref, 10.0)
    sink = ListSink()
    mon = GradMonitor(model, max_norm=0.5, per="layer", every=1, sinks=[sink], layer_depth=1)
    mon.step()
    gradfuse.clip_(ref, 0.5, per="layer", layer_depth=1)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.abs().sum() > 0
        torch.testing.assert_close(p.grad, q.grad)
    rec = sink.records[0]
    assert rec["clipped"] and rec["max_norm"] == 0.5
    assert all("clip_coef" in row for row in rec["params"].values())
    assert mon.clipped_steps == 1


def test_monitor_clip_value_one_pass_and_with_policy():
    for on_nonfinite in ("ignore", "skip"):
        model, ref = make_model(), make_model()
        backward(model, 10.0)
        backward(ref, 10.0)
        sink = ListSink()
        mon = GradMonitor(model, clip_value=0.05, every=1, sinks=[sink], on_nonfinite=on_nonfinite)
        r = mon.step()
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.05)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        d = r.stats.to_dict()
        assert d["clamped"] > 0 and d["total_norm"] > 0.05  # statistics from before clamping
        assert mon.clipped_steps == 1


def test_monitor_agc_matches_function():
    model, ref = make_model(), make_model()
    backward(model, 10.0)
    backward(ref, 10.0)
    unclipped = [p.grad.clone() for p in model.parameters()]
    mon = GradMonitor(model, agc=0.01, every=0)
    mon.step()
    gradfuse.adaptive_clip_grad_(ref.parameters(), 0.01)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    changed = sum(not torch.equal(p.grad, u) for p, u in zip(model.parameters(), unclipped))
    assert 0 < changed  # AGC clipped some gradients


def test_monitor_bad_modes():
    model = make_model()
    with pytest.raises(ValueError, match="one of max_norm, clip_value and agc"):
        GradMonitor(model, max_norm=1.0, clip_value=0.1)
    with pytest.raises(ValueError, match="per"):
        GradMonitor(model, max_norm=1.0, per="block")
    with pytest.raises(ValueError, match="per= needs a max_norm"):
        GradMonitor(model, per="param")
    with pytest.raises(ValueError, match="clip_value"):
        GradMonitor(model, clip_value=-1)
    with pytest.raises(ValueError, match="clip_factor"):
        GradMonitor(model, agc=0)
    with pytest.raises(ValueError, match="eps"):
        GradMonitor(model, agc=0.01, agc_eps=-1)


# --------------------------------------------------------------------------------------------
# Double clipping

def test_double_clip_warns_once_naming_the_call():
    model = make_model()
    mon = GradMonitor(model, max_norm=1.0, every=0)
    backward(model, 10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.step()  # nothing else touched the gradients: quiet
    backward(model, 10.0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the user's own clip
    with pytest.warns(RuntimeWarning, match=r"GradMonitor.step\(\).*already changed in place.*max_norm="):
        mon.step()
    backward(model, 10.0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.step()  # once


def test_double_clip_quiet_with_accumulation_and_unscale_and_off_switch():
    model = make_model()
    mon = GradMonitor(model, max_norm=1.0, every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            model.zero_grad(set_to_none=False)
            for _ in range(3):  # accumulation: in-place adds, all during the backward
                (model(torch.randn(4, 8)).square().mean()).backward()
            mon.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = GradMonitor(model, max_norm=1.0, every=0, scaler=scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
            scaler.unscale_(opt)  # one legitimate in-place change
            mon.step()
            scaler.step(opt)
            scaler.update()
    mon = GradMonitor(model, max_norm=1.0, every=0, check_double_clip=False)
    backward(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.step()


def test_attach_double_clip_names_attach():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = gradfuse.attach(opt, model=model, max_norm=1.0, every=0)
    try:
        backward(model, 10.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.warns(RuntimeWarning, match="gradfuse.attach"):
            opt.step()
    finally:
        handle.detach()


def test_attach_takes_zclip_and_schedule():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    z = gradfuse.ZClip(warmup_steps=3)
    handle = gradfuse.attach(opt, model=model, max_norm=z, every=0, on_nonfinite="ignore")
    try:
        for k in range(6):
            backward(model, 100.0 if k == 5 else 1.0, seed=k)
            opt.step()
        assert z.steps == 6 and handle.monitor.clipped_steps == 1  # the spike
    finally:
        handle.detach()


def test_raise_policy_still_raises_anomaly_with_schedule():
    model = make_model()
    mon = GradMonitor(model, max_norm=lambda s: 1.0, every=0, on_nonfinite="raise")
    backward(model)
    model[0].bias.grad[0] = math.nan
    with pytest.raises(GradientAnomaly):
        mon.step()


def test_plot_draws_a_scheduled_threshold(tmp_path):
    pytest.importorskip("matplotlib")
    from gradfuse.viz.gradflow import plot_gradflow
    model = make_model()
    path = tmp_path / "run.jsonl"
    sink = gradfuse.JsonlSink(str(path))
    mon = GradMonitor(model, max_norm=lambda step: 1.0 if step < 3 else 0.5, every=1, sinks=[sink],
                      on_nonfinite="ignore")
    for step in range(6):
        backward(model, 10.0, seed=step)
        mon.step()
    mon.close()
    plot_gradflow(str(path), str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").stat().st_size > 0


@pytest.mark.parametrize("mode", [dict(max_norm=0.05, per="param"), dict(clip_value=0.01),
                                  dict(max_norm="zclip")], ids=["per", "value", "zclip"])
def test_fused_amp_unscale_then_other_modes(mode):
    """With scaler= and optimizer=, the monitor unscales in its own pass; the other modes then
    clip the unscaled gradients as the functions do after scaler.unscale_."""
    model, ref = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    kw = dict(mode)
    z_ref = None
    if kw.get("max_norm") == "zclip":
        kw["max_norm"] = gradfuse.ZClip(warmup_steps=1, max_grad_norm=0.05)
        z_ref = gradfuse.ZClip(warmup_steps=1, max_grad_norm=0.05)
    mon = GradMonitor(model, scaler=scaler, optimizer=opt, every=0, on_nonfinite="ignore", **kw)
    for step in range(3):
        for m, o, sc in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            o.zero_grad()
            torch.manual_seed(step)
            sc.scale(m(torch.randn(4, 8)).square().mean() * 10).backward()
        mon.step()
        ref_scaler.unscale_(ref_opt)
        unscaled = [p.grad.clone() for p in ref.parameters()]
        if "per" in mode:
            gradfuse.clip_(ref, 0.05, per="param")
        elif "clip_value" in mode:
            gradfuse.clip_grad_value_(ref.parameters(), 0.01)
        else:
            z_ref.step(ref)
        for p, q, _ in zip(model.parameters(), ref.parameters(), unscaled):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8)
        assert any(not torch.equal(q.grad, u) for q, u in zip(ref.parameters(), unscaled))  # clipped
        for sc, o in ((scaler, opt), (ref_scaler, ref_opt)):
            sc.step(o)
            sc.update()
