"""``gradfuse.explain`` and ``python -m gradfuse explain``: flight-recorder dumps built from
synthetic series (steady noise, then a planted spike) are explained with the right order, steps
and layers; the CLI prints the same diagnosis as text or JSON, draws it, and refuses a file that
is not a dump; a dump round-trips through write_dump / load_dump."""
import json
import math
import struct

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import gradfuse
from gradfuse.__main__ import main
from gradfuse.monitor.flight_dump import FlightDump, load_dump, write_dump
from gradfuse.viz.explain import Diagnosis, explain, plot_dump

LAYERS = ["embed", "layers.0", "layers.1", "head"]
LAYER_FIELDS = ["grad_l2", "grad_linf", "grad_nonfinite", "update_rms", "update_ratio", "exp_avg_rms",
                "exp_avg_sq_rms", "act_rms"]
SCALAR_FIELDS = ["loss", "grad_norm", "update_norm", "clip_coef", "nonfinite", "skipped"]
SPIKE_QUANTITIES = ["loss", "grad_norm", "update_norm"]
N, FIRST_STEP = 64, 1000
TRIGGER = FIRST_STEP + N - 1


def series(n=N, first_step=FIRST_STEP, seed=0, act_every=4):
    """Arrays of a steady run: every quantity around its level with 1% noise; act_rms on every
    ``act_every``-th step (NaN elsewhere)."""
    g = torch.Generator().manual_seed(seed)

    def noisy(shape, level):
        return level * (1 + 0.01 * torch.randn(shape, generator=g, dtype=torch.float64))

    scalars = torch.full((n, len(SCALAR_FIELDS)), math.nan, dtype=torch.float64)
    scalars[:, 0] = noisy(n, 3.0)
    scalars[:, 1] = noisy(n, 1.0)
    scalars[:, 2] = noisy(n, 0.1)
    scalars[:, 3] = 1.0
    scalars[:, 4] = 0.0
    scalars[:, 5] = 0.0
    layers = torch.full((n, len(LAYERS), len(LAYER_FIELDS)), math.nan, dtype=torch.float64)
    f = LAYER_FIELDS.index
    layers[:, :, f("grad_l2")] = noisy((n, len(LAYERS)), 0.5)
    layers[:, :, f("grad_linf")] = noisy((n, len(LAYERS)), 0.05)
    layers[:, :, f("grad_nonfinite")] = 0.0
    layers[:, :, f("update_rms")] = noisy((n, len(LAYERS)), 1e-3)
    layers[:, :, f("update_ratio")] = noisy((n, len(LAYERS)), 1e-3)
    layers[:, :, f("exp_avg_rms")] = noisy((n, len(LAYERS)), 1e-2)
    layers[:, :, f("exp_avg_sq_rms")] = noisy((n, len(LAYERS)), 1e-2)
    armed = torch.arange(n) % act_every == act_every - 1
    layers[armed, :, f("act_rms")] = noisy((int(armed.sum()), len(LAYERS)), 1.0)
    return {"steps": torch.arange(first_step, first_step + n, dtype=torch.int64), "scalars": scalars,
            "layers": layers, "spike": torch.zeros(n, 3, dtype=torch.bool)}


def header(step=TRIGGER, kind="spike", quantities=("loss",), first_nonfinite=None, bands=None):
    return {"step": step, "layers": LAYERS, "layer_fields": LAYER_FIELDS, "scalar_fields": SCALAR_FIELDS,
            "spike_quantities": SPIKE_QUANTITIES,
            "trigger": {"kind": kind, "anomalies": [kind] if kind != "manual" else [],
                        "message": f"planted {kind}", "quantities": list(quantities),
                        "first_nonfinite": first_nonfinite},
            "config": {"steps": N, "window": 128, "warmup": 64, "sigma": 6.0, "layer_depth": None,
                       "norm_type": 2.0},
            "bands": bands or {}, "gradfuse_version": gradfuse.__version__, "created": "2025-01-01T00:00:00Z"}


