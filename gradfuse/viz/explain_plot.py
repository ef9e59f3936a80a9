"""The picture of a flight-recorder dump: the traces around its trigger with their bands, as
:func:`gradfuse.viz.explain.dump_figure` and :func:`~gradfuse.viz.explain.plot_dump` draw them.

Layer: viz. Imports ``gradfuse.monitor``, ``gradfuse.utils`` and ``gradfuse.viz.bands``; matplotlib on
first use.
"""
from __future__ import annotations

import math

from gradfuse.monitor.flight_dump import FlightDump
from gradfuse.utils import require
from gradfuse.viz.bands import STD_FLOOR, Series, band_traces, when_text

__all__ = ["PANELS", "figure", "pyplot"]

# (quantity, title, per-layer field or None for the total)
PANELS = [("loss", "loss", None), ("grad_norm", "total gradient norm", None),
          ("update_norm", "total update norm", None), ("grad_norm", "gradient L2 per layer", "grad_l2"),
          ("update_norm", "update RMS per layer", "update_rms"), ("act_rms", "activation RMS per layer", "act_rms")]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (an error that says how to install matplotlib without it)."""
    matplotlib = require("matplotlib", "matplotlib", "plot_dump")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def figure(plt, dump: FlightDump, diagnosis, window: int | None = None, *, min_history: int = 5):
    """The figure of a checked dump and its diagnosis (a :class:`~gradfuse.viz.explain.Diagnosis`).

    Args:
        plt: ``matplotlib.pyplot``, as :func:`pyplot` returns it.
        dump: The dump.
        diagnosis: Its diagnosis (which layers are named, the trigger's kind, the first event).
        window: Recorded steps before the trigger to draw (default: all of them).
        min_history: Values a band needs, as for the diagnosis.

    Returns:
        A matplotlib ``Figure``.
    """
    from gradfuse.monitor.figures import FONT

    series = Series(dump)
    traces = band_traces(series, min_history)
    events = {e.quantity: e for e in diagnosis.events}
    n = series.n
    lo = 0 if window is None else max(0, series.upto - 1 - window)
    hi = n
    panels = []
    for q, title, field_name in PANELS:
        if q not in traces:
            continue
        total, layers = traces[q]
        if field_name is None and total is not None:
            panels.append((q, title, {None: total}))
        elif field_name is not None and layers:
            panels.append((q, title, layers))
    rows = max(len(panels), 1)
    fig, axes = plt.subplots(rows, 1, figsize=(9, 1.0 + 2.1 * rows), sharex=True, squeeze=False,
                             layout="constrained")
    axes = axes[:, 0]
    colours = plt.get_cmap("tab10").colors
    steps_all = series.steps
    for ax, (q, title, lines) in zip(axes, panels):
        event = events.get(q)
        named = [d.layer for d in event.layers] if event else []
        finite, bands = [], []
        for key, (values, trace) in lines.items():
            xs = steps_all[lo:hi]
            ys = values[lo:hi]
            if key is None:
                style = {"color": "k", "lw": 1.5, "label": q}
                band_of = True
            elif key in named[:len(colours)]:
                style = {"color": colours[named.index(key)], "lw": 1.6, "label": key, "zorder": 3}
                band_of = key == named[0]
            else:
                style = {"color": "0.7", "lw": 0.8, "zorder": 1}
                band_of = False
            shown = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]  # sparse series stay joined
            ax.plot([x for x, _ in shown], [y for _, y in shown], marker=".", ms=3, **style)
            finite += [y for _, y in shown]
            if band_of:
                bx, blo, bhi = [], [], []
                for i in range(lo, n):
                    m, s = trace.mean[i], trace.std[i]
                    if math.isfinite(m) and math.isfinite(s):
                        half = series.sigma * max(s, STD_FLOOR * abs(m))
                        bx.append(steps_all[i])
                        blo.append(m - half)
                        bhi.append(m + half)
                if bx:  # drawn once the scale is known (on a log scale its lower edge is cut)
                    bands.append((bx, blo, bhi, style["color"], f"band of {key or q}: mean ± {series.sigma:g} std"))
            outs = [i for i in range(lo, n) if trace.out[i] and math.isfinite(values[i])]
            if outs and (key is None or key in named):
                ax.scatter([steps_all[i] for i in outs], [values[i] for i in outs], s=28,
                           facecolor="none", edgecolor=style["color"], lw=1.3, zorder=4)
            bad = [steps_all[i] for i in range(lo, n) if trace.out[i] and not math.isfinite(values[i])]
            if bad:
                ax.scatter(bad, [1.0] * len(bad), transform=ax.get_xaxis_transform(), marker="v", s=40,
                           color="tab:red", clip_on=False, zorder=5,
                           label="non-finite" if key is None or key == (named[:1] or [None])[0] else None)
        log = finite and min(finite) > 0 and max(finite) > 10 * min(finite)  # log scale for a jump of 10x or more
        if log:
            ax.set_yscale("log")
        for bx, blo, bhi, colour, label in bands:
            if log:
                blo = [max(v, min(finite) / 2) for v in blo]
            ax.fill_between(bx, blo, bhi, color=colour, alpha=0.15, lw=0, label=label)
        ax.axvline(series.trigger, color="tab:red", ls="--", lw=1.2,
                   label=f"trigger: step {series.trigger} ({diagnosis.kind})" if ax is axes[0] else None)
        if event is not None:
            title += f": left its band {when_text(event.steps_before)} (step {event.step})"
        ax.set_title(title, fontsize=FONT["title"], loc="left")
        others = len(lines) - len([k for k in lines if k in named[:len(colours)]])
        if None not in lines and others:
            label = f"other layers ({others})" if named else f"layers ({others}), all within their bands"
            ax.plot([], [], color="0.7", lw=0.8, label=label)
        ax.legend(fontsize=FONT["legend"], loc="best", ncols=2)
        ax.grid(True, which="both", alpha=0.2)
        ax.tick_params(labelsize=FONT["tick"])
    if not panels:
        axes[0].text(0.5, 0.5, "no quantity recorded in this dump", ha="center", va="center",
                     transform=axes[0].transAxes, fontsize=FONT["label"])
    axes[-1].set_xlabel("step", fontsize=FONT["label"])
    first = diagnosis.first()
    head = f"flight recorder, step {diagnosis.step}: {diagnosis.kind}"
    if first is not None:
        head += f"; {first.quantity} left its band first, {when_text(first.steps_before)}"
    fig.suptitle(head, fontsize=FONT["title"] + 1)
    return fig
