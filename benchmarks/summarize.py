"""Turns a pytest-benchmark JSON into the markdown tables of benchmarks/RESULTS.md and a bar chart.

    python benchmarks/summarize.py bench.json [-o table.md] [--png chart.png]
    python benchmarks/summarize.py bench.json --results benchmarks/RESULTS.md \
        --command "the command that made bench.json" [--extra before_after.md] [--png chart.png]

``--results`` writes the whole page: machine, date, commit and command of the run, a summary
table, then every workload's table, then any ``--extra`` markdown (e.g. a before / after
comparison from compare_trees.py, with its own command).

Per workload and dtype: median time of each method, its ratio to clip_grad_norm_(foreach=True)
and to the hook/loop approach, and achieved GB/s (the bytes the method must move, see
methods.py, over its median) next to the read and copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

ORDER = ["gradfuse_stats", "gradfuse_clip_noclip", "gradfuse_clip_clipping", "gradfuse_clip_grad_norm_",
         "gradfuse_watch_stats", "gradfuse_watch_clip", "gradfuse_monitor_step", "stats_op", "moments_op",
         "torch_clip_foreach", "torch_clip_loop", "torch_foreach_stats", "hook_loop",
         "memory_read", "memory_copy"]


def load(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    rows = defaultdict(dict)  # (workload, dtype) -> method -> info
    for b in data["benchmarks"]:
        e = b["extra_info"]
        rows[(e["workload"], e["dtype"])][e["method"]] = {
            "median_s": b["stats"]["median"], "bytes": e["bytes"], "grad_bytes": e["grad_bytes"],
            "tensors": e.get("tensors"), "rounds": b["stats"]["rounds"]}
    return {"machine": data.get("machine_info", {}), "datetime": data.get("datetime"), "rows": rows,
            "commit": data.get("commit_info", {})}


def _gbs(m: dict) -> float:
    return m["bytes"] / m["median_s"] / 1e9


def summary(result: dict) -> str:
    """One line per workload and dtype: gradfuse's statistics and drop-in clip against torch's
    clip_grad_norm_ and the hook loop, and the share of the read bandwidth they reach."""
    out = ["| workload | dtype | stats, ms | stats vs clip_grad_norm_(foreach) | stats vs hook loop | "
           "stats GB/s (% of read) | clip_grad_norm_ drop-in vs torch's |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for (workload, dtype), methods in sorted(result["rows"].items()):
        st, base = methods.get("gradfuse_stats"), methods.get("torch_clip_foreach")
        hook, read = methods.get("hook_loop"), methods.get("memory_read")
        drop = methods.get("gradfuse_clip_grad_norm_")
        if not st:
            continue
        cells = [f"{1e3 * st['median_s']:.3f}",
                 f"{st['median_s'] / base['median_s']:.2f}x" if base else "-",
                 f"{hook['median_s'] / st['median_s']:.1f}x faster" if hook else "-",
                 f"{_gbs(st):.1f} ({100 * _gbs(st) / _gbs(read):.0f}%)" if read else f"{_gbs(st):.1f}",
                 f"{drop['median_s'] / base['median_s']:.2f}x" if drop and base else "-"]
        out.append(f"| {workload} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def page(result: dict, command: str, extras: list[str], chart_path: str | None) -> str:
    m, c = result["machine"], result["commit"]
    cpu = m.get("cpu", {})
    machine = ", ".join(x for x in (cpu.get("brand_raw"), f"{cpu['count']} logical cores" if cpu.get("count") else None,
                                    m.get("system"), m.get("release"),
                                    f"Python {m['python_version']}" if m.get("python_version") else None) if x)
    commit = (f"{c.get('id', '?')[:12]}" + (" (with uncommitted changes)" if c.get("dirty") else "")) if c else "?"
    lines = ["# Measured results", "",
             "Today's figures, generated from one run of the benchmark suite by "
             "`benchmarks/summarize.py --results` (earlier figures are in this file's git history). "
             "Timings on shared machines are noisy: read the ratios within this run, not absolute "
             "times across runs.", "",
             f"- machine: {machine or '?'}",
             f"- date: {result['datetime'] or '?'}",
             f"- commit: {commit}",
             f"- command: `{command}`",
             "- medians of each method's rounds; GB/s = the bytes the method must move "
             "(benchmarks/README.md) over its median; `memory_read` and `memory_copy` are the "
             "machine's bandwidth in the same run", ""]
    if chart_path:
        lines += [f"![median time relative to torch's clip_grad_norm_]({chart_path})", ""]
    lines += ["## At a glance", "", summary(result), "## Every method, per workload", "", table(result)]
    for extra in extras:
        lines += ["", extra.rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def table(result: dict) -> str:
    out = []
    for (workload, dtype), methods in sorted(result["rows"].items()):
        base = methods.get("torch_clip_foreach", {}).get("median_s")
        hook = methods.get("hook_loop", {}).get("median_s")
        read = methods.get("memory_read")
        read_gbs = read["bytes"] / read["median_s"] / 1e9 if read else None
        any_m = next(iter(methods.values()))
        tensors = next((m["tensors"] for m in methods.values() if m.get("tensors")), "?")
        out.append(f"\n**{workload}, {dtype}** ({tensors} tensors, "
                   f"{any_m['grad_bytes'] / 1e6:,.0f} MB of gradients)\n")
        out.append("| method | median ms | vs clip_grad_norm_(foreach) | vs hook/loop | GB/s | % of read GB/s |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for name in ORDER + sorted(set(methods) - set(ORDER)):
            m = methods.get(name)
            if not m:
                continue
            gbs = m["bytes"] / m["median_s"] / 1e9
            ratio = f"{m['median_s'] / base:.2f}x" if base else "-"
            vs_hook = f"{hook / m['median_s']:.1f}x faster" if hook and name != "hook_loop" else "-"
            pct = f"{100 * gbs / read_gbs:.0f}%" if read_gbs and not name.startswith("memory") else "-"
            out.append(f"| {name} | {1e3 * m['median_s']:.3f} | {ratio} | {vs_hook} | {gbs:.1f} | {pct} |")
    return "\n".join(out).lstrip("\n") + "\n"


def ratio_limits(values, pad: float = 1.5) -> tuple[float, float]:
    """Limits of a log axis of time ratios: every finite positive value and 1 (torch) inside,
    with a margin on either side (``pad``, and room for the labels at the bars' ends)."""
    import math
    v = [x for x in values if x is not None and math.isfinite(x) and x > 0] + [1.0]
    return min(v) / (pad * 1.6), max(v) * pad * 1.6


def chart(result: dict, path: str, methods: list[str] | None = None, labels: dict | None = None,
          workloads: list[str] | None = None, dtype: str | None = None, title: str | None = None,
          dpi: int = 110) -> None:
    """A horizontal bar chart of each method's median time over clip_grad_norm_(foreach=True)'s,
    per workload and dtype (``workloads`` / ``dtype`` select, ``methods`` picks and orders the
    bars, ``labels`` names them). The axis is logarithmic, its limits from the data
    (``ratio_limits``); each bar runs from 1 (torch) to its ratio, with the ratio written at its
    end: bars to the left of the line are faster than torch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    groups = [g for g in sorted(result["rows"]) if (dtype is None or g[1] == dtype)
              and (workloads is None or g[0] in workloads)]
    if workloads is not None:
        groups.sort(key=lambda g: workloads.index(g[0]))
    groups = [g for g in groups if "torch_clip_foreach" in result["rows"][g]]  # the baseline
    names = [n for n in (methods or ORDER) if not n.startswith("memory") and n != "torch_clip_foreach"
             and any(n in result["rows"][g] for g in groups)]
    labels = labels or {}
    ratios = np.full((len(groups), len(names)), np.nan)
    for i, g in enumerate(groups):
        base = result["rows"][g].get("torch_clip_foreach")
        for j, name in enumerate(names):
            m = result["rows"][g].get(name)
            if m and base:
                ratios[i, j] = m["median_s"] / base["median_s"]
    height = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(9, 1.3 + 0.19 * len(groups) * len(names) + 0.15 * len(groups)),
                           layout="constrained")
    for j, name in enumerate(names):
        y = np.arange(len(groups)) + j * height
        r = ratios[:, j]
        ok = np.isfinite(r) & (r > 0)
        ax.barh(y[ok], r[ok] - 1, height * 0.92, left=1, label=labels.get(name, name), color=f"C{j}")
        for yy, rr in zip(y[ok], r[ok]):
            ax.text(rr * (1.06 if rr >= 1 else 1 / 1.06), yy, f"{rr:.2g}x", va="center",
                    ha="left" if rr >= 1 else "right", fontsize=8)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xscale("log")
    ax.set_xlim(*ratio_limits(ratios.ravel()))
    ax.xaxis.set_major_locator(LogLocator(base=10))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    show_dtype = dtype is None and len({d for _, d in groups}) > 1
    ax.set_yticks(np.arange(len(groups)) + 0.4 - height / 2,
                  [f"{w}\n{d}" if show_dtype else w for w, d in groups], fontsize=10)
    ax.invert_yaxis()
    ax.tick_params(axis="x", labelsize=9)
    ax.grid(True, axis="x", which="major", alpha=0.3)
    ax.set_xlabel("median time / torch clip_grad_norm_(foreach=True)   (left of 1: faster than torch)",
                  fontsize=10)
    ax.set_title(title or "gradfuse benchmarks: median time relative to torch.nn.utils.clip_grad_norm_",
                 fontsize=10.5)
    fig.legend(fontsize=9, loc="outside lower center", ncol=min(3, max(len(names), 1)), frameon=False)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("-o", "--output", help="write the markdown table here (default: stdout)")
    ap.add_argument("--png", help="also draw a bar chart (needs matplotlib)")
    ap.add_argument("--results", help="write the whole RESULTS.md page here")
    ap.add_argument("--command", default="?", help="the command that made the JSON (for --results)")
    ap.add_argument("--extra", action="append", default=[], help="a markdown file appended to --results")
    args = ap.parse_args(argv)
    result = load(args.json)
    if args.png:
        chart(result, args.png)
    if args.results:
        import os
        chart_rel = os.path.relpath(args.png, os.path.dirname(os.path.abspath(args.results))) if args.png else None
        extras = [open(path).read() for path in args.extra]
        with open(args.results, "w") as f:
            f.write(page(result, args.command, extras, chart_rel))
        return 0
    md = table(result)
    if args.output:
        with open(args.output, "w") as f:
            f.write(md)
    else:
        sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
