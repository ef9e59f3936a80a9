"""The README's pictures stay readable: asserted on the matplotlib Figure objects the drawing
functions return (gradfuse.monitor.figures, gradfuse.viz.gradflow / activations,
benchmarks/summarize.py), from small synthetic records."""
import math
import os
import sys

import pytest

pytest.importorskip("matplotlib")
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from gradfuse.monitor.figures import FORMAT_LIMITS, exponent_figure, gradflow_figure
from gradfuse.numerics import histogram as H
from gradfuse.viz.activations import activation_figure
from gradfuse.viz.gradflow import noise_scale_figure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = ["embed", "layers.0", "layers.1", "layers.2", "head"]  # 5: a spare cell in 2 x 4
SPIKE, NAN = 12, 24


def records(steps=40, zero=0.004):
    """Records like the demo's: norms around 2, a spike of 1e6 at step SPIKE (exploding,
    skipped), a NaN in layers.1 at step NAN (non-finite, skipped), a few exactly-zero gradients
    in layers.0, exponent histograms and the noise scale."""
    out = []
    for step in range(steps):
        spike, nan = step == SPIKE, step == NAN
        total = 2e6 if spike else math.nan if nan else 2.0 + 0.5 * math.sin(step)
        layers, exponents = {}, {}
        for name in LAYERS:
            l2 = total / 2 if math.isfinite(total) else math.nan
            layers[name] = {"l2": l2 if not (nan and name != "layers.1") else 1.0,
                            "zero_fraction": zero * (step % 3) / 2 if name == "layers.0" else 0.0}
            first = H.bin_of_exponent(-20 + (20 if spike else 0))
            counts = [1, 10, 100, 1000, 100, 10, 1]
            e = {"first_bin": first, "counts": counts}
            if nan and name == "layers.1":
                counts = counts + [0] * (H.BIN_NAN - first - len(counts)) + [1]
                e = {"first_bin": first, "counts": counts}
            exponents[name] = e
        out.append({"step": step, "total_norm": total, "max_norm": 1.0, "clipped": not (spike or nan),
                    "skipped": spike or nan,
                    "anomalies": ["explode"] if spike else ["nonfinite"] if nan else [],
                    "layers": layers, "exponents": exponents,
                    "noise_scale": {"noise_scale": 5.0 + step / 10, "G2": 1.0, "trSigma": 5.0 + step / 10},
                    "counters": {"steps": step + 1, "clipped_steps": step - 1, "skipped_steps": 2,
                                 "nonfinite_steps": 1, "explode_steps": 1, "amp_overflow_steps": 0}})
    return out


def font_sizes(fig):
    fig.canvas.draw()
    return [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text)
            if t.get_visible() and t.get_text().strip()]


def test_total_norm_axis_is_not_squashed_by_a_spike():
    fig = gradflow_figure(records())
    ax = fig.axes[2]  # heat map, its colour bar, then the total norm
    lo, hi = ax.get_ylim()
    assert ax.get_yscale() == "log"
    # the spike (1e6 x the median) is off scale: the axis spans far less than it ...
    assert hi < 2e6 / 100 and lo > 0.5
    # ... and it is marked, with its step and value
    texts = [t.get_text() for t in ax.texts]
    assert any(f"step {SPIKE}" in t and "2e+06" in t for t in texts), texts
    assert any(label.startswith("off scale") for label in ax.get_legend_handles_labels()[1])
    # the ordinary norms use a good part of the axis (log scale): at least a third of it
    finite = [r["total_norm"] for r in records() if math.isfinite(r["total_norm"]) and r["total_norm"] < 10]
    span = math.log(max(finite) / min(finite)) / math.log(hi / lo)
    assert span > 0.15
    plt.close(fig)


def test_no_spike_no_off_scale_mark():
    recs = [r for r in records() if r["step"] != SPIKE]
    fig = gradflow_figure(recs)
    ax = fig.axes[2]
    assert not ax.texts
    assert not any(label.startswith("off scale") for label in ax.get_legend_handles_labels()[1])
    plt.close(fig)


def test_dead_units_colour_range_fits_the_data():
    fig = gradflow_figure(records(zero=0.004))
    ax = fig.axes[4]  # the zero-fraction panel
    mesh = ax.collections[0]
    assert mesh.norm.vmin == 0 and mesh.norm.vmax == pytest.approx(0.004)
    colours = {tuple(c) for c in mesh.to_rgba(mesh.get_array().compressed())}
    assert len(colours) >= 3  # 0, 0.002 and 0.004 in different colours: not one flat colour
    plt.close(fig)


def test_dead_units_all_zero_says_so():
    fig = gradflow_figure(records(zero=0.0))
    ax = fig.axes[4]
    assert any("no exactly-zero gradients" in t.get_text() for t in ax.texts)
    plt.close(fig)


def test_activation_fractions_fit_the_data():
    recs = [{"step": s, "act": {"a": {"rms": 1.0, "dead_fraction": 0.001 * (s % 2)}},
             "act_grad": {"a": {"rms": 1e-3, "zero_fraction": 0.0}}} for s in range(6)]
    fig = activation_figure(recs)
    dead, zero = fig.axes[1], fig.axes[3]
    assert dead.collections[0].norm.vmax == pytest.approx(0.001)
    assert any("no exactly-zero activation gradients" in t.get_text() for t in zero.texts)
    plt.close(fig)


