"""Planted spikes on a small transformer trained on the CPU, each explained by
``python -m gradfuse explain``: a learning-rate jump for a few steps (the update norm is named
before the loss), a poisoned batch (the gradient norm of the layers the bad inputs reach, at the
step of the loss) and a NaN produced inside one module (that module). The monitor runs with the
flight recorder and ``on_spike="dump"``; the dump of the first anomaly is explained by the real
command line, in a fresh process, and its JSON read back."""
import json
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from gradfuse import FlightRecorder, GradMonitor, load_dump

AT = 55  # the step the trouble is planted at
STEPS = AT + 4


class TinyTransformer(nn.Module):
    """Continuous inputs projected to the model width, two pre-LayerNorm encoder blocks, a head."""

    def __init__(self, features=8, width=32, blocks=2):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True,
                                                                norm_first=True) for _ in range(blocks)])
        self.head = nn.Linear(width, features)

    def forward(self, x):
        h = self.embed(x)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def batch(step: int, poison: bool = False):
    """A sequence task (predict the previous position's features); a poisoned batch has inputs
    30 times their usual size."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 12, 8, generator=g)
    return x * (30 if poison else 1), x.roll(1, dims=1)


def train(kind: str, dump_dir):
    """Trains with the trouble ``kind`` planted at step AT; returns the reports."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = GradMonitor(model, every=0, recorder=FlightRecorder(steps=48, window=40, warmup=20, dump_dir=dump_dir,
                                                                     record_updates=True),
                          on_spike="dump", on_nonfinite="skip", trace_nonfinite=kind == "nan", update_ratios=opt)
    reports, hook = [], None
    for step in range(STEPS):
        if kind == "lr":  # 100 times the learning rate for three steps
            for group in opt.param_groups:
                group["lr"] = 0.1 if AT <= step < AT + 3 else 1e-3
        if kind == "nan" and step == AT:  # one module produces a NaN in its output
            nan_out = lambda module, args, out: out.index_fill(0, torch.tensor([0]), float("nan"))  # noqa: E731
            hook = model.layers[1].linear1.register_forward_hook(nan_out, prepend=True)
        x, y = batch(step, poison=kind == "poison" and step == AT)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skip policy warns
            report = monitor.step(loss=loss)
        reports.append(report)
        if hook is not None:
            hook.remove()
            hook = None
        if not report.skip:
            opt.step()
        opt.zero_grad()
    monitor.close()
    return reports


def explain_first_dump(reports):
    """The first dump of the run, explained by the command line (--json)."""
    first = next(r for r in reports if r.dump is not None)
    out = subprocess.run([sys.executable, "-m", "gradfuse", "explain", "--json", str(first.dump)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = subprocess.run([sys.executable, "-m", "gradfuse", "explain", str(first.dump)],
                          capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    return first, json.loads(out.stdout), text.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {kind: train(kind, tmp_path_factory.mktemp(kind)) for kind in ("lr", "poison", "nan", "quiet")}


def test_a_quiet_run_has_no_anomaly_and_no_dump(runs):
    assert not any(r.anomalies or r.dump for r in runs["quiet"])


def test_a_learning_rate_jump_names_the_update_norm_before_the_loss(runs):
    report, d, text = explain_first_dump(runs["lr"])
    assert report.step == AT + 1 and "spike" in report.anomalies
    order = [e["quantity"] for e in d["events"]]
    assert order[0] == "update_norm" and "loss" in order[1:]
    first, loss = d["events"][0], d["events"][order.index("loss")]
    assert (first["step"], first["steps_before"]) == (AT, 1)  # the step of the jump, one before the loss
    assert (loss["step"], loss["steps_before"]) == (AT + 1, 0)
    # the layers it hit: every layer (the learning rate is every layer's), at the step of the jump
    assert sorted(x["layer"] for x in first["layers"]) == ["embed", "head", "layers.0", "layers.1"]
    assert all(x["step"] == AT and x["z"] > 6 for x in first["layers"])
    assert text.startswith(f"step {AT + 1}: spike") and "update_norm left its band first, 1 step before" in text


def test_a_poisoned_batch_names_the_gradient_norm_of_the_layers_it_reaches_at_its_step(runs):
    report, d, text = explain_first_dump(runs["poison"])
    assert report.step == AT and set(d["quantities"]) >= {"loss", "grad_norm"}
    events = {e["quantity"]: e for e in d["events"]}
    grad = events["grad_norm"]
    assert grad["steps_before"] == 0 and events["loss"]["steps_before"] == 0  # the same step
    # the bad inputs enter through the input projection and ride the residual stream to the head
    assert {x["layer"] for x in grad["layers"][:2]} == {"embed", "head"}
    assert all(x["z"] > 100 for x in grad["layers"][:2])
    assert "grad_norm" in text and "embed" in text


def test_a_nan_made_inside_one_module_names_that_module(runs):
    report, d, text = explain_first_dump(runs["nan"])
    assert report.step == AT and report.anomalies == ["nonfinite"] and report.skip
    assert d["nonfinite"]["module"] == "layers.1.linear1" and d["nonfinite"]["phase"] == "forward"
    assert d["nonfinite"]["step"] == AT
    assert "layers.1.linear1 (forward)" in text


def test_the_dumps_load_back_with_the_steps_before_the_trouble(runs):
    report = next(r for r in runs["lr"] if r.dump is not None)
    dump = load_dump(report.dump)
    steps = dump.arrays["steps"].tolist()
    assert steps == list(range(steps[0], report.step + 1)) and len(steps) == 48  # the ring, full, in order
    assert dump.header["trigger"]["kind"] == "spike" and dump.header["step"] == report.step
    loss = dump.arrays["scalars"][:, dump.header["scalar_fields"].index("loss")]
    assert torch.isfinite(loss).all() and loss[-1] > loss[:-2].max()  # the loss the loop passed, its spike


def test_the_cost_benchmark_runs():
    """A tiny run of benchmarks/recorder_cost.py, so that it cannot rot (not a timing)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "benchmarks/recorder_cost.py", "--steps", "1", "--layers", "1",
                          "--width", "32", "--seq", "8"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| recorder | " in out.stdout and "| recorder+updates | " in out.stdout
