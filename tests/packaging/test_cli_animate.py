"""``python -m gradfuse plot run.jsonl --animate``: the gradient-flow animation of a JSONL log
written by GradMonitor + JsonlSink, with a planted NaN step marked in red."""
import os
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402  (Pillow comes with matplotlib)

import gradfuse  # noqa: E402
from gradfuse.__main__ import main  # noqa: E402
from gradfuse.viz.animation import frame_records  # noqa: E402

STEPS, NAN_STEP = 8, 3


@pytest.fixture
def run_jsonl(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    path = tmp_path / "run.jsonl"
    monitor = gradfuse.GradMonitor(model, max_norm=1.0, every=1, on_nonfinite="skip",
                                   sinks=[gradfuse.JsonlSink(path)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(STEPS):
            x = torch.randn(8, 6)
            if step == NAN_STEP:
                x[0, 0] = float("nan")
            model(x).square().mean().backward()
            if not monitor.step().skip:
                opt.step()
            opt.zero_grad()
    monitor.close()
    return path


def red_pixels(frame) -> int:
    """Pixels of the anomaly red (#d62728, give or take the GIF palette)."""
    import numpy as np
    rgb = np.asarray(frame.convert("RGB")).astype(int)
    return int(((rgb[..., 0] > 180) & (rgb[..., 1] < 90) & (rgb[..., 2] < 90)).sum())


def test_animate_writes_a_gif_with_a_frame_per_step_and_the_nan_step_in_red(run_jsonl, tmp_path,
                                                                             monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(run_jsonl), "--animate", "--fps", "4"]) == 0
    assert capsys.readouterr().out.strip() == "gradflow.gif"  # the default name when animating
    gif = tmp_path / "gradflow.gif"
    assert os.path.getsize(gif) > 5_000
    with Image.open(gif) as im:
        assert im.n_frames == STEPS
        assert im.info.get("duration") == 250  # 4 frames per second
        reds = []
        for i in range(im.n_frames):
            im.seek(i)
            reds.append(red_pixels(im))
        im.seek(NAN_STEP)
        im.convert("RGB").save(tmp_path / "nan_frame.png")  # to look at
    # The NaN step: red title, red bars across the axis. Other frames: only the small red x of the
    # total-norm panel that marks the anomalous step.
    normal = [n for i, n in enumerate(reds) if i != NAN_STEP]
    assert reds[NAN_STEP] > 20 * max(normal) and reds[NAN_STEP] > 5_000
    assert not (tmp_path / "gradflow.png").exists()


def test_plot_without_animate_still_draws_the_png(run_jsonl, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(run_jsonl)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "gradflow.png"
    assert os.path.getsize(tmp_path / "gradflow.png") > 10_000


def test_mp4_without_ffmpeg_names_ffmpeg(run_jsonl, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "no-ffmpeg-here"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert main(["plot", str(run_jsonl), "--animate", "-o", str(tmp_path / "flow.mp4")]) == 2
    err = capsys.readouterr().err
    assert "ffmpeg" in err and "PATH" in err and ".gif" in err
    assert not (tmp_path / "flow.mp4").exists()


def test_other_extensions_are_refused(run_jsonl, tmp_path, capsys):
    assert main(["plot", str(run_jsonl), "--animate", "-o", str(tmp_path / "flow.avi")]) == 2
    assert ".gif or .mp4" in capsys.readouterr().err


def test_long_logs_are_thinned_to_about_200_frames_keeping_anomalies():
    records = [{"step": s, "anomalies": ["explode"] if s in (333, 334, 901) else [],
                "skipped": s == 777} for s in range(1000)]
    records.append({"step": 901, "anomalies": ["explode"], "skipped": True, "event": True})  # re-logged
    frames = frame_records(records, 200)
    steps = [r["step"] for r in frames]
    assert len(frames) <= 200 and steps == sorted(set(steps))
    assert {0, 999, 333, 334, 777, 901} <= set(steps)
    assert next(r for r in frames if r["step"] == 901).get("event")  # the last record of a step
    assert len(frame_records(records[:50], 200)) == 50
