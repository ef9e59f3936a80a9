"""Regenerates the README's pictures (needs matplotlib):

    .venv/bin/python docs/make_images.py

- docs/gradflow.png: the demo's gradient-flow picture (`python -m gradfuse demo`, 200 steps,
  the same seed: a planted spike at step 66 and a NaN at step 133).
- docs/exponents.png and docs/noise_scale.png: the same demo run's per-layer exponent heatmap
  (`histogram=True` on its logging steps) and gradient noise scale (`noise_scale=`, from its two
  accumulated micro-batches per step), what the demo writes as runs/demo/gradflow_exponents.png
  and runs/demo/gradflow_noise_scale.png.
- docs/benchmarks.png: median time relative to torch.nn.utils.clip_grad_norm_(foreach=True) on
  CPU, float32, from the section "whole benchmark on main" of benchmarks/RESULTS.md, measured on
  2026-12-03 (its command is there;
  re-running it rewrites that file, then this script redraws the chart from it).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
METHODS = [("gradfuse_stats", "gradfuse.stats (all statistics)"),
           ("gradfuse_clip_noclip", "gradfuse.clip_ (no clip needed)"),
           ("gradfuse_clip_clipping", "gradfuse.clip_ (clipping)"),
           ("torch_foreach_stats", "same statistics in plain torch"),
           ("hook_loop", "hooks + per-parameter .item()")]


def demo_pictures(gradflow_path: str, exponents_path: str, noise_scale_path: str) -> None:
    """One demo run; its log drawn as the gradient-flow picture, the exponent heatmap and the
    noise-scale curve."""
    import matplotlib.pyplot as plt

    from gradfuse.demo import run
    from gradfuse.plot import exponent_figure, noise_scale_figure, plot_gradflow
    from gradfuse.sinks import read_jsonl
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()):
            result = run(steps=200, out_dir=tmp, timing=False)
        # (plot_gradflow also writes <tmp>/gradflow_exponents.png and _noise_scale.png, unused)
        plot_gradflow(result["log"], os.path.join(tmp, "gradflow.png"), dpi=72)
        os.replace(os.path.join(tmp, "gradflow.png"), gradflow_path)
        records = read_jsonl(result["log"])
    for figure, path, what in ((exponent_figure, exponents_path, "exponents"),
                               (noise_scale_figure, noise_scale_path, "noise_scale")):
        if not any(r.get(what) for r in records):
            raise RuntimeError(f"the demo run logged no {what!r} records: cannot draw {path}")
        fig = figure(records)
        fig.savefig(path, dpi=72)
        plt.close(fig)


def results_tables(md_path: str, section: str = ": whole benchmark on main") -> dict:
    """{(workload, dtype): {method: median_ms}} from the tables of one section of RESULTS.md
    (from the first heading holding ``section`` up to its next heading)."""
    text = open(md_path, encoding="utf-8").read()
    start = text.index(section)   # the one section whose heading holds these words
    end = min([i for i in (text.find("\n## ", start + 1), text.find("\n### ", start + 1)) if i > 0]
              or [len(text)])
    rows, key = {}, None
    for line in text[start:end].splitlines():
        m = re.match(r"\*\*(\w+), (\w+)\*\*", line)
        if m:
            key = (m.group(1), m.group(2))
            rows[key] = {}
        elif key and line.startswith("| ") and not line.startswith("| method"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            with contextlib.suppress(ValueError):
                rows[key][cells[0]] = float(cells[1])
    return rows


def benchmarks(path: str, dtype: str = "float32") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = {w: m for (w, d), m in results_tables(os.path.join(ROOT, "benchmarks", "RESULTS.md")).items()
            if d == dtype}
    workloads = ["gpt2_small", "llama_1b", "resnet50", "many_small", "few_large"]
    workloads = [w for w in workloads if w in rows]
    fig, ax = plt.subplots(figsize=(9, 3.4))
    height = 0.8 / len(METHODS)
    for i, (method, label) in enumerate(METHODS):
        ratios = [rows[w][method] / rows[w]["torch_clip_foreach"] for w in workloads]
        ax.barh(np.arange(len(workloads)) + i * height, ratios, height, label=label)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(np.arange(len(workloads)) + 0.4 - height / 2, workloads, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median time / torch clip_grad_norm_(foreach=True)   (1 = torch; lower is faster)", fontsize=8)
    ax.set_title(f"CPU, 2 cores, {dtype} gradients (benchmarks/RESULTS.md)", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> int:
    sys.path.insert(0, ROOT)
    benchmarks(os.path.join(DOCS, "benchmarks.png"))
    demo_pictures(*(os.path.join(DOCS, name) for name in ("gradflow.png", "exponents.png", "noise_scale.png")))
    for name in ("gradflow.png", "benchmarks.png", "exponents.png", "noise_scale.png"):
        print(os.path.join("docs", name), os.path.getsize(os.path.join(DOCS, name)), "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
