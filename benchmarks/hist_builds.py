"""The CPU histogram's two builds against each other (issue 19 diagnostic): the AVX2 pair loop and
the default scalar loop on one uniform(-1, 1) tensor, one thread, both builds and a float32 sum
of the same bytes interleaved in one process; medians of CPU time (time.process_time, less
sensitive than wall time to a shared machine, still not a quiet-machine number).

    PYTHONPATH=. python benchmarks/hist_builds.py [--rounds 15] [--elems 8388608]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from gradfuse import _ext


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--elems", type=int, default=8 * 2 ** 20)
    args = ap.parse_args(argv)
    if _ext._C.build_info()["best_cpu_capability"] != "avx2":
        print("no AVX2 build on this CPU: nothing to compare")
        return 0
    torch.set_num_threads(1)
    op = torch.ops.gradfuse.multi_tensor_exponent_histogram
    before = _ext._C.cpu_capability()
    try:
        for dt in (torch.bfloat16, torch.float32):
            x = (torch.rand(args.elems) * 2 - 1).to(dt)
            src = torch.ones(x.numel() * x.element_size() // 4)
            times = {"default": [], "avx2": [], "memory_read": []}
            for _ in range(args.rounds):
                for name in times:
                    if name != "memory_read":
                        _ext._C.set_cpu_capability(name)
                    t = time.process_time()
                    op([x]) if name != "memory_read" else src.sum()
                    times[name].append(time.process_time() - t)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{dt}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items())
                  + f"; avx2 / default {med['avx2'] / med['default']:.2f}x, "
                  f"histogram avx2 at {100 * med['memory_read'] / med['avx2']:.0f}% of memory_read")
    finally:
        _ext._C.set_cpu_capability(before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
