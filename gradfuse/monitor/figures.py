"""The pictures of a run drawn from GradMonitor records (matplotlib, imported on first use): the
gradient flow (per-layer L2 heatmap, total norm with clip events, per-layer zero fraction) and the
per-layer exponent panels. The monitor's sinks draw them (``TensorBoardSink(images_every=N)``,
``WandbSink``, ``MLflowSink``); ``gradfuse.viz.gradflow`` draws them from a JSONL log.

Layer: monitor. Imports ``gradfuse.numerics`` and ``gradfuse.utils``.
"""
from __future__ import annotations

import math

from gradfuse.utils import require

__all__ = ["FORMAT_LIMITS", "exponent_figure", "fraction_panel", "gradflow_figure", "log_panel", "record_figures",
           "step_edges"]


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


# Sizes in points for figures 9-10 inches wide, which the README and the docs show ~800 px wide:
# there 9 pt is 10-11 px.
FONT = {"tick": 9, "label": 10, "title": 10.5, "legend": 9}

# The limits of the low-precision formats gradients are cast to, as (format, colour, largest
# finite, smallest normal, smallest subnormal); drawn on the exponent panels.
FORMAT_LIMITS = [("fp16", "tab:red", 65504.0, 2.0 ** -14, 2.0 ** -24),
                 ("bf16", "tab:green", 3.3895313892515355e38, 2.0 ** -126, 2.0 ** -133),
                 ("fp8 e4m3", "tab:orange", 448.0, 2.0 ** -6, 2.0 ** -9),
                 ("fp8 e5m2", "tab:blue", 57344.0, 2.0 ** -14, 2.0 ** -16)]
# Line style per kind of limit: mass above "max" overflows; below "min normal" it loses
# precision (subnormal); below "min subnormal" it flushes to zero.
LIMIT_STYLES = {"max": "-.", "min normal": "--", "min subnormal": ":"}
# Triangles on the top edge of an exponent panel: (legend label, scatter style) per kind of step.
STEP_MARKS = {"nan here": ("NaN/Inf in this layer", {"color": "tab:red"}),
              "nan elsewhere": ("non-finite step (NaN/Inf elsewhere)",
                                {"facecolor": "white", "edgecolor": "tab:red", "linewidths": 1.3}),
              "explode": ("exploding step", {"color": "tab:brown"}),
              "skipped": ("skipped step", {"color": "tab:purple"})}


def _step_edges(steps):
    """Cell edges on the step axis. Logged steps need not be evenly spaced (anomalies are logged
    when they happen): cells span from midpoint to midpoint, and the outer cells end at the first
    and last logged step, so the axis covers the steps run and every panel shares it."""
    import numpy as np
    if len(steps) > 1:
        mid = (steps[1:] + steps[:-1]) / 2
        return np.concatenate([[steps[0]], mid, [steps[-1]]])
    return np.array([steps[0] - 0.5, steps[0] + 0.5])


def _cmap(name: str, lo: float, hi: float, bad: str | None = None):
    """The part ``lo``..``hi`` of a matplotlib colour map (so that its ends stay visible)."""
    import matplotlib
    import numpy as np
    from matplotlib.colors import ListedColormap
    cmap = ListedColormap(matplotlib.colormaps[name](np.linspace(lo, hi, 256)), name=f"{name}_part")
    return cmap.with_extremes(bad=bad) if bad else cmap


def step_edges(steps):
    """The cell edges of a heatmap over logged ``steps`` (a sorted numpy array): midway between
    neighbours, the first and last steps at the ends (one step: a cell of width 1)."""
    import numpy as np

    if len(steps) > 1:
        mid = (steps[1:] + steps[:-1]) / 2
        return np.concatenate([[steps[0]], mid, [steps[-1]]])
    return np.array([steps[0] - 0.5, steps[0] + 0.5])


def log_panel(fig, ax, x_edges, y_edges, values):
    """A heatmap of positive magnitudes on a log colour scale with its colour bar beside ``ax``;
    white where a value is zero, negative or not finite. Returns the mesh."""
    import numpy as np
    from matplotlib.colors import LogNorm

    positive = values[np.isfinite(values) & (values > 0)]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
    im = ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(np.where(values > 0, values, np.nan)),
                       norm=norm, cmap="viridis")
    fig.colorbar(im, ax=ax, pad=0.01).ax.tick_params(labelsize=FONT["tick"])
    return im


