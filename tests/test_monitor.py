"""GradMonitor policies, host-sync discipline, sinks read back, the plot, memory over a long run."""
import json
import math
import os
import tracemalloc
import warnings

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse import GradMonitor, GradientAnomaly, JsonlSink
from gradfuse.sinks import LoggingSink, MetricsSink, read_jsonl


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def backward(model, scale=1.0):
    model.zero_grad()
    (model(torch.randn(4, 8)).square().mean() * scale).backward()


def test_nonfinite_skip_names_parameters_and_leaves_grads():
    model = make_model()
    mon = GradMonitor(model, max_norm=1e-6, on_nonfinite="skip", every=0)
    backward(model)
    model[2].weight.grad[1, 2] = math.nan
    model[4].bias.grad[0] = math.inf
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    r = mon.step()
    assert r.skip and r.anomalies == ["nonfinite"]
    assert "2.weight (nan=1, inf=0" in r.message and "4.bias (nan=0, inf=1" in r.message
    for n, p in model.named_parameters():  # untouched for inspection: not clipped
        assert torch.equal(p.grad.nan_to_num(), before[n].nan_to_num())
    assert mon.skipped_steps == 1 and mon.anomaly_steps == 1 and mon.clipped_steps == 0


def test_nonfinite_raise():
    model = make_model()
    mon = GradMonitor(model, on_nonfinite="raise")
    backward(model)
    model[0].weight.grad[0, 0] = -math.inf
    with pytest.raises(GradientAnomaly, match=r"0\.weight \(nan=0, inf=1"):
        mon.step()


def test_explode_warn_and_clip():
    model = make_model()
    mon = GradMonitor(model, max_norm=1.0, explode_threshold=1e3, on_explode="warn", on_nonfinite="ignore")
    backward(model, scale=1e8)
    with pytest.warns(RuntimeWarning, match="explode_threshold 1000; largest: "):
        r = mon.step()
    assert r.anomalies == ["explode"] and not r.skip
    assert float(gradfuse.stats(model).total_norm) == pytest.approx(1.0, rel=1e-4)
    assert mon.clipped_steps == 1


def test_explode_skip_and_ignore():
    model = make_model()
    backward(model, scale=1e8)
    assert GradMonitor(model, explode_threshold=10.0, on_explode="skip").step().skip
    r = GradMonitor(model, explode_threshold=10.0, on_explode="ignore").step()
    assert not r.skip


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        GradMonitor(make_model(), on_nonfinite="explode")
    with pytest.raises(ValueError, match="explode_threshold must be > 0"):
        GradMonitor(make_model(), explode_threshold=-1.0)
    with pytest.raises(ValueError, match="max_norm"):
        GradMonitor(make_model(), max_norm=-2)