def at(step):
    return step - FIRST_STEP


def layer(arrays, name, field):
    """A view of one layer's field over the steps."""
    return arrays["layers"][:, LAYERS.index(name), LAYER_FIELDS.index(field)]


def scalar(arrays, name):
    return arrays["scalars"][:, SCALAR_FIELDS.index(name)]


def lr_jump():
    """The learning rate jumps at t0 = trigger - 1: the update RMS of layers.0 first (x20 at t0),
    of layers.1 one step later (x10), the total update norm from t0 (x5); the loss spikes at the
    trigger."""
    a = series()
    t0 = at(TRIGGER - 1)
    layer(a, "layers.0", "update_rms")[t0:] *= 20
    layer(a, "layers.1", "update_rms")[t0 + 1:] *= 10
    scalar(a, "update_norm")[t0:] *= 5
    scalar(a, "loss")[at(TRIGGER)] *= 2
    a["spike"][at(TRIGGER), 0] = True
    return a


def test_lr_jump_update_norm_first_in_layers_0_then_loss(tmp_path):
    path = write_dump(tmp_path / f"step{TRIGGER}-spike.gfdump", header(), lr_jump())
    d = explain(path)
    assert isinstance(d, Diagnosis) and d.path == str(path)
    assert (d.step, d.kind, d.quantities, d.enough_history, d.missing) == (TRIGGER, "spike", ["loss"], True, [])
    assert [(e.quantity, e.step, e.steps_before) for e in d.events] == [
        ("update_norm", TRIGGER - 1, 1), ("loss", TRIGGER, 0)]
    update = d.events[0]
    assert [(x.layer, x.step, x.steps_before) for x in update.layers] == [
        ("layers.0", TRIGGER - 1, 1), ("layers.1", TRIGGER, 0)]
    assert update.total.step == TRIGGER - 1 and update.z == update.total.z
    assert update.total.z == pytest.approx((update.total.value - update.total.mean) / update.total.std)
    assert update.layers[0].z > 1000  # x20 on 1% noise
    assert d.events[1].total.z > 6 and d.events[1].layers == []
    assert d.nonfinite is None
    text = d.text()
    assert text.startswith(f"step {TRIGGER}: spike (loss). update_norm left its band first, 1 step before "
                           f"(step {TRIGGER - 1}, z=")
    assert "in layers.0 (z=" in text and f"layers.1 (step {TRIGGER}, z=" in text
    assert f"then loss, at the trigger (step {TRIGGER}, z=" in text
    assert text.index("update_norm") < text.index("then loss")
    # the recorder's band at the trigger (over a longer, wider history) gives way to the buffer's
    wide = {q: {"mean": 1.0, "std": 100.0, "count": 128} for q in SPIKE_QUANTITIES}
    assert explain(FlightDump(header(bands=wide), lr_jump())).events == d.events


def test_poisoned_batch_grad_norm_of_the_layers_it_reaches_at_the_same_step(tmp_path):
    a = series()
    t = at(TRIGGER)
    layer(a, "layers.1", "grad_l2")[t] *= 40
    layer(a, "layers.0", "grad_l2")[t] *= 20
    scalar(a, "grad_norm")[t] *= 30
    scalar(a, "loss")[t] *= 3
    a["spike"][t, :2] = True
    d = explain(FlightDump(header(quantities=("loss", "grad_norm")), a))
    assert d.path is None
    assert [(e.quantity, e.steps_before) for e in d.events] == [("loss", 0), ("grad_norm", 0)]
    grad = d.events[1]
    assert [x.layer for x in grad.layers] == ["layers.1", "layers.0"]  # same step: by z
    assert grad.layers[0].z > grad.layers[1].z > 6
    assert "then grad_norm at the same step" in d.text()
    assert "update_norm" not in d.text()


