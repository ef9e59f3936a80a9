"""The flight recorder: the ring of the last K steps, its per-layer values, the update statistics,
the spike rule, the on_spike policies, the dumps, the host reads of a step, checkpoints and the
loss from attach."""
import math
import random
import statistics
import warnings

import pytest
import torch
from sync_guard import SyncGuard
from torch import nn

import gradfuse
from gradfuse import FlightRecorder, GradientAnomaly, GradMonitor, JsonlSink, load_dump
from gradfuse.monitor.recorder import LAYER_FIELDS, SCALAR_FIELDS
from gradfuse.sinks import read_jsonl

LOCAL_SCALAR = "aten._local_scalar_dense.default"


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def batch(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g) * scale


def train(model, monitor, optimizer, steps, scale=lambda i: 1.0, pass_loss=True):
    reports = []
    for i in range(steps):
        loss = model(batch(i, scale(i))).square().mean()
        loss.backward()
        reports.append(monitor.step(loss=loss if pass_loss else None))
        if not reports[-1].skip:
            optimizer.step()
        optimizer.zero_grad()
    return reports


def col(name):
    return SCALAR_FIELDS.index(name)


def field(name):
    return LAYER_FIELDS.index(name)


def test_ring_wraps_and_unrolls_oldest_first(tmp_path):
    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = GradMonitor(model, every=0, recorder=FlightRecorder(steps=5, dump_dir=tmp_path))
    reports = train(model, mon, opt, 12)
    header, arrays = mon.recorder.unroll()
    assert arrays["steps"].tolist() == [7, 8, 9, 10, 11]
    norms = [float(r.stats.total_norm) for r in reports[7:]]
    assert arrays["scalars"][:, col("grad_norm")].tolist() == pytest.approx(norms, rel=1e-12)
    assert arrays["scalars"].dtype == torch.float64 and arrays["layers"].shape == (5, 5, len(LAYER_FIELDS))
    assert header["layers"] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert header["config"]["steps"] == 5 and header["scalar_fields"] == list(SCALAR_FIELDS)


def test_a_short_run_unrolls_only_the_recorded_steps():
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = GradMonitor(model, every=0, recorder=8)
    train(model, mon, opt, 3)
    _, arrays = mon.recorder.unroll()
    assert arrays["steps"].tolist() == [0, 1, 2] and arrays["spike"].shape == (3, 3)