class SyncCounter:
    """Counts host transfers: .item(), .cpu(), .tolist(), bool()/int()/float() of tensors."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("item", "cpu", "tolist", "__bool__", "__int__", "__float__"):
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(real))

    def _wrap(self, real):
        def f(t, *a, **k):
            self.count += 1
            return real(t, *a, **k)
        return f


@pytest.mark.parametrize("policy, syncs_per_step", [
    (dict(on_nonfinite="ignore"), 0),                               # no policy: no sync at all
    (dict(on_nonfinite="skip", explode_threshold=1e6), 1),          # one 0-d flag per step
])
def test_quiet_steps_host_syncs(monkeypatch, policy, syncs_per_step):
    model = make_model()
    backward(model)
    mon = GradMonitor(model, max_norm=0.5, every=0, **policy)
    counter = SyncCounter(monkeypatch)
    for _ in range(5):
        mon.step()
    assert counter.count == 5 * syncs_per_step


def test_disabled_costs_nothing(monkeypatch):
    model = make_model()
    backward(model)
    mon = GradMonitor(model, max_norm=1e-9, enabled=False)
    before = [p.grad.clone() for p in model.parameters()]
    counter = SyncCounter(monkeypatch)
    r = mon.step()
    assert counter.count == 0 and r.stats is None and not r.skip
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_jsonl_records_layers_and_resume(tmp_path):
    path = tmp_path / "run.jsonl"
    model = make_model()
    mon = GradMonitor(model, max_norm=1.0, every=2, on_nonfinite="skip", sinks=[JsonlSink(path)])
    for step in range(5):
        backward(model)
        if step == 3:
            model[2].bias.grad[0] = math.nan
        mon.step()
    mon.close()
    recs = read_jsonl(path)
    assert [r["step"] for r in recs] == [0, 2, 3, 4]
    assert recs[2]["event"] and recs[2]["anomalies"] == ["nonfinite"] and recs[2]["skipped"]
    assert recs[2]["params"]["2.bias"]["nan_count"] == 1
    assert set(recs[0]["layers"]) == {"0", "2", "4"}
    layer0 = recs[0]["layers"]["0"]
    p = recs[0]["params"]
    assert layer0["numel"] == p["0.weight"]["numel"] + p["0.bias"]["numel"]
    assert layer0["l2"] == pytest.approx(math.hypot(p["0.weight"]["l2"], p["0.bias"]["l2"]))
    assert recs[0]["clip_coef"] is not None
    # A crash mid-write leaves a torn line; a resumed run skips it and continues the steps.
    with open(path, "a") as f:
        f.write('{"step": 5, "total_no')
    mon2 = GradMonitor(model, every=1, sinks=[JsonlSink(path)])
    assert mon2.step_count == 5
    backward(model)
    mon2.step()
    mon2.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 2, 3, 4, 5]


def test_tensorboard_sink_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    model = make_model()
    mon = GradMonitor(model, max_norm=1e-3, every=1, sinks=[gradfuse.TensorBoardSink(writer)])
    for _ in range(3):
        backward(model)
        mon.step()
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"grad/total_norm", "grad/clip_coef", "grad/clipped", "grad_l2/0", "grad_l2/4",
            "grad_zero_fraction/2", "grad_nonfinite/0"} <= set(tags)
    assert [e.step for e in acc.Scalars("grad/total_norm")] == [0, 1, 2]
    assert all(e.value == 1.0 for e in acc.Scalars("grad/clipped"))


def test_metrics_logging_and_prometheus_sinks(caplog):
    logged = []

    class Run:
        def log(self, metrics, step):
            logged.append((step, metrics))

    model = make_model()
    sinks = [MetricsSink(Run()), LoggingSink()]
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    sinks.append(gradfuse.PrometheusSink(registry=registry))
    mon = GradMonitor(model, every=1, sinks=sinks)
    backward(model)
    with caplog.at_level("INFO", logger="gradfuse"):
        mon.step()
    assert logged[0][0] == 0 and "grad/total_norm" in logged[0][1] and "grad_l2/2" in logged[0][1]
    assert "step 0: total_norm=" in caplog.text
    assert registry.get_sample_value("gradfuse_total_norm") == pytest.approx(logged[0][1]["grad/total_norm"])
    assert registry.get_sample_value("gradfuse_layer_l2", {"layer": "4"}) > 0
    with pytest.raises(TypeError, match="log\\(dict, step=\\)"):
        MetricsSink(object())


def test_amp_grad_scaler_overflow_is_not_a_model_anomaly():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    mon = GradMonitor(model, max_norm=1.0, on_nonfinite="raise", scaler=scaler, every=0)
    for step in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().square().mean()
        scaler.scale(loss).backward()
        if step == 1:
            model[0].weight.grad[0, 0] = math.inf  # what an fp16 overflow looks like
        scaler.unscale_(opt)                         # documented order: unscale, monitor, step
        r = mon.step()
        assert not r.skip
        scaler.step(opt)
        scaler.update()
        assert (r.anomalies == ["amp_overflow"]) == (step == 1)
    assert mon.amp_overflow_steps == 1 and mon.anomaly_steps == 0
    assert scaler.get_scale() < 2.0**16  # the scaler saw the overflow and backed off


def test_plot_from_recorded_jsonl(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.jsonl"
    model = make_model()
    mon = GradMonitor(model, max_norm=0.1, every=1, on_nonfinite="skip", sinks=[JsonlSink(path)])
    for step in range(6):
        backward(model)
        if step == 4:
            model[0].bias.grad[0] = math.nan
        mon.step()
    mon.close()
    out = tmp_path / "flow.png"
    from gradfuse.__main__ import main
    assert main(["plot", str(path), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_thousand_steps_memory_flat(tmp_path):
    model = make_model()
    mon = GradMonitor(model, max_norm=1.0, every=100, on_nonfinite="skip",
                      sinks=[JsonlSink(tmp_path / "run.jsonl")])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def run(n):
        for _ in range(n):
            backward(model)
            mon.step()
            opt.step()

    run(100)  # warm caches
    tracemalloc.start()
    run(300)
    first, _ = tracemalloc.get_traced_memory()
    run(600)
    second, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert second - first < 100_000, f"python memory grew by {second - first} bytes over 600 steps"
    assert mon.step_count == 1000
