"""The gradient-flow animation (``python -m gradfuse plot run.jsonl --animate``): per-layer
gradient L2 norms as bars on a log axis, one frame per logged step, with the run's total norm
underneath and anomalous steps (non-empty ``anomalies``, or ``skipped``) marked in red. A GIF
through Pillow (which matplotlib brings), or an MP4 through ffmpeg when the name ends in .mp4."""
from __future__ import annotations

import math
import os
import shutil

from gradfuse.monitor.sinks import read_jsonl
from gradfuse.utils import require

MAX_FRAMES = 200
ANOMALY_RED = "#d62728"
ANOMALY_BACKGROUND = "#fde2e2"


def is_anomalous(record: dict) -> bool:
    """A step to mark: the monitor named an anomaly, or the step was skipped."""
    return bool(record.get("anomalies")) or bool(record.get("skipped"))


def frame_records(records: list[dict], max_frames: int = MAX_FRAMES) -> list[dict]:
    """One record per logged step (the last, as events re-log a step), in step order, evenly
    thinned to about ``max_frames``; anomalous steps are always kept."""
    if max_frames < 1:
        raise ValueError(f"gradfuse animation: max_frames must be >= 1, got {max_frames}")
    by_step = {}
    for r in records:
        by_step[r["step"]] = r
    ordered = [by_step[k] for k in sorted(by_step)]
    if len(ordered) <= max_frames:
        return ordered
    marked = [i for i, r in enumerate(ordered) if is_anomalous(r)]
    if len(marked) > max_frames:  # more anomalies than frames: thin those too
        marked = [marked[round(j * (len(marked) - 1) / (max_frames - 1))] for j in range(max_frames)] \
            if max_frames > 1 else marked[:1]
    budget = max(max_frames - len(marked), min(2, max_frames))
    even = {round(j * (len(ordered) - 1) / max(budget - 1, 1)) for j in range(budget)}
    return [ordered[i] for i in sorted(even | set(marked))]


def layer_table(records: list[dict]) -> tuple[list[str], str]:
    """The names drawn (the records' ``layers``, else their ``params``) and that key."""
    key = "layers" if any(r.get("layers") for r in records) else "params"
    return list(dict.fromkeys(name for r in records for name in (r.get(key) or {}))), key


def animate_gradflow(jsonl_path: str | os.PathLike, out_path: str | os.PathLike = "gradflow.gif", *,
                     fps: int = 5, max_frames: int = MAX_FRAMES, dpi: int = 80) -> str:
    """Writes the animation of a GradMonitor JSONL log to ``out_path`` (``.gif``, or ``.mp4``
    with ffmpeg on PATH) and returns the path written."""
    out = os.fspath(out_path)
    ext = os.path.splitext(out)[1].lower()
    if ext not in (".gif", ".mp4"):
        raise ValueError(f"gradfuse plot --animate: the output must end in .gif or .mp4, got {out!r}")
    if ext == ".mp4" and shutil.which("ffmpeg") is None:
        raise RuntimeError(f"gradfuse plot --animate: writing {out!r} (an MP4) needs ffmpeg on PATH, "
                           "and no ffmpeg was found; install ffmpeg, or write a .gif (Pillow, no "
                           "ffmpeg needed)")
    if fps <= 0:
        raise ValueError(f"gradfuse plot --animate: fps must be > 0, got {fps}")
    records = read_jsonl(jsonl_path)
    if not records:
        raise ValueError(f"gradfuse plot: no records in {jsonl_path}")
    frames = frame_records(records, max_frames)
    fig, update = gradflow_animation_figure(records, frames)
    import matplotlib.pyplot as plt
    from matplotlib import animation
    anim = animation.FuncAnimation(fig, update, frames=len(frames), blit=False, repeat=False)
    writer = (animation.PillowWriter(fps=fps) if ext == ".gif"
              else animation.FFMpegWriter(fps=fps, codec="h264", extra_args=["-pix_fmt", "yuv420p"]))
    try:
        anim.save(out, writer=writer, dpi=dpi)
    finally:
        plt.close(fig)
    return out


