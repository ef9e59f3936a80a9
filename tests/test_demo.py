"""The README's main job (the demo), on tiny sizes."""
import os

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
    recs = read_jsonl(tmp_path / "run.jsonl")
    assert any(r["anomalies"] == ["nonfinite"] and r["skipped"] for r in recs)
    assert os.path.getsize(tmp_path / "gradflow.png") > 10_000
    assert os.path.getsize(tmp_path / "gradflow_activations.png") > 10_000
    assert any("act" in r and "act_grad" in r for r in recs)
    assert any(r.get("first_nonfinite") == ["forward", "layers.0.linear1"] for r in recs)


def test_info_command(capsys):
    assert main(["info"]) == 0
    assert '"torch_version"' in capsys.readouterr().out