def fraction_panel(fig, ax, x_edges, y_edges, values, what: str, cax=None):
    """A heatmap of fractions in [0, 1] whose colour range runs from 0 to the largest value drawn
    (a few zeros in a thousand would not show on a 0-to-1 scale): pale yellow for 0, white where
    there is no value, a percent colour bar (in ``cax``, else beside ``ax``). When every value is 0 (or none is finite),
    the text ``no <what> in any logged step`` over a blank panel instead. Returns the mesh."""
    import numpy as np
    from matplotlib.ticker import PercentFormatter

    finite = values[np.isfinite(values)]
    top = float(finite.max()) if finite.size else 0.0
    im = ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(values), vmin=0.0,
                       vmax=top if top > 0 else 1.0, cmap=_cmap("magma_r", 0.0, 0.85, bad="white"))
    if top > 0:
        bar = fig.colorbar(im, cax=cax, format=PercentFormatter(xmax=1, decimals=None),
                           **({} if cax is not None else {"ax": ax, "pad": 0.01}))
        bar.ax.tick_params(labelsize=FONT["tick"])
    else:
        if cax is not None:
            cax.set_visible(False)
        ax.text(0.5, 0.5, f"no {what} in any logged step", transform=ax.transAxes, ha="center",
                va="center", fontsize=FONT["title"] + 1, color="0.2")
    return im


