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
    assert "total norm (2):" in out
    recs = read_jsonl(tmp_path / "run.jsonl")
    assert any(r["anomalies"] == ["nonfinite"] and r["skipped"] for r in recs)
    assert os.path.getsize(tmp_path / "gradflow.png") > 10_000


def test_info_command(capsys):
    assert main(["info"]) == 0
    assert '"torch_version"' in capsys.readouterr().out
