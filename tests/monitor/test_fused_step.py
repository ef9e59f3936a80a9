"""GradMonitor(fused_step=True): the clip rides a gradfuse.optim optimizer's fused step (its
grad_scale), so clipping costs no pass of its own. Against clipping first: the same weights,
state, records and counters, bit for bit; p.grad keeps the unclipped gradient."""
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


def train(tmp_path, fused_step, blocking=True, nan_at=None):
    model, xs = model_and_batches()
    opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    log = tmp_path / f"{fused_step}-{blocking}.jsonl"
    monitor = GradMonitor(model, max_norm=0.5, every=1, sinks=[JsonlSink(log)],
                          optimizer=opt if fused_step or not blocking else None,
                          fused_step=fused_step, blocking=blocking)
    grads_after_step = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skip warns
        for step, x in enumerate(xs):
            model(x).square().sum().mul(10.0).backward()
            if step == nan_at:
                model[0].bias.grad[0] = math.nan
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


@pytest.mark.parametrize("blocking, nan_at", [(True, None), (True, 3), (False, 3)])
def test_the_clip_in_the_step_is_the_clip_before_it(tmp_path, blocking, nan_at):
    m0, o0, mon0, rec0, _ = train(tmp_path, False, blocking, nan_at)
    m1, o1, mon1, rec1, grads = train(tmp_path, True, blocking, nan_at)
    assert mon0.counters()["clipped_steps"] == mon1.counters()["clipped_steps"] >= 4  # there was clipping
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    for k, state in o0.state_dict()["state"].items():
        assert all(torch.equal(v, o1.state_dict()["state"][k][key]) for key, v in state.items())
    assert json.dumps(rec0) == json.dumps(rec1) and len(rec0) == 6
    assert all(r["clipped"] for r in rec1 if not r["skipped"])
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
    (dict(max_norm=None), "numeric or schedule max_norm"),
    (dict(max_norm=gradfuse.ZClip()), "numeric or schedule max_norm"),
    (dict(per="layer"), "without per="),
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
