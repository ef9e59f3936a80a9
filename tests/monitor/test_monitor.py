"""GradMonitor policies, host-sync discipline, sinks read back, the plot, memory over a long run."""
import io
import math
import tracemalloc
import warnings

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse import GradientAnomaly, GradMonitor, JsonlSink
from gradfuse.sinks import LoggingSink, MetricsSink, read_jsonl


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def backward(model, scale=1.0):
    model.zero_grad()
    (model(torch.randn(4, 8)).square().mean() * scale).backward()


def test_nonfinite_skip_names_parameters_and_leaves_grads():
    model = make_model()
    mon = GradMonitor(model, max_norm=1e-6, every=0)  # on_nonfinite="skip" is the default
    backward(model)
    model[2].weight.grad[1, 2] = math.nan
    model[4].bias.grad[0] = math.inf
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        r = mon.step()
    assert r.skip and r.anomalies == ["nonfinite"]
    assert "2.weight (nan=1, inf=0" in r.message and "4.bias (nan=0, inf=1" in r.message
    for n, p in model.named_parameters():  # untouched for inspection: not clipped
        assert torch.equal(p.grad.nan_to_num(), before[n].nan_to_num())
    assert mon.skipped_steps == 1 and mon.anomaly_steps == 1 and mon.clipped_steps == 0


def test_a_watch_given_as_the_model_is_used_as_it_is():
    model = make_model()
    handle = gradfuse.watch(model)
    mon = GradMonitor(handle, max_norm=0.01, every=0)
    backward(model, scale=100.0)
    expected = gradfuse.stats(model).to_dict()
    r = mon.step()
    assert mon._watch is handle and handle.last_path is not None
    got = r.stats.to_dict()
    assert got["total_norm"] == pytest.approx(expected["total_norm"]) and expected["total_norm"] > 0.01
    assert got["params"].keys() == expected["params"].keys()
    for name, row in expected["params"].items():
        assert got["params"][name] == pytest.approx(row)
    assert gradfuse.stats(model).to_dict()["total_norm"] == pytest.approx(0.01, rel=1e-4)  # clipped through it
    with pytest.raises(ValueError, match="the watch given has norm_type=2.0"):
        GradMonitor(handle, norm_type=1.0)


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
    with pytest.warns(RuntimeWarning, match="optimizer step skipped: total norm"):
        assert GradMonitor(model, explode_threshold=10.0).step().skip  # the default: a circuit breaker
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


def test_jsonl_records_layers_and_torn_line(tmp_path):
    path = tmp_path / "run.jsonl"
    model = make_model()
    mon = GradMonitor(model, max_norm=1e-3, every=2, on_nonfinite="skip", sinks=[JsonlSink(path)])
    for step in range(5):
        backward(model)
        if step == 3:
            model[2].bias.grad[0] = math.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mon.step()
    mon.close()
    recs = read_jsonl(path)
    assert [r["step"] for r in recs] == [0, 2, 3, 4]
    assert recs[2]["event"] and recs[2]["anomalies"] == ["nonfinite"] and recs[2]["skipped"]
    assert recs[2]["params"]["2.bias"]["nan_count"] == 1
    assert recs[3]["counters"] == {"steps": 5, "clipped_steps": 4, "skipped_steps": 1, "anomaly_steps": 1,
                                   "nonfinite_steps": 1, "explode_steps": 0, "amp_overflow_steps": 0,
                                   "dropped_records": 0}
    assert set(recs[0]["layers"]) == {"0", "2", "4"}
    layer0 = recs[0]["layers"]["0"]
    p = recs[0]["params"]
    assert layer0["numel"] == p["0.weight"]["numel"] + p["0.bias"]["numel"]
    assert layer0["l2"] == pytest.approx(math.hypot(p["0.weight"]["l2"], p["0.bias"]["l2"]))
    assert recs[0]["clip_coef"] is not None
    # A crash mid-write leaves a torn line: the next record starts on a line of its own.
    with open(path, "a") as f:
        f.write('{"step": 5, "total_no')
    sink = JsonlSink(path)
    assert sink.last_step() == 4  # the torn line is not a record
    sink.write({"step": 5, "x": 1})
    sink.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 2, 3, 4, 5]


def run_steps(mon, model, steps, opt, data):
    """A deterministic stretch of training: batch i of ``data``, a spike at 13, a NaN at 17."""
    for step in steps:
        model.zero_grad()
        x = data[step]
        (model(x).square().mean() * (1e6 if step == 13 else 1.0)).backward()
        if step == 17:
            model[0].weight.grad[0, 0] = math.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if not mon.step().skip:
                opt.step()