def reference_lines(fig):
    return [line for ax in fig.axes for line in ax.lines if line.get_gid() == "format-limit"]


def test_exponent_reference_lines_are_told_apart_and_named():
    fig = exponent_figure(records())
    ax = fig.axes[0]
    lines = [line for line in ax.lines if line.get_gid() == "format-limit"]
    assert len(lines) >= 5
    styles = [(matplotlib.colors.to_hex(line.get_color()), line.get_linestyle(),
               line.get_gapcolor() and matplotlib.colors.to_hex(line.get_gapcolor())) for line in lines]
    assert len(set(styles)) == len(styles), styles  # no two lines alike
    assert len({s[0] for s in styles}) >= 3  # colour per format, not one colour for all
    legend = fig.legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    for fmt, *_ in FORMAT_LIMITS:
        assert any(fmt in label for label in labels) or any(
            fmt in t.get_text() for a in fig.axes for t in a.texts), fmt  # drawn, or named off scale
    assert any("fp16 min subnormal" in label for label in labels)
    assert any("fp16 min normal" in label for label in labels)
    # a legend entry's colour and style are those of a drawn line
    drawn = {(matplotlib.colors.to_hex(c), s) for c, s, _ in styles} | {
        (matplotlib.colors.to_hex(line.get_gapcolor()), line.get_linestyle())
        for line in lines if line.get_gapcolor() is not None}
    for handle in legend.legend_handles:
        if handle.get_linestyle() not in ("None", "") and handle.get_label().strip():
            assert (matplotlib.colors.to_hex(handle.get_color()), handle.get_linestyle()) in drawn
    plt.close(fig)


def test_exponent_figure_has_no_empty_panel_and_marks_skipped_steps():
    fig = exponent_figure(records())
    grid_axes = [ax for ax in fig.axes if ax.get_subplotspec() is not None]
    panels = [ax for ax in grid_axes if ax.collections]
    assert len(panels) == len(LAYERS)
    # every cell of the grid holds a layer or the colour bar (5 layers: 2 x 3): none is left blank
    spare = [ax for ax in grid_axes if not ax.collections]
    assert len(spare) == 1 and spare[0].child_axes
    # the skipped steps are marked on every panel; the NaN step filled only where the NaN is
    for ax, name in zip(panels, LAYERS):
        marks = {int(c.get_offsets()[0][0]): c for c in ax.collections if c.get_gid() == "step-mark"}
        assert set(marks) == {SPIKE, NAN}, name
        filled = not np.allclose(marks[NAN].get_facecolor()[0][:3], 1)
        assert filled == (name == "layers.1"), name
    plt.close(fig)


def test_noise_scale_has_the_batch_size_line():
    fig = noise_scale_figure(records(), batch_size=64)
    ax = fig.axes[0]
    lines = [line for line in ax.lines if line.get_gid() == "batch-size"]
    assert len(lines) == 1 and lines[0].get_ydata()[0] == 64
    assert any("batch size: 64" in label for label in ax.get_legend_handles_labels()[1])
    lo, hi = ax.get_ylim()
    assert lo < 64 < hi
    plt.close(fig)
    # from the records, when they carry it
    recs = records()
    for r in recs:
        r["noise_scale"]["batch_size"] = 32
    fig = noise_scale_figure(recs)
    assert [line.get_ydata()[0] for line in fig.axes[0].lines if line.get_gid() == "batch-size"] == [32]
    plt.close(fig)


@pytest.mark.parametrize("draw", [gradflow_figure, exponent_figure,
                                  lambda r: noise_scale_figure(r, batch_size=64)])
def test_fonts_readable_at_800_px(draw):
    """Shown 800 px wide, a point is 800 / (72 x width in inches) px: every text >= ~10 px."""
    fig = draw(records())
    width = fig.get_size_inches()[0]
    assert min(font_sizes(fig)) * 800 / (72 * width) >= 9.9
    plt.close(fig)


def test_benchmark_chart_limits_from_the_data(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import summarize
    finally:
        sys.path.pop(0)
    rows = {("tiny", "float32"): {"torch_clip_foreach": {"median_s": 1.0}, "gradfuse_stats": {"median_s": 0.013},
                                  "hook_loop": {"median_s": 13.0}},
            ("gpt2_small", "float32"): {"torch_clip_foreach": {"median_s": 1.0},
                                        "gradfuse_stats": {"median_s": 0.4}, "hook_loop": {"median_s": 19.0}}}
    figs, close = [], plt.close
    monkeypatch.setattr(plt, "close", figs.append)  # keep the chart's figure to look at
    summarize.chart({"rows": rows}, str(tmp_path / "chart.png"))
    ax = figs[0].axes[0]
    lo, hi = ax.get_xlim()
    assert ax.get_xscale() == "log"
    assert lo < 0.013 and lo > 0.013 / 10  # below the smallest ratio, not a fixed 0.1
    assert hi > 19 and hi < 19 * 10
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"
    close(figs[0])
