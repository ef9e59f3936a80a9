"""Exponent histogram on the CPU (issue 19): the fused histogram pass over GPT-2-small-shaped
gradient sets against the machine's read bandwidth on the same bytes (memory_read: a float32 sum,
as benchmarks/methods.py) and the fused statistics pass, every call interleaved with the others
in one process; medians, GB/s of gradient bytes and the ratio to memory_read.

    python benchmarks/hist_bench.py [--rounds 11] [--dtypes float32,bfloat16] [--small]

Gradients as in the other benchmarks (workloads.make_grads: uniform in (-1, 1), no zeros, so no
chunk runs pass 2). Target: >= 50% of memory_read.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import gradfuse
from gradfuse import histogram as H
from gradfuse import workloads as wl


def calls(named) -> dict:
    grads = [p.grad for _, p in named]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes, {
        "histogram (multi_tensor_exponent_histogram)": lambda: H.multi_tensor_exponent_histogram(grads),
        "stats (multi_tensor_stats)": lambda: gradfuse.ops.multi_tensor_stats(grads, 2.0),
        "memory_read (float32 sum, same bytes)": lambda: src.sum(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--small", action="store_true", help="a tiny GPT-2 shape (smoke run)")
    args = ap.parse_args(argv)
    shapes = wl.gpt2_small(layers=1, d=64, vocab=500, ctx=32) if args.small else wl.gpt2_small()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend {gradfuse.backend('cpu')}")
    for dtype_name in args.dtypes.split(","):
        named = wl.make_grads(shapes, getattr(torch, dtype_name))
        nbytes, fns = calls(named)
        for fn in fns.values():  # warm-up
            fn()
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        med = {name: statistics.median(v) for name, v in times.items()}
        read = med["memory_read (float32 sum, same bytes)"]
        print(f"\ngpt2_small {dtype_name}: {len(named)} tensors, {nbytes / 1e6:.0f} MB, {args.rounds} rounds")
        print("| call | median ms | GB/s | % of memory_read |")
        print("|---|---|---|---|")
        for name, m in med.items():
            print(f"| {name} | {m * 1e3:.1f} | {nbytes / m / 1e9:.2f} | {100 * read / m:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
