"""The pictures of a run drawn from GradMonitor records (matplotlib, imported on first use): the
gradient flow (per-layer L2 heatmap, total norm with clip events, per-layer zero fraction) and the
per-layer exponent panels. The monitor's sinks draw them (``TensorBoardSink(images_every=N)``,
``WandbSink``, ``MLflowSink``); ``gradfuse.viz.gradflow`` draws them from a JSONL log.

Layer: monitor. Imports ``gradfuse.numerics`` and ``gradfuse.utils``.
"""
from __future__ import annotations

import math

from gradfuse.utils import require

__all__ = ["exponent_figure", "gradflow_figure", "record_figures"]


def record_figures(records: list[dict]) -> dict:
    """The pictures of ``records`` by tag: ``grad/gradflow`` (``gradflow_figure``) and, when
    the records carry ``exponents`` (``GradMonitor(histogram=True)``), ``grad/exponents``
    (``exponent_figure``). The default ``figure_fn`` of the sinks that draw."""
    if not records:
        return {}
    out = {"grad/gradflow": gradflow_figure(records)}
    if any("exponents" in r for r in records):
        out["grad/exponents"] = exponent_figure(records)
    return out


def exponent_figure(records: list[dict], max_layers: int = 16):
    """Per layer, the share of gradient elements per binary exponent (y) over the logged steps
    (x), log colour (fastai's "colorful dimension"), with the smallest normal and subnormal of
    fp16 and fp8 e4m3 / e5m2 as lines: mass below a line underflows in that format unscaled.
    From the ``exponents`` of GradMonitor(histogram=True) records; zeros, Inf and NaN are left
    out of the picture."""
    matplotlib = require("matplotlib", "matplotlib", "plot_gradflow")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    import numpy as np

    from gradfuse.numerics import histogram as H

    by_step = {r["step"]: r for r in records if "exponents" in r}
    records = [by_step[k] for k in sorted(by_step)]
    steps = np.array([r["step"] for r in records])
    layers = list(dict.fromkeys(name for r in records for name in r["exponents"]))[:max_layers]
    grids, lo_bin, hi_bin = [], H.BIN_ABOVE, 2
    for name in layers:
        g = np.zeros((H.NUM_BINS, len(records)))
        for j, r in enumerate(records):
            e = r["exponents"].get(name)
            if e:
                g[e["first_bin"]:e["first_bin"] + len(e["counts"]), j] = e["counts"]
        g[[H.BIN_ZERO, H.BIN_POS_INF, H.BIN_NEG_INF, H.BIN_NAN], :] = 0
        total = g.sum(0, keepdims=True)
        g = np.divide(g, total, out=np.zeros_like(g), where=total > 0)
        rows = np.nonzero(g.sum(1))[0]
        if rows.size:
            lo_bin, hi_bin = min(lo_bin, rows[0]), max(hi_bin, rows[-1])
        grids.append(g)
    lo_bin, hi_bin = max(min(lo_bin, H.bin_of_exponent(-26)), 2), min(max(hi_bin, lo_bin + 1), H.BIN_ABOVE)
    cols = min(4, max(len(layers), 1))
    nrows = -(-max(len(layers), 1) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.6 * nrows + 0.6), squeeze=False,
                             sharex=True, sharey=True)
    if len(steps) > 1:
        mid = (steps[1:] + steps[:-1]) / 2
        x_edges = np.concatenate([[steps[0]], mid, [steps[-1]]])
    else:
        x_edges = np.array([steps[0] - 0.5, steps[0] + 0.5])
    y_edges = np.arange(lo_bin, hi_bin + 2) - H.EXPONENT_OFFSET - 0.5
    norm = LogNorm(vmin=1e-5, vmax=1)
    lines = [(-14, "fp16 normal", "tab:red", "--"), (-24, "fp16 subnormal", "tab:red", ":"),
             (-6, "e4m3 normal", "tab:orange", "--"), (-9, "e4m3 subnormal", "tab:orange", ":"),
             (-16, "e5m2 subnormal", "tab:purple", ":")]
    im = None
    for k, ax in enumerate(axes.flat):
        if k >= len(layers):
            ax.set_visible(False)
            continue
        g = grids[k][lo_bin:hi_bin + 1]
        im = ax.pcolormesh(x_edges, y_edges, np.ma.masked_less_equal(g, 0), norm=norm, cmap="viridis")
        for e, label, color, style in lines:
            if y_edges[0] <= e <= y_edges[-1]:
                ax.axhline(e, color=color, ls=style, lw=0.8, label=label)
        ax.set_title(layers[k], fontsize=8)
        if k % cols == 0:
            ax.set_ylabel("floor(log2|g|)")
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="share of elements")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, frameon=False)
    fig.suptitle("gradient exponents per layer over steps (bins of gradfuse.histogram)", fontsize=10)
    return fig


