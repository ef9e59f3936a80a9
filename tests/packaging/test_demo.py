"""The README's main job (the demo), on tiny sizes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradfuse.__main__ import main
from gradfuse.sinks import read_jsonl


def test_demo_runs_and_catches_the_planted_faults(tmp_path, capsys):
    assert main(["demo", "--steps", "30", "--tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 10: explode -> skipped the optimizer step" in out
    assert "step 20: nonfinite -> skipped the optimizer step" in out
    assert "layers.1.linear1.weight (nan=1, inf=0" in out
    assert "gradfuse.clip_ (stats + clip, none needed)" in out
    # activations: the NaN planted in a forward is traced to its module; the dead layer is found
    assert ("step 25: nonfinite -> skipped the optimizer step\n    first non-finite value in the forward "
            "output of layers.0.linear1 (1 NaN); non-finite gradients in ") in out
    assert "dead layers: 3 (32/32 units dead); the gradient reaching module 0's output is 100% zeros" in out
    assert "total norm (2):" in out
    # the recommended configuration: the clip and the skip ride AdamW's step, decided on the
    # device; gradfuse's step never read a value of the step on the host
    assert "in opt.step() (statistics, clip, policies, the update) the host waited for the device 0 times " \
           "in 30 steps; it read " in out
    dump = tmp_path / "dumps" / "step10-explode.gfdump"
    assert f"the flight recorder on the spike (python -m gradfuse explain {dump}):\nstep 10: explode" in out
    assert dump.is_file() and main(["explain", str(dump)]) == 0
    assert "grad_norm left its band first" in capsys.readouterr().out
    recs = read_jsonl(tmp_path / "run.jsonl")
    assert any(r["anomalies"] == ["nonfinite"] and r["skipped"] for r in recs)
    assert os.path.getsize(tmp_path / "gradflow.png") > 10_000
    assert os.path.getsize(tmp_path / "gradflow_activations.png") > 10_000
    assert any("act" in r and "act_grad" in r for r in recs)
    assert any(r.get("first_nonfinite") == ["forward", "layers.0.linear1"] for r in recs)


def test_demo_logs_the_exponent_heatmap_and_the_noise_scale(tmp_path, capsys):
    """The data of the README's docs/exponents.png and docs/noise_scale.png (docs/make_images.py
    draws them from this run's log): histogram=True on the logging steps, and the noise scale from
    the demo's two accumulated micro-batches per step."""
    from gradfuse import histogram as H
    from gradfuse.demo.demo import run
    result = run(steps=30, out_dir=str(tmp_path), tiny=True, timing=False)
    out = capsys.readouterr().out
    recs = read_jsonl(tmp_path / "run.jsonl")
    assert [r["step"] for r in recs] == list(range(30))  # steps=30: every step is a logging step
    # exponent histograms: every element of every layer counted once, on every logging step
    for r in recs:
        assert r["exponents"] and r["headroom"], r["step"]
        numel = {}
        for name, p in r["params"].items():
            layer = next(layer for layer in r["exponents"] if name == layer or name.startswith(layer + "."))
            numel[layer] = numel.get(layer, 0) + p["numel"]
        assert {layer: sum(e["counts"]) for layer, e in r["exponents"].items()} == numel
    # ... and they see what was planted: the NaN of step 20 in the NaN bin of layers.1 only
    def nan_counts(r):
        return {layer: e["counts"][-1] if e["first_bin"] + len(e["counts"]) - 1 == H.BIN_NAN else 0
                for layer, e in r["exponents"].items()}

    assert recs[20]["skipped"] and recs[20]["anomalies"] == ["nonfinite"]
    assert nan_counts(recs[20]) == {layer: int(layer == "layers.1") for layer in recs[20]["exponents"]}
    assert all(not any(nan_counts(r).values()) for r in recs[:20])
    # noise scale: finite and positive from the first step on (accumulation_steps=2 is known up
    # front), averaged in only on steps that were applied: the skipped spike (10), NaN (20) and
    # forward-NaN (25) steps leave the estimate as it was
    ns = [r["noise_scale"] for r in recs]
    assert all(v is not None and v["G2"] > 0 and v["trSigma"] > 0 for v in ns)
    assert all(1.0 < v["noise_scale"] < 1e4 for v in ns)
    for skipped in (10, 20, 25):
        assert recs[skipped]["skipped"] and ns[skipped] == ns[skipped - 1], skipped
    assert ns[9] != ns[8] and ns[29] != ns[28]  # applied steps do move it
    assert result["noise_scale"] == pytest.approx(ns[-1])
    assert result["host_reads"] == 0 and result["spike_dump"].endswith("step10-explode.gfdump")
    assert "gradient noise scale (2 accumulated micro-batches of 32): B_simple = " in out
    for key in ("exponents_picture", "noise_scale_picture"):
        assert os.path.getsize(result[key]) > 10_000


def test_info_command(capsys):
    assert main(["info"]) == 0
    assert '"torch_version"' in capsys.readouterr().out


def test_help_speaks_to_users():
    root = Path(__file__).resolve().parents[2]  # the checkout's gradfuse (-m puts the cwd first on the path)
    out = subprocess.run([sys.executable, "-m", "gradfuse", "--help"], cwd=root, capture_output=True, text=True,
                         check=True).stdout
    assert "Fused gradient statistics, clipping and monitoring for PyTorch" in out
    assert "Layer:" not in out and "Imports any of gradfuse" not in out
    for command in ("demo", "plot", "explain", "info"):
        assert command in out