def exponent_figure(records: list[dict], max_layers: int = 16):
    """Per layer, the share of gradient elements per binary exponent (y) over the logged steps
    (x), log grey scale (fastai's "colorful dimension"), with the limits of fp16, bf16 and fp8
    e4m3 / e5m2 as coloured lines (``FORMAT_LIMITS``; style per kind: dash-dot the largest finite
    value, dashed the smallest normal, dotted the smallest subnormal, so that mass above a
    dash-dot line overflows in that format unscaled and mass below a dotted one flushes to zero;
    limits outside the plotted exponents are named in the legend, not drawn). Zeros, Inf and NaN
    are not in the shares: a step whose gradients are all NaN is a white column. Triangles on a
    panel's top edge mark its skipped and non-finite steps (filled red: NaN/Inf in this layer;
    hollow red: a non-finite step, NaN/Inf elsewhere; brown: an exploding norm). The legend sits
    below the panels, one column per format; the colour bar in the grid's spare cell. From the
    ``exponents`` of GradMonitor(histogram=True) records."""
    matplotlib = require("matplotlib", "matplotlib", "plot_gradflow")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.lines import Line2D

    from gradfuse.numerics import histogram as H

    by_step = {r["step"]: r for r in records if "exponents" in r}
    records = [by_step[k] for k in sorted(by_step)]
    steps = np.array([r["step"] for r in records])
    layers = list(dict.fromkeys(name for r in records for name in r["exponents"]))[:max_layers]
    nonfinite_bins = [H.BIN_POS_INF, H.BIN_NEG_INF, H.BIN_NAN]
    grids, bad, lo_bin, hi_bin = [], [], H.BIN_ABOVE, 2
    for name in layers:
        g = np.zeros((H.NUM_BINS, len(records)))
        for j, r in enumerate(records):
            e = r["exponents"].get(name)
            if e:
                g[e["first_bin"]:e["first_bin"] + len(e["counts"]), j] = e["counts"]
        bad.append(g[nonfinite_bins].sum(0) > 0)  # NaN / Inf elements in this layer, per step
        g[[H.BIN_ZERO] + nonfinite_bins, :] = 0
        total = g.sum(0, keepdims=True)
        g = np.divide(g, total, out=np.zeros_like(g), where=total > 0)
        rows = np.nonzero(g.sum(1))[0]
        if rows.size:
            lo_bin, hi_bin = min(lo_bin, rows[0]), max(hi_bin, rows[-1])
        grids.append(g)
    lo_bin, hi_bin = max(min(lo_bin, H.bin_of_exponent(-26)), 2), min(max(hi_bin, lo_bin + 1), H.BIN_ABOVE)
    n = max(len(layers), 1)
    # 4 columns, or 3 when that leaves fewer cells empty (5 layers: 2 x 3, not 2 x 4)
    cols = n if n <= 4 else min((4, 3), key=lambda c: (-(-n // c) * c - n, -c))
    nrows = -(-n // cols)
    spare = nrows * cols > n  # a free cell of the grid holds the colour bar
    fig, axes = plt.subplots(nrows, cols, figsize=(10, 2.4 * nrows + 1.5),
                             squeeze=False, sharex=True, sharey=True, layout="constrained")
    x_edges = _step_edges(steps)
    y_edges = np.arange(lo_bin, hi_bin + 2) - H.EXPONENT_OFFSET - 0.5  # bin e spans e-0.5 .. e+0.5
    y_lo, y_hi = y_edges[0], y_edges[-1]
    norm = LogNorm(vmin=1e-5, vmax=1)
    cmap = _cmap("Greys", 0.12, 1.0)

    # Format limits on the exponent axis: bin e holds 2**e <= |g| < 2**(e+1), so "2**e is the
    # smallest" is the lower edge of bin e, and "M is the largest" the upper edge of M's bin.
    limits = {}  # y -> [(format, kind, colour, label)]
    legend_lines, off_scale = [], []
    for fmt, color, big, normal, sub in FORMAT_LIMITS:
        shown = False
        for kind, value in (("max", big), ("min normal", normal), ("min subnormal", sub)):
            e = math.floor(math.log2(value))
            y = e + 0.5 if kind == "max" else e - 0.5
            if not y_lo <= y <= y_hi:
                continue
            shown = True
            text = f"{value:g}" if kind == "max" else f"$2^{{{e}}}$"
            limits.setdefault(y, []).append((fmt, kind, color, f"{fmt} {kind} {text}"))
            legend_lines.append(Line2D([], [], color=color, ls=LIMIT_STYLES[kind], lw=1.6,
                                       label=f"{fmt} {kind} {text}"))
        if not shown:
            off_scale.append(f"{fmt}: $2^{{{math.floor(math.log2(sub))}}}$ to {big:.3g}")

    im, drawn = None, set()
    for k, ax in enumerate(axes.flat):
        if k >= len(layers):
            ax.axis("off")  # the colour bar's cell
            continue
        g = grids[k][lo_bin:hi_bin + 1]
        im = ax.pcolormesh(x_edges, y_edges, np.ma.masked_less_equal(g, 0), norm=norm, cmap=cmap)
        for y, group in limits.items():
            fmt, kind, color, _ = group[0]
            # a limit two formats share (fp16 and e5m2: smallest normal, largest bin) is drawn
            # once, in both colours
            ax.axhline(y, color=color, ls=LIMIT_STYLES[kind], lw=1.6, gid="format-limit",
                       gapcolor=group[1][2] if len(group) > 1 else None,
                       label=" = ".join(item[3] for item in group))
        for j, r in enumerate(records):
            anomalies = r.get("anomalies") or ()
            kind = ("nan here" if bad[k][j] else "nan elsewhere" if "nonfinite" in anomalies
                    else "explode" if "explode" in anomalies else "skipped" if r.get("skipped") else None)
            if kind:
                drawn.add(kind)
                ax.scatter([r["step"]], [y_hi], marker="v", s=40, clip_on=False, zorder=4,
                           gid="step-mark", **STEP_MARKS[kind][1])
        ax.set_title(layers[k], fontsize=FONT["label"])
        ax.tick_params(labelsize=FONT["tick"])
        if k % cols == 0:
            ax.set_ylabel("floor(log2|g|)", fontsize=FONT["label"])
        if k >= n - cols:
            ax.set_xlabel("step", fontsize=FONT["label"])
            ax.xaxis.set_tick_params(labelbottom=True)
    axes.flat[0].set_ylim(y_lo, y_hi)
    if im is not None:
        if spare:  # in the free cell, across
            cell = axes.flat[-1]
            cax = cell.inset_axes([0.08, 0.72, 0.84, 0.1])
            bar = fig.colorbar(im, cax=cax, orientation="horizontal")
        else:
            bar = fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, pad=0.01)
        bar.set_label("share of the layer's finite,\nnon-zero elements (log)", fontsize=FONT["label"])
        bar.ax.tick_params(labelsize=FONT["tick"])
    # The legend: one column per format (its drawn limits), one for the step marks.
    as_line = {"color": "color", "facecolor": "mfc", "edgecolor": "mec", "linewidths": "mew"}
    marks = [Line2D([], [], ls="", marker="v", ms=7, label=label,
                    **{as_line[key]: value for key, value in style.items()})
             for kind, (label, style) in STEP_MARKS.items() if kind in drawn]
    groups = [g for g in [[h for h in legend_lines if h.get_label().startswith(fmt + " ")]
                          for fmt, *_ in FORMAT_LIMITS] + [marks] if g]
    note = "; ".join(off_scale)
    if note and spare:
        axes.flat[-1].text(0.5, 0.08, note + ":\nlimits off this scale", transform=axes.flat[-1].transAxes,
                           ha="center", va="center", fontsize=FONT["legend"])
    elif note:
        groups.append([Line2D([], [], ls="", label=note + ": off this scale")])
    if groups:
        rows = max(len(g) for g in groups)
        blank = [Line2D([], [], ls="", label=" ")]
        handles = [h for g in groups for h in g + blank * (rows - len(g))]
        fig.legend(handles=handles, loc="outside lower center", ncol=len(groups), fontsize=FONT["legend"],
                   frameon=False, handlelength=2.8, columnspacing=1.5)
    fig.suptitle("gradient exponents per layer over the logged steps (bins of gradfuse.histogram)",
                 fontsize=FONT["title"] + 0.5)
    return fig


def gradflow_figure(records: list[dict], spike_factor: float = 100.0):
    """A matplotlib figure of GradMonitor records: per-layer L2 norm over steps (log colour), the
    total norm with the clip threshold and markers at logged steps that were clipped, skipped,
    non-finite, exploding or AMP overflows (the legend counts every step of the run, from the
    monitor's counters), and per-layer zero fraction (dead units; colour from 0 to the largest
    fraction logged, see ``fraction_panel``).

    The total-norm axis is logarithmic and sized to the ordinary norms: a norm more than
    ``spike_factor`` times the median of the finite norms is off scale, drawn as a triangle on the
    top of the curve's band with its step and value written beside it. Non-finite norms are gaps
    in the curve."""
    matplotlib = require("matplotlib", "matplotlib", "plot_gradflow")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

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
    heat = 0.3 * max(len(layers), 4)  # inches per heatmap
    # A second, narrow column holds the colour bars, so all three panels share one x extent.
    fig, grid_axes = plt.subplots(
        3, 2, figsize=(9, 2 * heat + 4.4), sharex="col", layout="constrained",
        gridspec_kw={"height_ratios": [heat, 2.6, heat], "width_ratios": [45, 1]})
    axes, bars = grid_axes[:, 0], grid_axes[:, 1]
    bars[1].set_visible(False)
    ax = axes[0]
    positive = l2[np.isfinite(l2) & (l2 > 0)]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
    x_edges = _step_edges(steps)
    y_edges = np.arange(len(layers) + 1) - 0.5
    im = ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(np.where(l2 > 0, l2, np.nan)),
                       norm=norm, cmap="viridis")
    ax.set_yticks(range(len(layers)), layers, fontsize=FONT["tick"])
    ax.invert_yaxis()
    ax.set_title("gradient L2 norm per layer (log colour; white: zero or non-finite)", fontsize=FONT["title"])
    fig.colorbar(im, cax=bars[0])
    bars[0].tick_params(labelsize=FONT["tick"])

    ax = axes[1]
    total = np.array([r["total_norm"] if r["total_norm"] is not None else np.nan for r in records], float)
    finite = np.isfinite(total) & (total > 0)
    max_norm = next((r["max_norm"] for r in records if r.get("max_norm") is not None), None)
    thresholds = {r.get("max_norm") for r in records if r.get("max_norm") is not None}
    # The curve's band: the ordinary norms and the threshold; a spike above spike_factor x the
    # median would squash them into a line at the bottom, so it is drawn off scale.
    median = float(np.median(total[finite])) if finite.any() else 1.0
    spike = finite & (total > spike_factor * median)
    band = list(total[finite & ~spike]) or [median]
    band += [t for t in thresholds if t and math.isfinite(t) and t > 0]
    lo, hi = min(band) / 1.6, max(band) * 1.6
    # Above the band: one row per kind of step marker and room for the off-scale label (the
    # band takes the lower 55% of the panel).
    top = hi * (hi / lo) ** (0.45 / 0.55)
    curve = np.where(finite, np.minimum(total, hi), np.nan)
    ax.semilogy(steps, curve, lw=1.2, color="k", label="total norm")
    if spike.any():
        xs = steps[spike]
        ax.scatter(xs, [hi] * len(xs), marker="^", s=60, color="k", zorder=4, clip_on=False,
                   label=f"off scale: > {spike_factor:g}x the median norm")
        for x, v in zip(xs, total[spike]):
            ax.annotate(f"step {x}: {v:.3g}", (x, hi), xytext=(6, -2), textcoords="offset points",
                        ha="left", va="top", fontsize=FONT["legend"])
    if len(thresholds) > 1:  # a schedule or an adaptive threshold (ZClip: inf where it did not clip)
        mn = np.array([r["max_norm"] if r.get("max_norm") is not None else np.nan for r in records], float)
        ax.step(steps, np.where(np.isfinite(mn) & (mn > 0), np.minimum(mn, hi), np.nan), where="post",
                color="tab:orange", ls="--", lw=1.2, label="clip threshold")
    elif max_norm and math.isfinite(max_norm):
        ax.axhline(max_norm, color="tab:orange", ls="--", lw=1.2, label=f"clip threshold {max_norm:g}")
    ax.axhline(hi, color="0.6", lw=0.6)  # the top of the band
    # Markers can only sit on logged steps; the counts come from the monitor's counters, which
    # cover every step (older logs without counters: counted among the logged records).
    counters = records[-1].get("counters")
    marks = [("clipped", "clipped_steps", lambda r: bool(r.get("clipped")), "tab:orange", "v"),
             ("skipped", "skipped_steps", lambda r: bool(r.get("skipped")), "tab:purple", "x"),
             ("non-finite", "nonfinite_steps", lambda r: "nonfinite" in r.get("anomalies", ()), "tab:red", "o"),
             ("exploded", "explode_steps", lambda r: "explode" in r.get("anomalies", ()), "tab:brown", "^"),
             ("AMP overflow", "amp_overflow_steps", lambda r: "amp_overflow" in r.get("anomalies", ()),
              "tab:gray", "s")]
    row = 0
    for label, counter, pred, color, marker in marks:  # one height per kind, above the band
        xs = [r["step"] for r in records if pred(r)]
        total_count = counters.get(counter, 0) if counters else 0
        count = f"{total_count} of {counters['steps']} steps" if counters else f"{len(xs)} logged"
        if xs or total_count:
            row += 1
            y = hi * (top / hi) ** (0.2 * row + 0.08)
            ax.scatter(xs, [y] * len(xs), color=color, marker=marker, s=30,
                       label=f"{label}: {count}", zorder=3)
    ax.set_ylim(lo, top)
    ax.set_xlim(x_edges[0], x_edges[-1])
    ax.set_ylabel("total norm", fontsize=FONT["label"])
    ax.tick_params(labelsize=FONT["tick"])
    ax.set_title("total norm (log; ordinary range below the grey line); markers on logged steps, "
                 "counts over all steps", fontsize=FONT["title"])
    ax.legend(fontsize=FONT["legend"], loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=3,
              frameon=False)
    ax.grid(True, which="major", alpha=0.25)

    ax = axes[2]
    fraction_panel(fig, ax, x_edges, y_edges, zero, "exactly-zero gradients", cax=bars[2])
    ax.set_yticks(range(len(layers)), layers, fontsize=FONT["tick"])
    ax.invert_yaxis()
    top_zero = np.nanmax(zero) if np.isfinite(zero).any() else 0
    ax.set_title("fraction of exactly-zero gradients per layer (dead units)"
                 + (f"; colour 0 to {100 * top_zero:.2g}%" if top_zero > 0 else ""), fontsize=FONT["title"])
    ax.set_xlabel("step", fontsize=FONT["label"])
    ax.tick_params(labelsize=FONT["tick"])
    return fig
