"""Before / after on one machine: the benchmark suite of two checkouts (each with its own
gradfuse._C built in place) run alternately, several rounds, so that both see the same load.

    python benchmarks/compare_trees.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 3] [--out DIR] \
        -- --bench-workloads gpt2_small,tiny --bench-dtypes float32

Everything after ``--`` goes to pytest (the suite's options, see benchmarks/README.md). Prints,
per workload, dtype and method, the median over rounds of each checkout's median, and new / old;
the JSON of every run is kept in DIR. A ratio within the spread of the rounds is noise.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def run(checkout: Path, out: Path, pytest_args: list[str]) -> dict:
    subprocess.run([sys.executable, "-m", "pytest", "benchmarks", "--benchmark-only", "-q",
                    "-p", "no:cacheprovider", f"--benchmark-json={out}", *pytest_args],
                   cwd=checkout, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    return {(b["extra_info"]["workload"], b["extra_info"]["dtype"], b["extra_info"]["method"]):
            b["stats"]["median"] for b in data["benchmarks"]}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("build/compare_trees"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    medians: dict[str, dict[tuple, list[float]]] = {"old": {}, "new": {}}
    for r in range(args.rounds):
        for label, checkout in (("old", args.old), ("new", args.new)) if r % 2 == 0 else \
                (("new", args.new), ("old", args.old)):
            result = run(checkout.resolve(), (args.out / f"{label}_{r}.json").resolve(), pytest_args)
            for key, median in result.items():
                medians[label].setdefault(key, []).append(median)
            print(f"round {r + 1}/{args.rounds}: {label} done", file=sys.stderr)
    print("| workload | dtype | method | old ms | new ms | new / old | spread of old rounds |")
    print("|---|---|---|---:|---:|---:|---:|")
    for key in sorted(set(medians["old"]) & set(medians["new"])):
        old, new = medians["old"][key], medians["new"][key]
        o, n = statistics.median(old), statistics.median(new)
        spread = (max(old) - min(old)) / o if o else 0.0
        print(f"| {key[0]} | {key[1]} | {key[2]} | {1e3 * o:.3f} | {1e3 * n:.3f} | {n / o:.3f} | "
              f"{100 * spread:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
