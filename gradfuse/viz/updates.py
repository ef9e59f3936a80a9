"""Optimizer-update pictures from a JSONL log of ``GradMonitor(update_ratios=...)`` (matplotlib,
optional): per layer and logged step, the RMS of the update the optimizer applied, the
update-to-weight ratio, and, for Adam, the RMS of the bias-corrected root of the second moment
and the fraction of elements whose denominator is mostly ``eps``. ``python -m gradfuse plot``
draws it beside the gradient flow."""
from __future__ import annotations

import os

from gradfuse.monitor.sinks import read_jsonl
from gradfuse.utils import require

# (record key, title, None for a log-coloured magnitude or what a fraction counts)
PANELS = (
    ("update_rms", "RMS of the update per layer (log colour; white: zero or non-finite)", None),
    ("update_ratio", "update-to-weight ratio |u| / |w| per layer (log colour)", None),
    ("moment2_rms", "Adam: RMS of the bias-corrected root sqrt(v) / sqrt(1 - beta2^t) per layer (log colour)", None),
    ("eps_dominated", "Adam: fraction of elements whose root is below eps", "eps-dominated elements"),
)


def has_updates(records: list[dict]) -> bool:
    """Whether any of ``records`` holds optimizer-update statistics."""
    return any(r.get(key) for r in records for key, _, _ in PANELS)


def updates_path(out_path: str | os.PathLike) -> str:
    """Where ``python -m gradfuse plot`` puts the update picture next to ``out_path``."""
    root, ext = os.path.splitext(os.fspath(out_path))
    return f"{root}_updates{ext or '.png'}"


def plot_updates(jsonl_path: str | os.PathLike, out_path: str | os.PathLike, dpi: int = 110) -> str:
    """Draws ``update_figure`` of a JSONL log into ``out_path`` (PNG); returns the path."""
    records = [r for r in read_jsonl(jsonl_path) if has_updates([r])]
    if not records:
        raise ValueError(f"gradfuse plot: no update records in {jsonl_path} "
                         "(GradMonitor(..., update_ratios=optimizer) writes them on logged steps)")
    fig = update_figure(records)
    import matplotlib.pyplot as plt
    fig.savefig(out_path, dpi=dpi)
    plt.close(fig)
    return os.fspath(out_path)


def update_figure(records: list[dict]):
    """One heatmap per statistic the records hold (``PANELS``), layers down, logged steps across,
    sharing the step axis."""
    matplotlib = require("matplotlib", "matplotlib", "plot_updates")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from gradfuse.monitor.figures import FONT, fraction_panel, log_panel, step_edges

    by_step = {r["step"]: r for r in records if has_updates([r])}
    records = [by_step[k] for k in sorted(by_step)]
    panels = [p for p in PANELS if any(r.get(p[0]) for r in records)]
    steps = np.array([r["step"] for r in records], float)
    layers = list(dict.fromkeys(name for r in records for key, _, _ in panels for name in r.get(key) or {}))
    x_edges = step_edges(steps)
    y_edges = np.arange(len(layers) + 1) - 0.5
    height = max(len(layers), 3)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.2 + 0.26 * height * len(panels)), sharex=True,
                             layout="constrained", squeeze=False)
    for ax, (key, title, fraction) in zip(axes[:, 0], panels):
        g = np.full((len(layers), len(records)), np.nan)
        for j, r in enumerate(records):
            for i, name in enumerate(layers):
                value = (r.get(key) or {}).get(name)
                if value is not None:
                    g[i, j] = value
        if fraction is None:
            log_panel(fig, ax, x_edges, y_edges, g)
        else:
            fraction_panel(fig, ax, x_edges, y_edges, g, fraction)
        ax.set_yticks(range(len(layers)), layers, fontsize=FONT["tick"])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=FONT["title"])
        ax.tick_params(labelsize=FONT["tick"])
    axes[-1, 0].set_xlabel("step", fontsize=FONT["label"])
    return fig