def test_per_layer_values_equal_grad_stats_layers():
    torch.manual_seed(1)
    model = Blocks()
    mon = GradMonitor(model, every=0, recorder=True, on_nonfinite="ignore")
    model(batch(0)).square().mean().backward()
    model.layers[1][0].weight.grad[0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    report = mon.step()
    expected = report.stats.layers()
    header, arrays = mon.recorder.unroll()
    for i, layer in enumerate(header["layers"]):
        row = arrays["layers"][0, i]
        e = expected[layer]
        assert row[field("grad_nonfinite")] == e["nan_count"] + e["inf_count"]
        if layer == "layers.1":
            assert math.isnan(row[field("grad_l2")]) and math.isnan(row[field("grad_linf")])
        else:
            assert float(row[field("grad_l2")]) == pytest.approx(e["l2"], rel=1e-12)
            assert float(row[field("grad_linf")]) == e["linf"]
    assert arrays["scalars"][0, col("nonfinite")] == 3
    assert header["names"]["layers.1"] == ["layers.1.0.weight", "layers.1.0.bias"]


def test_loss_is_nan_when_not_passed_and_recorded_when_passed():
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = GradMonitor(model, every=0, recorder=FlightRecorder(optimizer=opt, record_updates=True))
    train(model, mon, opt, 2, pass_loss=False)
    loss = model(batch(5)).square().mean()
    loss.backward()
    mon.step(loss=loss)
    _, arrays = mon.recorder.unroll()
    losses = arrays["scalars"][:, col("loss")]
    assert math.isnan(losses[0]) and math.isnan(losses[1])
    assert float(losses[2]) == pytest.approx(loss.item(), rel=1e-7)
    assert math.isnan(arrays["scalars"][0, col("update_norm")]) is False  # SGD's update is known
    assert arrays["scalars"][:, col("clip_coef")].tolist() == [1.0, 1.0, 1.0]


def layer_norms(model, names_by_layer, tensors):
    out = {}
    for layer, names in names_by_layer.items():
        ts = [tensors[n] for n in names]
        out[layer] = (math.sqrt(sum(float(t.double().square().sum()) for t in ts)), sum(t.numel() for t in ts))
    return out


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
], ids=["sgd_momentum", "adamw"])
def test_update_statistics_equal_the_applied_update(make):
    torch.manual_seed(2)
    model = Blocks()
    opt = make(model.parameters())
    mon = GradMonitor(model, every=0, recorder=FlightRecorder(optimizer=opt, record_updates=True), max_norm=1.0)
    train(model, mon, opt, 3)  # momentum buffers and Adam moments exist
    loss = model(batch(9, 3.0)).square().mean()
    loss.backward()
    mon.step(loss=loss)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    state = {n: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
             for n, p in model.named_parameters()}
    delta = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    header, arrays = mon.recorder.unroll()
    row = arrays["layers"][-1]
    u = layer_norms(model, header["names"], delta)
    w = layer_norms(model, header["names"], before)
    total = math.sqrt(sum(v[0] ** 2 for v in u.values()))
    assert float(arrays["scalars"][-1, col("update_norm")]) == pytest.approx(total, rel=1e-5)
    first = "exp_avg" if isinstance(opt, torch.optim.AdamW) else "momentum_buffer"
    for i, layer in enumerate(header["layers"]):
        (un, n), (wn, _) = u[layer], w[layer]
        assert float(row[i, field("update_rms")]) == pytest.approx(un / math.sqrt(n), rel=1e-5)
        assert float(row[i, field("update_ratio")]) == pytest.approx(un / wn, rel=1e-5)
        # the moments as the step leaves them: Adam's exp_avg, SGD's momentum buffer
        m = layer_norms(model, {layer: header["names"][layer]}, {k: s[first] for k, s in state.items()})
        assert float(row[i, field("exp_avg_rms")]) == pytest.approx(m[layer][0] / math.sqrt(n), rel=1e-5)
        if isinstance(opt, torch.optim.AdamW):
            steps = float(state[header["names"][layer][0]]["step"])
            v = sum(float(state[k]["exp_avg_sq"].double().sum()) for k in header["names"][layer])
            expected = math.sqrt(v / (1 - 0.999 ** steps) / n)
            assert float(row[i, field("exp_avg_sq_rms")]) == pytest.approx(expected, rel=1e-5)
        else:
            assert math.isnan(row[i, field("exp_avg_sq_rms")])


def plain_rule(values, window, warmup, sigma):
    """FR's rule in plain Python: the previous `window` finite values, a decision from `warmup` on,
    spike = x - mean > sigma * std (unbiased)."""
    history, out = [], []
    for x in values:
        h = history[-window:]
        if len(h) >= warmup and math.isfinite(x):
            mean, std = statistics.fmean(h), statistics.stdev(h)
            out.append(x - mean > sigma * std)
        else:
            out.append(False)
        if math.isfinite(x):
            history.append(x)
    return out


def fixed_grad_model():
    model = nn.Linear(1, 1, bias=False)
    return model


def test_spike_rule_matches_plain_python_with_planted_spikes():
    rng = random.Random(3)
    window, warmup, sigma = 16, 8, 3.0
    n = 60
    losses = [1.0 + rng.gauss(0, 0.1) for _ in range(n)]
    norms = [2.0 + rng.gauss(0, 0.2) for _ in range(n)]
    losses[5] = 50.0  # before the warm-up: no decision
    losses[30] = 5.0
    norms[41] = 9.0
    losses[50] = -10.0  # a drop is no spike
    model = fixed_grad_model()
    mon = GradMonitor(model, every=0, on_nonfinite="ignore", on_spike="ignore",
                      recorder=FlightRecorder(steps=n, window=window, warmup=warmup, sigma=sigma))
    for loss, norm in zip(losses, norms):
        model.weight.grad = torch.full((1, 1), norm)
        mon.step(loss=loss)
    _, arrays = mon.recorder.unroll()
    spikes = arrays["spike"]
    assert spikes[:, 0].tolist() == plain_rule(losses, window, warmup, sigma)
    assert spikes[:, 1].tolist() == plain_rule(norms, window, warmup, sigma)
    assert spikes[30, 0] and spikes[41, 1] and not spikes[5, 0] and not spikes[50, 0]
    assert not spikes[:, 2].any()  # no optimizer: no update norm


