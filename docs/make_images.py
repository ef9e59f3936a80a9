"""Regenerates the README's pictures (needs matplotlib).

Run:

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
  re-running it rewrites that file, then this script redraws the chart from it), drawn by
  benchmarks/summarize.py's ``chart``. When RESULTS.md has no such section, docs/benchmarks.png is
  left as it is (the script says so).

The pictures are 9-10 inches wide at 100 dpi (900-1000 px): the README and the docs show them
~800 px wide, where their 9-point text is ~10 px.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile

DPI = 100
DEMO_BATCH = 64  # examples per step of the demo (gradfuse/demo/demo.py: 2 micro-batches of 32)
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

    from gradfuse.demo.demo import run
    from gradfuse.sinks import read_jsonl
    from gradfuse.viz.gradflow import exponent_figure, noise_scale_figure, plot_gradflow
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()):
            result = run(steps=200, out_dir=tmp, timing=False)
        # (plot_gradflow also writes <tmp>/gradflow_exponents.png and _noise_scale.png, unused)
        plot_gradflow(result["log"], os.path.join(tmp, "gradflow.png"), dpi=DPI, batch_size=DEMO_BATCH)
        os.replace(os.path.join(tmp, "gradflow.png"), gradflow_path)
        records = read_jsonl(result["log"])
    def noise_scale(records):
        return noise_scale_figure(records, batch_size=DEMO_BATCH)
    for figure, path, what in ((exponent_figure, exponents_path, "exponents"),
                               (noise_scale, noise_scale_path, "noise_scale")):
        if not any(r.get(what) for r in records):
            raise RuntimeError(f"the demo run logged no {what!r} records: cannot draw {path}")
        fig = figure(records)
        fig.savefig(path, dpi=DPI)
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


def benchmarks(path: str, dtype: str = "float32") -> bool:
    """Draws docs/benchmarks.png from RESULTS.md's section ": whole benchmark on main" with
    benchmarks/summarize.py's ``chart``; False (the picture left as it is) when RESULTS.md has
    no such section or none of its tables."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import summarize
    finally:
        sys.path.pop(0)
    try:
        tables = results_tables(os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    except ValueError:  # str.index: no heading holds the words
        return False
    workloads = ["gpt2_small", "llama_1b", "resnet50", "many_small", "few_large"]
    rows = {key: {m: {"median_s": ms / 1e3} for m, ms in methods.items()}
            for key, methods in tables.items() if key[1] == dtype and key[0] in workloads
            and "torch_clip_foreach" in methods}
    if not rows:
        return False
    summarize.chart({"rows": rows}, path, methods=[m for m, _ in METHODS], labels=dict(METHODS),
                    workloads=workloads, dtype=dtype, dpi=DPI,
                    title=f"CPU, 2 cores, {dtype} gradients: median time relative to torch "
                          "(benchmarks/RESULTS.md)")
    return True


def main() -> int:
    sys.path.insert(0, ROOT)
    if not benchmarks(os.path.join(DOCS, "benchmarks.png")):
        print("benchmarks/RESULTS.md has no float32 tables under a heading with "
              "': whole benchmark on main': docs/benchmarks.png left as it is")
    demo_pictures(*(os.path.join(DOCS, name) for name in ("gradflow.png", "exponents.png", "noise_scale.png")))
    for name in ("gradflow.png", "benchmarks.png", "exponents.png", "noise_scale.png"):
        print(os.path.join("docs", name), os.path.getsize(os.path.join(DOCS, name)), "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
