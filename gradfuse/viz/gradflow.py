"""Gradient-flow pictures from a JSONL log written by GradMonitor (matplotlib, optional). The
figures themselves are drawn by ``gradfuse.monitor.figures`` (the sinks draw them too)."""
from __future__ import annotations

import os

from gradfuse.monitor.figures import exponent_figure, gradflow_figure  # noqa: F401  (drawn there)
from gradfuse.monitor.sinks import read_jsonl
from gradfuse.utils import require


def plot_gradflow(jsonl_path: str | os.PathLike, out_path: str | os.PathLike, dpi: int = 110) -> str:
    """Draws the picture of ``gradflow_figure`` from a JSONL log into ``out_path`` (PNG).
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
        fig = noise_scale_figure(records)
        fig.savefig(noise_scale_path(out_path), dpi=dpi)
        plt.close(fig)
    return os.fspath(out_path)


def noise_scale_path(out_path: str | os.PathLike) -> str:
    """Where ``plot_gradflow`` draws the noise-scale curve: ``<out>_noise_scale.png``."""
    root, ext = os.path.splitext(os.fspath(out_path))
    return f"{root}_noise_scale{ext or '.png'}"


def noise_scale_figure(records: list[dict]):
    """The gradient noise scale B_simple = tr(Sigma) / |G|^2 over the logged steps (log scale),
    with its two EMA estimates, |G|^2 and tr(Sigma), below (see ``gradfuse.dynamics.noise_scale``)."""
    matplotlib = require("matplotlib", "matplotlib", "plot_gradflow")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by_step = {r["step"]: r for r in records if r.get("noise_scale")}
    steps = np.array(sorted(by_step))
    col = {k: np.array([by_step[t]["noise_scale"][k] for t in steps], float)
           for k in ("noise_scale", "G2", "trSigma")}
    fig, axes = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)

    def positive(v):
        return np.where(np.isfinite(v) & (v > 0), v, np.nan)

    axes[0].semilogy(steps, positive(col["noise_scale"]), color="tab:blue", lw=1.5)
    axes[0].set_ylabel("B_simple (examples)")
    axes[0].set_title("gradient noise scale B_simple = tr(Sigma) / |G|^2 (EMA): "
                      "batches well above it mostly average noise", fontsize=9)
    axes[1].semilogy(steps, positive(col["G2"]), label="|G|^2", color="k", lw=1)
    axes[1].semilogy(steps, positive(col["trSigma"]), label="tr(Sigma)", color="tab:orange", lw=1)
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    return fig