def gradflow_animation_figure(records: list[dict], frames: list[dict]):
    """The figure and its ``update(i)`` drawing frame ``i`` of ``frames``: bars of the per-layer
    L2 norm (log axis, the run's range throughout; a grey tick at each layer's peak so far; a red
    bar labelled NaN / Inf for a non-finite one), and below it the total norm of every logged
    step with the clip threshold, the anomalous steps (red x) and the frame's step (a line)."""
    matplotlib = require("matplotlib", "matplotlib", "animate_gradflow")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers, key = layer_table(frames)
    n = max(len(layers), 1)

    def l2_of(r):
        table = r.get(key) or {}
        return np.array([float("nan") if (v := (table.get(name) or {}).get("l2")) is None else float(v)
                         for name in layers], float)

    grid = np.array([l2_of(r) for r in frames]) if layers else np.zeros((len(frames), 0))
    positive = grid[np.isfinite(grid) & (grid > 0)]
    lo, hi = (positive.min(), positive.max()) if positive.size else (1e-3, 1.0)
    lo, hi = lo / 3, hi * 3  # room for the labels at both ends
    peaks = np.fmax.accumulate(np.where(np.isfinite(grid), grid, np.nan), axis=0) if layers else grid

    fontsize = 9 if n <= 24 else 7 if n <= 48 else 5
    fig, (ax, tax) = plt.subplots(2, 1, figsize=(8, min(2.6 + 0.3 * n, 14) + 1.6),
                                  gridspec_kw={"height_ratios": [max(n, 3) * 0.3 + 1.2, 1.6]})
    fig.subplots_adjust(left=0.2 if max(map(len, layers), default=0) < 18 else 0.3, right=0.96,
                        top=0.92, bottom=0.08, hspace=0.45)
    y = np.arange(n)
    bars = ax.barh(y[:len(layers)], np.full(len(layers), lo), left=lo, color="tab:blue", height=0.7)
    peak_marks, = ax.plot(np.full(len(layers), np.nan), y[:len(layers)], "|", color="0.45", ms=12, mew=2)
    labels = [ax.text(lo * (hi / lo) ** 0.02, i, "", color="white", fontsize=fontsize + 1,
                      fontweight="bold", ha="left", va="center") for i in range(len(layers))]
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(y[:len(layers)], layers, fontsize=fontsize)
    ax.set_xlabel("gradient L2 norm per " + ("layer" if key == "layers" else "parameter")
                  + " (log; grey tick: peak so far)", fontsize=9)
    ax.grid(axis="x", which="major", alpha=0.3)

    steps = np.array([r["step"] for r in records], float)
    by_step = {}
    for r in records:
        by_step[r["step"]] = r
    all_steps = np.array(sorted(by_step), float)
    total = np.array([_finite_positive(by_step[s].get("total_norm")) for s in sorted(by_step)], float)
    tax.semilogy(all_steps, total, color="k", lw=1)
    max_norm = next((r["max_norm"] for r in records if isinstance(r.get("max_norm"), (int, float))), None)
    if max_norm is not None and max_norm > 0:
        tax.axhline(max_norm, color="tab:orange", ls="--", lw=1, label=f"max_norm {max_norm:g}")
    bad = [s for s in sorted(by_step) if is_anomalous(by_step[s])]
    if bad:
        finite_total = total[np.isfinite(total)]
        top = finite_total.max() if finite_total.size else 1.0
        tax.plot(bad, [top] * len(bad), "x", color=ANOMALY_RED, ms=8, mew=2, label="anomaly / skipped")
    if max_norm is not None or bad:
        tax.legend(fontsize=7, loc="upper right")
    tax.set_ylabel("total norm", fontsize=9)
    tax.set_xlabel("step", fontsize=9)
    tax.tick_params(labelsize=8)
    tax.set_xlim(steps.min() - 0.5, steps.max() + 0.5)
    cursor = tax.axvline(frames[0]["step"], color="tab:blue", lw=1.5)
    title = fig.suptitle("", fontsize=12)

    def update(i):
        r = frames[i]
        values = grid[i]
        anomalous = is_anomalous(r)
        for j, (bar, v) in enumerate(zip(bars, values)):
            # A norm: its bar. Non-finite: a red bar across the axis, labelled. Zero or absent: none.
            label = "" if math.isfinite(v) and v > 0 else _nonfinite_label(r, key, layers[j])
            bar.set_width(v - lo if not label and math.isfinite(v) and v > 0 else hi - lo if label else 0.0)
            bar.set_color(ANOMALY_RED if anomalous or label else "tab:blue")
            labels[j].set_text(label)
        if layers:
            peak_marks.set_xdata(peaks[i])
        cursor.set_xdata([r["step"], r["step"]])
        ax.set_facecolor(ANOMALY_BACKGROUND if anomalous else "white")
        text = f"step {r['step']}"
        if anomalous:
            what = ", ".join(r.get("anomalies") or [])
            text += "   ANOMALY" + (f": {what}" if what else "") + (" (skipped)" if r.get("skipped") else "")
        total_now = r.get("total_norm")
        if isinstance(total_now, (int, float)):
            text += f"   total norm {total_now:.3g}".replace("nan", "NaN").replace("inf", "Inf")
        title.set_text(text)
        title.set_color(ANOMALY_RED if anomalous else "black")
        title.set_fontweight("bold" if anomalous else "normal")
        return [*bars, peak_marks, cursor, title, *labels]

    update(0)
    return fig, update


def _finite_positive(v) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else float("nan")


def _nonfinite_label(record: dict, key: str, name: str) -> str:
    row = (record.get(key) or {}).get(name) or {}
    if row.get("nan_count"):
        return "NaN"
    if row.get("inf_count"):
        return "Inf"
    v = row.get("l2")
    if isinstance(v, float) and math.isinf(v):
        return "Inf"
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    return ""