def nan_in_layer_1():
    """layers.1 produces a NaN at the trigger: its gradients and the earlier layers' are
    non-finite (the backward carries it down), the loss and total norm are NaN."""
    a = series()
    t = at(TRIGGER)
    for name, count in (("layers.1", 40), ("layers.0", 60), ("embed", 8)):
        layer(a, name, "grad_nonfinite")[t] = count
        layer(a, name, "grad_l2")[t] = math.nan
    scalar(a, "nonfinite")[t] = 108
    scalar(a, "grad_norm")[t] = math.nan
    scalar(a, "loss")[t] = math.nan
    scalar(a, "update_norm")[t] = math.nan
    scalar(a, "skipped")[t] = 1.0  # the policy skipped the step
    layer(a, "layers.0", "update_rms")[t] = math.nan
    return a


def test_nan_inside_one_module_names_the_traced_module(tmp_path):
    h = header(kind="nonfinite", quantities=(), first_nonfinite=["forward", "layers.1.mlp.fc1"])
    d = explain(write_dump(tmp_path / "nan.gfdump", h, nan_in_layer_1()))
    assert d.nonfinite.traced and d.nonfinite.module == "layers.1.mlp.fc1" and d.nonfinite.phase == "forward"
    assert d.nonfinite.step == TRIGGER
    assert [(e.quantity, e.steps_before) for e in d.events] == [("loss", 0), ("grad_norm", 0)]
    assert all(math.isinf(e.z) for e in d.events)
    assert sorted(x.layer for x in d.events[1].layers) == ["embed", "layers.0", "layers.1"]
    text = d.text()
    assert text.startswith(f"step {TRIGGER}: nonfinite. loss left its band first, at the trigger")
    assert text.splitlines()[1] == ("The first non-finite value came from layers.1.mlp.fc1 (forward); non-finite "
                                    f"values at step {TRIGGER} (at the trigger), in the gradients of embed, "
                                    "layers.0, layers.1.")
    assert "update_norm" not in text  # the skipped step made no update: not a departure


def test_nan_without_a_trace_names_the_layers_with_nonfinite_counts(tmp_path):
    a = nan_in_layer_1()
    # the NaN appeared one step earlier in layers.1 alone (a step the policy let through)
    t = at(TRIGGER - 1)
    layer(a, "layers.1", "grad_nonfinite")[t] = 3
    scalar(a, "nonfinite")[t] = 3
    d = explain(FlightDump(header(kind="nonfinite", quantities=()), a))
    assert not d.nonfinite.traced and d.nonfinite.module is None
    assert (d.nonfinite.step, d.nonfinite.layers) == (TRIGGER - 1, ["layers.1"])
    assert (f"Non-finite values first at step {TRIGGER - 1} (1 step before), in the gradients of layers.1 "
            "(the module was not traced).") in d.text()


def test_nan_without_a_trace_names_the_first_layer_with_nonfinite_activations():
    a = nan_in_layer_1()
    t = at(TRIGGER)  # an armed step: activations recorded
    for name in ("layers.1", "head"):  # the NaN made in layers.1 flows forward into the head
        layer(a, name, "act_rms")[t] = math.nan
    d = explain(FlightDump(header(kind="nonfinite", quantities=()), a))
    assert (d.nonfinite.step, d.nonfinite.activations) == (TRIGGER, ["layers.1", "head"])
    assert d.events[0].quantity == "act_rms" and [x.layer for x in d.events[0].layers] == ["layers.1", "head"]
    assert (f"Non-finite values first at step {TRIGGER} (at the trigger), in the activations of layers.1, head "
            "and the gradients of embed, layers.0, layers.1 (the module was not traced).") in d.text()


