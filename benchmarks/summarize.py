"""Turns a pytest-benchmark JSON into the markdown table of benchmarks/RESULTS.md and a bar chart.

    python benchmarks/summarize.py bench.json [-o table.md] [--png chart.png]

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
         "gradfuse_watch_stats", "gradfuse_watch_clip", "gradfuse_monitor_step",
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
    return {"machine": data.get("machine_info", {}), "datetime": data.get("datetime"), "rows": rows}


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


def chart(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = sorted(result["rows"])
    names = [n for n in ORDER if not n.startswith("memory") and n != "torch_clip_foreach"
             and any(n in result["rows"][g] for g in groups)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        vals = []
        for g in groups:
            m, base = result["rows"][g].get(name), result["rows"][g].get("torch_clip_foreach")
            vals.append(m["median_s"] / base["median_s"] if m and base else np.nan)
        ax.bar(np.arange(len(groups)) + i * width, vals, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, [f"{w}\n{d}" for w, d in groups], fontsize=8)
    ax.set_ylabel("time / clip_grad_norm_(foreach=True)  (lower is better)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("gradfuse benchmarks: median time relative to torch.nn.utils.clip_grad_norm_")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("-o", "--output", help="write the markdown table here (default: stdout)")
    ap.add_argument("--png", help="also draw a bar chart (needs matplotlib)")
    args = ap.parse_args(argv)
    result = load(args.json)
    md = table(result)
    if args.output:
        with open(args.output, "w") as f:
            f.write(md)
    else:
        sys.stdout.write(md)
    if args.png:
        chart(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
