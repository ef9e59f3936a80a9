"""Gradient-flow pictures from a JSONL log written by GradMonitor (matplotlib, optional). The
figures themselves are drawn by ``gradfuse.monitor.figures`` (the sinks draw them too)."""
from __future__ import annotations

import os

from gradfuse.monitor.figures import FONT, exponent_figure, gradflow_figure
from gradfuse.monitor.sinks import read_jsonl
from gradfuse.utils import require


def plot_gradflow(jsonl_path: str | os.PathLike, out_path: str | os.PathLike, dpi: int = 110,
                  batch_size: float | None = None) -> str:
    """Draws the picture of ``gradflow_figure`` from a JSONL log into ``out_path`` (PNG), and
    next to it ``<out>_exponents`` (``exponent_figure``) and ``<out>_noise_scale``
    (``noise_scale_figure``, with ``batch_size``'s line) when the log has their records.
    Returns the path written."""
    records = read_jsonl(jsonl_path)
    if not records:
        raise ValueError(f"gradfuse plot: no records in {jsonl_path}")
    fig = gradflow_figure(records)
    import matplotlib.pyplot as plt
    fig.savefig(out_path, dpi=dpi)
    plt.close(fig)
    if any("exponents" in r for r in records):  # GradMonitor(histogram=True): a second picture
        root, ext = os.path.splitext(os.fspath(out_path))
        fig = exponent_figure(records)
        fig.savefig(f"{root}_exponents{ext or '.png'}", dpi=dpi)
        plt.close(fig)
    if any(r.get("noise_scale") for r in records):  # GradMonitor(noise_scale=...): a second picture
        fig = noise_scale_figure(records, batch_size=batch_size)
        fig.savefig(noise_scale_path(out_path), dpi=dpi)
        plt.close(fig)
    return os.fspath(out_path)


def noise_scale_path(out_path: str | os.PathLike) -> str:
    """Where ``plot_gradflow`` draws the noise-scale curve: ``<out>_noise_scale.png``."""
    root, ext = os.path.splitext(os.fspath(out_path))
    return f"{root}_noise_scale{ext or '.png'}"


def noise_scale_figure(records: list[dict], batch_size: float | None = None):
    """The gradient noise scale B_simple = tr(Sigma) / |G|^2 over the logged steps (log scale),
    against the batch size it is read with: ``batch_size`` (examples per optimizer step, all
    micro-batches and ranks together), else a ``batch_size`` in the records' ``noise_scale``
    entries; drawn as a labelled line when known. Below it, the two EMA estimates |G|^2 and
    tr(Sigma) (see ``gradfuse.dynamics.noise_scale``). Steps without a positive estimate yet
    are not drawn."""
    matplotlib = require("matplotlib", "matplotlib", "plot_gradflow")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by_step = {r["step"]: r for r in records if r.get("noise_scale")}
    steps = np.array(sorted(by_step))
    col = {k: np.array([by_step[t]["noise_scale"][k] for t in steps], float)
           for k in ("noise_scale", "G2", "trSigma")}
    if batch_size is None:
        batch_size = next((by_step[t]["noise_scale"].get("batch_size") for t in reversed(steps)
                           if by_step[t]["noise_scale"].get("batch_size")), None)
    fig, axes = plt.subplots(2, 1, figsize=(9, 5.6), sharex=True, height_ratios=[3, 2])

    def positive(v):
        return np.where(np.isfinite(v) & (v > 0), v, np.nan)

    ax = axes[0]
    b = positive(col["noise_scale"])
    ax.semilogy(steps, b, color="tab:blue", lw=1.8, label="B_simple (EMA)")
    if batch_size:
        ax.axhline(batch_size, color="tab:green", ls="--", lw=1.6, gid="batch-size",
                   label=f"batch size: {batch_size:g} examples per step")
        shown = b[np.isfinite(b)]
        if shown.size:  # both the curve and the batch line in view
            ax.set_ylim(min(shown.min(), batch_size) / 1.6, max(shown.max(), batch_size) * 1.6)
        ax.set_title("gradient noise scale B_simple = tr(Sigma) / |G|^2 against the batch size:\n"
                     "a batch well above B_simple mostly averages noise (diminishing returns per example)",
                     fontsize=FONT["title"])
    else:
        ax.set_title("gradient noise scale B_simple = tr(Sigma) / |G|^2 (EMA): "
                     "batches well above it mostly average noise", fontsize=FONT["title"])
    ax.set_ylabel("examples", fontsize=FONT["label"])
    ax.legend(fontsize=FONT["legend"], loc="lower right")
    ax = axes[1]
    ax.semilogy(steps, positive(col["G2"]), label="|G|^2", color="k", lw=1.2)
    ax.semilogy(steps, positive(col["trSigma"]), label="tr(Sigma)", color="tab:orange", lw=1.2)
    ax.set_ylabel("EMA estimates", fontsize=FONT["label"])
    ax.set_xlabel("step", fontsize=FONT["label"])
    ax.legend(fontsize=FONT["legend"], loc="lower right")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.2)
        ax.tick_params(labelsize=FONT["tick"])
    fig.tight_layout()
    return fig