def test_short_history_says_not_enough_history(tmp_path):
    a = series(n=4, first_step=10)
    scalar(a, "loss")[3] *= 5
    a["spike"][3, 0] = True
    d = explain(FlightDump(header(step=13), a))
    assert not d.enough_history and d.history == 4
    # the recorder's spike mark still counts; without a band there is no z
    assert [(e.quantity, e.steps_before) for e in d.events] == [("loss", 0)]
    assert math.isnan(d.events[0].z)
    text = d.text()
    assert "Not enough history: 3 recorded steps before the trigger, 5 needed for a band" in text
    assert "marked a spike by the recorder" in text
    # with the recorder's own band for the trigger step (its history is longer than the buffer)
    bands = {"loss": {"mean": 3.0, "std": 0.03, "count": 500}}
    d = explain(FlightDump(header(step=13, bands=bands), a))
    assert d.events[0].z == pytest.approx((scalar(a, "loss")[3].item() - 3.0) / 0.03)


def test_quantities_not_recorded_are_not_named(tmp_path):
    a = lr_jump()
    scalar(a, "update_norm")[:] = math.nan
    layer(a, "layers.0", "update_rms")[:] = math.nan  # no optimizer statistics anywhere
    for name in LAYERS:
        layer(a, name, "update_rms")[:] = math.nan
        layer(a, name, "act_rms")[:] = math.nan
    d = explain(FlightDump(header(), a))
    assert [e.quantity for e in d.events] == ["loss"]
    assert d.missing == ["act_rms", "update_norm"]
    assert d.text().splitlines()[0] == (f"step {TRIGGER}: spike (loss). loss left its band first, at the trigger "
                                        f"(step {TRIGGER}, z={d.events[0].z:.1f}).")
    assert d.text().splitlines()[-1] == "Not recorded: act_rms, update_norm."


def test_a_run_out_of_band_is_followed_back_past_the_lookback():
    a = series()
    layer(a, "layers.0", "grad_l2")[at(TRIGGER - 20):] *= 10  # high since 20 steps before
    d = explain(FlightDump(header(kind="manual", quantities=()), a), lookback=4)
    assert [(e.quantity, e.step, e.steps_before) for e in d.events] == [("grad_norm", TRIGGER - 20, 20)]
    assert d.events[0].total is None and d.events[0].layers[0].layer == "layers.0"
    assert d.text().startswith(f"step {TRIGGER}: manual. grad_norm left its band first, 20 steps before "
                               f"(step {TRIGGER - 20}, z=")
    assert "; the total within its band), in layers.0 (z=" in d.text()


def test_steps_after_the_trigger_are_diagnosed_as_after_it():
    a = series(n=N + 3)  # the dump holds three steps after its trigger
    layer(a, "layers.0", "update_rms")[at(TRIGGER):] *= 10
    scalar(a, "loss")[at(TRIGGER + 2):] *= 3
    d = explain(FlightDump(header(quantities=()), a))
    assert d.history == N
    assert [(e.quantity, e.steps_before) for e in d.events] == [("update_norm", 0), ("loss", -2)]
    assert "then loss, 2 steps after the trigger (step" in d.text()


def test_act_rms_on_armed_steps(tmp_path):
    a = series()
    layer(a, "layers.1", "act_rms")[at(TRIGGER)] *= 3  # the trigger is an armed step (every 4th)
    d = explain(FlightDump(header(kind="manual", quantities=()), a))
    assert [(e.quantity, e.total, [x.layer for x in e.layers]) for e in d.events] == [("act_rms", None, ["layers.1"])]
    assert "act_rms left its band first, at the trigger (step" in d.text()