def gradflow_figure(records: list[dict]):
    """A matplotlib figure of GradMonitor records: per-layer L2 norm over steps (log colour), the
    total norm with the clip threshold and markers at logged steps that were clipped, skipped,
    non-finite, exploding or AMP overflows (the legend counts every step of the run, from the
    monitor's counters), and per-layer zero fraction (dead units)."""
    matplotlib = require("matplotlib", "matplotlib", "plot_gradflow")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    import numpy as np

    # Events re-log a step already logged; keep one record per step, the last.
    by_step = {}
    for r in records:
        by_step[r["step"]] = r
    records = [by_step[k] for k in sorted(by_step)]
    steps = np.array([r["step"] for r in records])
    layers = list(dict.fromkeys(name for r in records for name in r["layers"]))

    def grid(key):
        g = np.full((len(layers), len(records)), np.nan)
        for j, r in enumerate(records):
            for i, name in enumerate(layers):
                if name in r["layers"]:
                    g[i, j] = r["layers"][name][key]
        return g

    l2 = grid("l2")
    zero = grid("zero_fraction")
    # A second, narrow column holds the colour bars, so all three panels share one x extent.
    fig, grid_axes = plt.subplots(
        3, 2, figsize=(11, 4 + 0.28 * len(layers) * 2 + 3), sharex="col",
        gridspec_kw={"height_ratios": [max(len(layers), 3), 3, max(len(layers), 3)],
                     "width_ratios": [50, 1]})
    axes, bars = grid_axes[:, 0], grid_axes[:, 1]
    bars[1].set_visible(False)
    ax = axes[0]
    positive = l2[np.isfinite(l2) & (l2 > 0)]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
    # Logged steps need not be evenly spaced (anomalies are logged when they happen): cells span
    # from midpoint to midpoint, so every panel shares the step axis.
    # The outer cells end at the first and last logged step: the axis covers the steps run.
    if len(steps) > 1:
        mid = (steps[1:] + steps[:-1]) / 2
        x_edges = np.concatenate([[steps[0]], mid, [steps[-1]]])
    else:
        x_edges = np.array([steps[0] - 0.5, steps[0] + 0.5])
    y_edges = np.arange(len(layers) + 1) - 0.5
    im = ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(np.where(l2 > 0, l2, np.nan)),
                       norm=norm, cmap="viridis")
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.invert_yaxis()
    ax.set_title("gradient L2 norm per layer (log colour; white: zero or non-finite)")
    fig.colorbar(im, cax=bars[0])

    ax = axes[1]
    total = np.array([r["total_norm"] if r["total_norm"] is not None else np.nan for r in records], float)
    ax.semilogy(steps, np.where(np.isfinite(total) & (total > 0), total, np.nan), lw=1, color="k",
                label="total norm")
    max_norm = next((r["max_norm"] for r in records if r.get("max_norm") is not None), None)
    thresholds = {r.get("max_norm") for r in records if r.get("max_norm") is not None}
    if len(thresholds) > 1:  # a schedule or an adaptive threshold (ZClip: inf where it did not clip)
        mn = np.array([r["max_norm"] if r.get("max_norm") is not None else np.nan for r in records], float)
        ax.step(steps, np.where(np.isfinite(mn) & (mn > 0), mn, np.nan), where="post",
                color="tab:orange", ls="--", lw=1, label="clip threshold")
    elif max_norm and math.isfinite(max_norm):
        ax.axhline(max_norm, color="tab:orange", ls="--", lw=1, label=f"clip threshold {max_norm:g}")
    finite_top = np.nanmax(np.where(np.isfinite(total), total, np.nan)) if np.isfinite(total).any() else 1.0
    # Markers can only sit on logged steps; the counts come from the monitor's counters, which
    # cover every step (older logs without counters: counted among the logged records).
    counters = records[-1].get("counters")
    marks = [("clipped", "clipped_steps", lambda r: bool(r.get("clipped")), "tab:orange", "v"),
             ("skipped", "skipped_steps", lambda r: bool(r.get("skipped")), "tab:purple", "x"),
             ("non-finite", "nonfinite_steps", lambda r: "nonfinite" in r.get("anomalies", ()), "tab:red", "o"),
             ("exploded", "explode_steps", lambda r: "explode" in r.get("anomalies", ()), "tab:brown", "^"),
             ("AMP overflow", "amp_overflow_steps", lambda r: "amp_overflow" in r.get("anomalies", ()),
              "tab:gray", "s")]
    for row, (label, counter, pred, color, marker) in enumerate(marks):  # one height per kind
        xs = [r["step"] for r in records if pred(r)]
        total_count = counters.get(counter, 0) if counters else 0
        count = f"{total_count} of {counters['steps']} steps" if counters else f"{len(xs)} logged"
        if xs or total_count:
            ax.scatter(xs, [finite_top * 4 ** (row + 1)] * len(xs), color=color, marker=marker, s=25,
                       label=f"{label}: {count}", zorder=3)
    ax.set_xlim(x_edges[0], x_edges[-1])
    ax.set_ylabel("total norm")
    ax.set_title("total norm; markers on logged steps, counts over all steps", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=5, frameon=False)
    ax.grid(True, which="both", alpha=0.2)

    ax = axes[2]
    im = ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(zero), vmin=0, vmax=1, cmap="magma")
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.invert_yaxis()
    ax.set_title("fraction of exactly-zero gradients per layer (dead units)")
    ax.set_xlabel("step")
    fig.colorbar(im, cax=bars[2])
    fig.tight_layout()
    return fig
