"""Activation pictures from a GradMonitor(activations=True) JSONL log (matplotlib, optional):
per layer and logged step, the RMS of the module outputs and of the gradients with respect to them
(log colour), and the fraction of dead units."""
from __future__ import annotations

import os

from gradfuse.monitor.sinks import read_jsonl
from gradfuse.utils import require


def has_activations(records: list[dict]) -> bool:
    """Whether any of ``records`` holds activation statistics (``act``)."""
    return any(r.get("act") for r in records)


def activations_path(out_path: str | os.PathLike) -> str:
    """Where ``python -m gradfuse plot`` puts the activation picture next to ``out_path``."""
    root, ext = os.path.splitext(os.fspath(out_path))
    return f"{root}_activations{ext or '.png'}"


def plot_activations(jsonl_path: str | os.PathLike, out_path: str | os.PathLike, dpi: int = 110) -> str:
    """Draws ``activation_figure`` of a JSONL log into ``out_path`` (PNG); returns the path."""
    records = [r for r in read_jsonl(jsonl_path) if r.get("act")]
    if not records:
        raise ValueError(f"gradfuse plot: no activation records in {jsonl_path} "
                         "(GradMonitor(..., activations=True) writes them on logged steps)")
    fig = activation_figure(records)
    import matplotlib.pyplot as plt
    fig.savefig(out_path, dpi=dpi)
    plt.close(fig)
    return os.fspath(out_path)


def activation_figure(records: list[dict]):
    """Four panels sharing the step axis: activation RMS per layer, dead-unit fraction per layer,
    output-gradient RMS per layer, and its zero fraction (the fractions coloured from 0 to their
    largest value, or the text "no ... in any logged step" when all are 0: see
    ``gradfuse.monitor.figures.fraction_panel``)."""
    matplotlib = require("matplotlib", "matplotlib", "plot_activations")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from gradfuse.monitor.figures import FONT, fraction_panel, log_panel, step_edges

    by_step = {}
    for r in records:
        if r.get("act"):
            by_step[r["step"]] = r
    records = [by_step[k] for k in sorted(by_step)]
    steps = np.array([r["step"] for r in records], float)
    layers = list(dict.fromkeys(name for r in records for name in r["act"]))
    x_edges = step_edges(steps)
    y_edges = np.arange(len(layers) + 1) - 0.5

    def grid(kind, key):
        g = np.full((len(layers), len(records)), np.nan)
        for j, r in enumerate(records):
            for i, name in enumerate(layers):
                row = r.get(kind, {}).get(name)
                if row is not None and row.get(key) is not None:
                    g[i, j] = row[key]
        return g

    # (records' key, column, title, None for a log-coloured RMS or what a fraction counts)
    panels = [("act", "rms", "activation RMS per layer (log colour; white: zero or non-finite)", None),
              ("act", "dead_fraction", "fraction of dead units per layer (zero for the whole batch)", "dead units"),
              ("act_grad", "rms", "RMS of the gradient w.r.t. the activations (log colour)", None),
              ("act_grad", "zero_fraction", "fraction of exactly-zero activation gradients",
               "exactly-zero activation gradients")]
    height = max(len(layers), 3)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.2 + 0.26 * height * len(panels)), sharex=True,
                             layout="constrained")
    for ax, (kind, key, title, fraction) in zip(axes, panels):
        g = grid(kind, key)
        if fraction is None:
            log_panel(fig, ax, x_edges, y_edges, g)
        else:
            fraction_panel(fig, ax, x_edges, y_edges, g, fraction)
            top = np.nanmax(g) if np.isfinite(g).any() else 0
            title += f"; colour 0 to {100 * top:.2g}%" if top > 0 else ""
        ax.set_yticks(range(len(layers)), layers, fontsize=FONT["tick"])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=FONT["title"])
        ax.tick_params(labelsize=FONT["tick"])
    axes[-1].set_xlabel("step", fontsize=FONT["label"])
    return fig