def test_cli_prints_the_text_and_json_equal_to_to_dict(tmp_path, capsys):
    path = write_dump(tmp_path / "d.gfdump", header(), lr_jump())
    assert main(["explain", str(path)]) == 0
    assert capsys.readouterr().out.strip() == explain(path).text()
    assert main(["explain", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == explain(path).to_dict()
    assert out["events"][0]["quantity"] == "update_norm" and out["events"][0]["layers"][0]["layer"] == "layers.0"
    json.dumps(out, allow_nan=False)  # strict JSON: no NaN or Infinity


def test_json_of_a_nonfinite_dump_is_strict(tmp_path):
    d = explain(FlightDump(header(kind="nonfinite", quantities=()), nan_in_layer_1()))
    out = json.loads(json.dumps(d.to_dict(), allow_nan=False))
    assert out["events"][0]["z"] is None and out["nonfinite"]["layers"] == ["embed", "layers.0", "layers.1"]


def test_cli_plot_writes_a_png(tmp_path, capsys):
    path = write_dump(tmp_path / "d.gfdump", header(), lr_jump())
    png = tmp_path / "explain.png"
    assert main(["explain", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith(str(png)) and "update_norm left its band first" in out
    assert main(["explain", str(path), "--json", "--plot", str(png)]) == 0  # stdout stays JSON
    out, err = capsys.readouterr()
    assert json.loads(out)["step"] == TRIGGER and err.strip() == str(png)
    from PIL import Image
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] == 900 and im.size[1] > 600


def test_plot_dump_draws_every_recorded_quantity_with_the_trigger(tmp_path):
    from gradfuse.viz.explain import dump_figure
    fig = dump_figure(FlightDump(header(), lr_jump()), window=20)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert [t.split(":")[0] for t in titles] == ["loss", "total gradient norm", "total update norm",
                                                 "gradient L2 per layer", "update RMS per layer",
                                                 "activation RMS per layer"]
    assert titles[2].endswith(f"left its band 1 step before (step {TRIGGER - 1})")
    for ax in fig.axes:
        assert any(line.get_xdata()[0] == TRIGGER for line in ax.get_lines() if len(line.get_xdata()) == 2)
        assert ax.get_xlim()[0] >= TRIGGER - 21
    assert plot_dump(FlightDump(header(), nan_in_layer_1()), tmp_path / "nan.png") == str(tmp_path / "nan.png")


@pytest.mark.parametrize("content", [b"", b"not a dump at all", b'{"jsonl": 1}\n', struct.pack("<Q", 1) + b"5",
                                     struct.pack("<Q", 2) + b"[]"])
def test_cli_refuses_a_file_that_is_not_a_dump(tmp_path, capsys, content):
    bad = tmp_path / "run.jsonl"
    bad.write_bytes(content)
    assert main(["explain", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a gradfuse flight-recorder dump" in err and "Traceback" not in err
    assert main(["explain", str(tmp_path / "missing.gfdump")]) == 2
    assert "error: " in capsys.readouterr().err


def test_cli_refuses_an_incomplete_dump(tmp_path, capsys):
    path = write_dump(tmp_path / "partial.gfdump", {"step": 3}, {"steps": torch.arange(4)})
    assert main(["explain", str(path)]) == 2
    assert "not a complete flight-recorder dump (missing scalars, layers" in capsys.readouterr().err


def test_round_trip_of_every_array_and_the_header(tmp_path):
    arrays = lr_jump()
    arrays["layers"][5, 2, 3] = math.inf
    h = header(bands={"loss": {"mean": 3.0, "std": math.nan, "count": 0}})
    path = write_dump(tmp_path / "sub" / "step1-spike.gfdump", h, arrays)
    back = load_dump(path)
    assert set(back.arrays) == set(arrays)
    for name, t in arrays.items():
        b = back.arrays[name]
        assert (b.dtype, b.shape) == (t.dtype, t.shape)
        assert torch.equal(b.view(torch.uint8) if b.dtype != torch.bool else b,
                           t.view(torch.uint8) if t.dtype != torch.bool else t)  # bit for bit, NaN included
    assert back.header.pop("format") == "gradfuse-flight-recorder" and back.header.pop("version") == 1
    assert math.isnan(back.header["bands"]["loss"].pop("std"))
    h["bands"]["loss"].pop("std")
    assert back.header == h
    assert explain(back).to_dict() == explain(path).to_dict() | {"path": None}


def test_explain_is_public():
    assert gradfuse.explain is explain and "explain" in gradfuse.__all__