def spiking_run(tmp_path, on_spike, sinks=(), **kw):
    model = fixed_grad_model()
    mon = GradMonitor(model, every=0, on_spike=on_spike, sinks=sinks,
                      recorder=FlightRecorder(steps=32, window=20, warmup=10, dump_dir=tmp_path, **kw))
    reports = []
    for i in range(16):
        model.weight.grad = torch.full((1, 1), 1.0 + 0.01 * (i % 3) + (100.0 if i == 12 else 0.0))
        reports.append(mon.step(loss=1.0))
    return mon, reports


@pytest.mark.parametrize("policy", ["warn", "skip", "dump", "ignore"])
def test_on_spike_policies(tmp_path, policy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon, reports = spiking_run(tmp_path, policy)
    spike = reports[12]
    quiet = [r for i, r in enumerate(reports) if i != 12]
    assert all(not r.anomalies and r.dump is None for r in quiet)
    messages = [str(w.message) for w in caught]
    if policy == "ignore":
        assert not spike.anomalies and spike.dump is None and mon.counters()["spike_steps"] == 0
        assert not messages and not list(tmp_path.iterdir())
        return
    assert spike.anomalies == ["spike"] and spike.spikes == ["grad_norm"]
    assert "grad_norm 101 > mean" in spike.message and "layers that moved" in spike.message
    assert spike.dump == tmp_path / "step12-spike.gfdump" and spike.dump.exists()
    assert spike.skip == (policy == "skip")
    assert mon.counters()["spike_steps"] == 1 and mon.counters()["dumps"] == 1
    assert bool(messages) == (policy in ("warn", "skip"))
    dump = load_dump(spike.dump)
    assert dump.header["trigger"]["kind"] == "spike" and dump.header["trigger"]["quantities"] == ["grad_norm"]
    assert dump.header["step"] == 12 and dump.arrays["steps"][-1] == 12
    assert dump.arrays["scalars"][-1, col("skipped")] == float(policy == "skip")


def test_on_spike_raise_dumps_first(tmp_path):
    with pytest.raises(GradientAnomaly, match="spike: grad_norm") as e:
        spiking_run(tmp_path, "raise")
    assert e.value.report.dump == tmp_path / "step12-spike.gfdump"
    assert load_dump(e.value.report.dump).arrays["steps"][-1] == 12


def test_no_host_read_per_step_with_the_recorder_and_no_policy():
    torch.manual_seed(4)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mon = GradMonitor(model, every=0, on_nonfinite="ignore",
                      recorder=FlightRecorder(optimizer=opt, record_updates=True), on_spike="ignore")
    train(model, mon, opt, 2)  # warm-up: the ring, the index caches, the momentum buffers
    for i in range(3):
        loss = model(batch(i)).square().mean()
        loss.backward()
        with SyncGuard() as guard:
            mon.step(loss=loss)
        assert guard.saw_gradfuse_op()
        opt.step()
        opt.zero_grad()
    _, arrays = mon.recorder.unroll()
    assert arrays["steps"].tolist() == [0, 1, 2, 3, 4]
    assert torch.isfinite(arrays["scalars"][:, :4]).all()


def test_one_read_when_a_policy_decides():
    torch.manual_seed(4)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # policies: skip, warn
    mon = GradMonitor(model, every=0, recorder=FlightRecorder(optimizer=opt, record_updates=True))
    train(model, mon, opt, 2)
    for i in range(3):
        loss = model(batch(i)).square().mean()
        loss.backward()
        with SyncGuard(allowed=None) as guard:
            mon.step(loss=loss)
        assert guard.reads == [LOCAL_SCALAR]
        opt.step()
        opt.zero_grad()


def test_dumps_are_bounded_by_max_dumps(tmp_path):
    model = Blocks()
    mon = GradMonitor(model, every=0, recorder=FlightRecorder(dump_dir=tmp_path, max_dumps=2))
    with pytest.warns(RuntimeWarning) as caught:
        for i in range(4):
            model(batch(i)).square().mean().backward()
            model.head.weight.grad[0, 0] = math.nan
            assert mon.step().skip
            model.zero_grad()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0-nonfinite.gfdump", "step1-nonfinite.gfdump"]
    assert any("max_dumps=2 reached" in str(w.message) for w in caught)
    assert mon.counters()["dumps"] == 2 and mon.counters()["nonfinite_steps"] == 4
    assert mon.recorder.dump(tmp_path / "now.gfdump") == tmp_path / "now.gfdump"  # on demand: not bounded
    assert mon.counters()["dumps"] == 3


def test_a_failing_dump_is_counted_and_warned_once(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the dump folder should be")
    model = Blocks()
    mon = GradMonitor(model, every=0, recorder=FlightRecorder(dump_dir=blocker / "dumps"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            model(batch(i)).square().mean().backward()
            model.head.weight.grad[0, 0] = math.inf
            report = mon.step()
            assert report.skip and report.dump is None
            model.zero_grad()
    failed = [w for w in caught if "could not be written" in str(w.message)]
    assert len(failed) == 1
    assert mon.counters()["failed_dumps"] == 3 and mon.counters()["dumps"] == 0


def test_the_dump_record_reaches_a_jsonl_sink_and_round_trips(tmp_path):
    log = tmp_path / "run.jsonl"
    model = Blocks()
    mon = GradMonitor(model, every=0, sinks=[JsonlSink(log)], trace_nonfinite=True,
                      recorder=FlightRecorder(dump_dir=tmp_path / "dumps"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train(model, mon, opt, 3)
    model.layers[1][0].weight.data[0, 0] = math.nan  # a NaN produced inside one module
    loss = model(batch(7)).square().mean()
    loss.backward()
    with pytest.warns(RuntimeWarning):
        report = mon.step(loss=loss)
    mon.close()
    records = list(read_jsonl(log))
    event = next(r for r in records if r["event"])
    assert event["dump"] == str(report.dump) and event["counters"]["dumps"] == 1
    dump = load_dump(event["dump"])
    header, arrays = mon.recorder.unroll()
    assert dump.header["trigger"]["kind"] == "nonfinite"
    assert dump.header["trigger"]["first_nonfinite"] == ["forward", "layers.1.0"]
    assert dump.header["layers"] == header["layers"] and dump.header["format"] == "gradfuse-flight-recorder"
    for name in ("steps", "scalars", "layers", "spike"):
        assert dump.arrays[name].dtype == arrays[name].dtype
        torch.testing.assert_close(dump.arrays[name], arrays[name], rtol=0, atol=0, equal_nan=True)
    assert set(dump.header["bands"]) == {"loss", "grad_norm", "update_norm"}


def test_state_dict_round_trip_keeps_counters_and_bands(tmp_path):
    mon, _ = spiking_run(tmp_path, "dump")
    state = mon.state_dict()
    assert state["spike_steps"] == 1 and state["recorder"]["dumps"] == 1
    model = fixed_grad_model()
    resumed = GradMonitor(model, every=0, on_spike="dump",
                          recorder=FlightRecorder(steps=32, window=20, warmup=10, dump_dir=tmp_path))
    resumed.load_state_dict(state)
    assert resumed.counters()["spike_steps"] == 1 and resumed.counters()["dumps"] == 1
    model.weight.grad = torch.full((1, 1), 200.0)  # past the warm-up at once: the history came back
    report = resumed.step(loss=1.0)
    assert report.anomalies == ["spike"] and resumed.counters()["spike_steps"] == 2
    plain = GradMonitor(fixed_grad_model(), every=0)
    plain.load_state_dict(state)  # a monitor without a recorder ignores its state
    assert "spike_steps" not in plain.counters()


def test_attach_passes_the_closure_loss_and_handle_loss():
    torch.manual_seed(5)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    with gradfuse.attach(opt, model, recorder=FlightRecorder(record_updates=True), every=0) as handle:
        for i in range(2):
            def closure(i=i):
                opt.zero_grad()
                loss = model(batch(i)).square().mean()
                loss.backward()
                losses.append(loss.item())
                return loss
            opt.step(closure)
        opt.zero_grad()
        loss = model(batch(9)).square().mean()
        loss.backward()
        handle.loss(loss)
        opt.step()
        losses.append(loss.item())
        _, arrays = handle.monitor.recorder.unroll()
    assert arrays["scalars"][:, col("loss")].tolist() == pytest.approx(losses, rel=1e-7)
    assert torch.isfinite(arrays["scalars"][:, col("update_norm")]).all()  # the attached optimizer's


def test_a_late_loss_goes_into_the_step_just_taken_and_its_spike_counts_next(tmp_path):
    model = fixed_grad_model()
    rec = FlightRecorder(window=20, warmup=10, dump_dir=tmp_path)
    mon = GradMonitor(model, every=0, recorder=rec, on_spike="warn")
    for i in range(13):
        model.weight.grad = torch.full((1, 1), 1.0)
        report = mon.step()
        rec.record_loss(1.0 + 0.01 * (i % 3) + (50.0 if i == 12 else 0.0))
        assert not report.anomalies
    model.weight.grad = torch.full((1, 1), 1.0)
    with pytest.warns(RuntimeWarning, match="spike: loss 51"):
        report = mon.step()
    assert report.spikes == ["loss"] and report.dump == tmp_path / "step13-spike.gfdump"
    _, arrays = rec.unroll()
    assert arrays["scalars"][12, col("loss")] == 51.0 and arrays["spike"][12, 0]
    assert math.isnan(arrays["scalars"][13, col("loss")])


def test_activation_rms_per_layer():
    torch.manual_seed(6)
    model = Blocks()
    mon = GradMonitor(model, every=1, activations=True, recorder=True)
    model(batch(0)).square().mean().backward()
    report = mon.step()
    act = mon.record(report)["act"]
    header, arrays = mon.recorder.unroll()
    for i, layer in enumerate(header["layers"]):
        assert float(arrays["layers"][0, i, field("act_rms")]) == pytest.approx(act[layer]["rms"], rel=1e-12)


def test_bad_arguments():
    with pytest.raises(ValueError, match="warmup"):
        FlightRecorder(window=10)
    with pytest.raises(ValueError, match="steps"):
        FlightRecorder(steps=0)
    with pytest.raises(ValueError, match="sigma"):
        FlightRecorder(sigma=0)
    with pytest.raises(ValueError, match="on_spike"):
        GradMonitor(nn.Linear(2, 2), recorder=True, on_spike="explode")
    with pytest.raises(TypeError, match="recorder"):
        GradMonitor(nn.Linear(2, 2), recorder="yes")
    rec = FlightRecorder()
    GradMonitor(nn.Linear(2, 2), recorder=rec)
    with pytest.raises(RuntimeError, match="another monitor"):
        GradMonitor(nn.Linear(2, 2), recorder=rec)
    mon = GradMonitor(nn.Linear(2, 2), recorder=True)
    assert mon.recorder.dump() is None  # nothing recorded yet
    assert mon.config()["recorder"] == 64 and mon.config()["on_spike"] == "warn"
    assert "recorder" not in GradMonitor(nn.Linear(2, 2)).config()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_hands_the_loss_to_the_step_just_taken(accumulate):
    pytest.importorskip("lightning")
    from lightning_harness import fit

    from gradfuse.integrations.lightning import GradfuseCallback
    cb = GradfuseCallback(recorder=FlightRecorder(record_updates=True), on_spike="ignore")
    fit([cb], accumulate=accumulate)
    _, arrays = cb.monitor.recorder.unroll()
    scalars = arrays["scalars"]
    assert len(arrays["steps"]) == 8 // accumulate
    assert torch.isfinite(scalars[:, col("loss")]).all() and (scalars[:, col("loss")] > 0).all()
    assert torch.isfinite(scalars[:, col("update_norm")]).all()  # the optimizer's updates


def test_the_hf_trainer_hands_each_update_its_loss(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers_harness import make_trainer
    from transformers_harness import train as hf_train

    from gradfuse.integrations.transformers import attach as hf_attach
    trainer, _opt = make_trainer(tmp_path, 1.0)
    cb = hf_attach(trainer, recorder=FlightRecorder(record_updates=True), on_spike="ignore")
    hf_train(trainer)
    _, arrays = cb.monitor.recorder.unroll()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert arrays["steps"].tolist() == [1, 2, 3, 4]
    assert arrays["scalars"][:, col("loss")].tolist() == pytest.approx(logged, rel=1e-3)
    assert torch.isfinite(arrays["scalars"][:, col("update_norm")]).all()