def test_state_dict_resume_mid_run_continues_numbering_and_counts(tmp_path):
    """Save at step 25 of 40, restore into a fresh process-like setup, run to 40: the same
    records and counters as the run that never stopped (the bug: a resume restarted at the last
    logged step + 1 and numbered steps twice)."""
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(40)]
    kw = dict(max_norm=0.05, every=10, explode_threshold=1e3, on_explode="skip", on_nonfinite="skip")

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    full = GradMonitor(model, sinks=[JsonlSink(tmp_path / "full.jsonl")], **kw)
    run_steps(full, model, range(40), opt, data)
    full.close()

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mon = GradMonitor(model, sinks=[JsonlSink(tmp_path / "resumed.jsonl")], **kw)
    run_steps(mon, model, range(25), opt, data)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gradfuse": mon.state_dict()}, saved)
    run_steps(mon, model, range(25, 33), opt, data)  # ... then the job dies at step 33
    del mon

    saved.seek(0)
    checkpoint = torch.load(saved)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    mon = GradMonitor(model, sinks=[JsonlSink(tmp_path / "resumed.jsonl")], **kw)
    mon.load_state_dict(checkpoint["gradfuse"])
    assert mon.step_count == 25
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # restored: no "numbering steps twice" warning
        run_steps(mon, model, range(25, 40), opt, data)
    mon.close()
    assert mon.state_dict() == full.state_dict()
    assert full.state_dict()["step"] == 40 and full.skipped_steps == 2 and full.clipped_steps == 38
    # The log of the resumed run holds step 30 twice (steps 25-32 ran twice); the last record
    # of each step is the same as in the run that never stopped.
    last = {r["step"]: r for r in read_jsonl(tmp_path / "resumed.jsonl")}
    full_recs = {r["step"]: r for r in read_jsonl(tmp_path / "full.jsonl")}
    assert sorted(last) == sorted(full_recs) == [0, 10, 13, 17, 20, 30, 39]
    for step in (30, 39):
        assert last[step]["counters"] == full_recs[step]["counters"]
        assert last[step]["total_norm"] == pytest.approx(full_recs[step]["total_norm"], rel=1e-6)


def test_fresh_monitor_on_an_old_log_warns_instead_of_numbering_twice(tmp_path):
    path = tmp_path / "run.jsonl"
    model = make_model()
    mon = GradMonitor(model, every=10, sinks=[JsonlSink(path)])
    for _ in range(40):
        backward(model)
        mon.step()
    mon.close()
    mon2 = GradMonitor(model, every=10, sinks=[JsonlSink(path)])
    backward(model)
    with pytest.warns(RuntimeWarning, match="already holds records up to step 39 .* load_state_dict"):
        mon2.step()
    with pytest.raises(KeyError, match="missing"):
        mon2.load_state_dict({"step": 3})


def test_warnings_point_at_the_callers_line():
    """The no_grad decorator adds a frame (torch/utils/_contextlib.py): warnings must still name
    the line that called mon.step() / optimizer.step()."""
    model = make_model()
    backward(model, scale=1e8)
    mon = GradMonitor(model, explode_threshold=10.0, on_explode="warn")
    with pytest.warns(RuntimeWarning, match="explode_threshold") as rec:
        mon.step()
    assert rec[0].filename == __file__
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = gradfuse.attach(opt, model, explode_threshold=10.0)  # default on_explode: skip
    with pytest.warns(RuntimeWarning, match="optimizer step skipped") as rec:
        opt.step()
    assert rec[0].filename == __file__
    handle.detach()


def test_layers_group_by_block_index():
    from gradfuse.core.grad_stats import layer_of
    assert layer_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert layer_of("bert.encoder.layer.11.attention.self.query.weight") == "bert.encoder.layer.11"
    assert layer_of("encoder.block.0.layer.1.DenseReluDense.wi.weight") == "encoder.block.0"
    assert layer_of("transformer.wte.weight") == "transformer.wte"
    assert layer_of("lm_head.weight") == "lm_head"
    assert layer_of("pos") == "pos"
    assert layer_of("0.weight") == "0"
    assert layer_of("layers.3.attn.weight", 1) == "layers"


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
    """The legend counts clipped steps over the whole run (not among logged steps), explosions
    have their own marker, and the step axis starts at the first step, not before it."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.jsonl"
    model = make_model()
    mon = GradMonitor(model, max_norm=0.1, every=10, on_nonfinite="skip", explode_threshold=1e4,
                      sinks=[JsonlSink(path)])
    for step in range(40):
        backward(model, scale=1e6 if step == 15 else 1.0)
        if step == 24:
            model[0].bias.grad[0] = math.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mon.step()
    mon.close()
    assert mon.clipped_steps == 38  # all but the two skipped steps
    out = tmp_path / "flow.png"
    from gradfuse.__main__ import main
    assert main(["plot", str(path), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    from gradfuse.viz.gradflow import gradflow_figure
    fig = gradflow_figure(read_jsonl(path))
    ax = fig.axes[2]  # the total-norm panel (after the heat map and its colour bar)
    labels = ax.get_legend_handles_labels()[1]
    assert "clipped: 38 of 40 steps" in labels and "skipped: 2 of 40 steps" in labels
    assert "exploded: 1 of 40 steps" in labels and "non-finite: 1 of 40 steps" in labels
    assert ax.get_xlim() == (0.0, 39.0)  # close() logged the last step


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
