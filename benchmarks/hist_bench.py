"""Exponent histogram on the CPU: the fused histogram pass over GPT-2-small-shaped
gradient sets against the machine's read bandwidth on the same bytes (memory_read: a float32 sum,
as benchmarks/methods.py) and the fused statistics pass, every call interleaved with the others
in one process; medians, GB/s of gradient bytes and the ratio to memory_read. Where the CPU has
AVX512BW, AVX512_BITALG and GFNI, the AVX2 kernels count with their AVX-512 loop by default, and
their AVX2 loop is timed as well.

    python benchmarks/hist_bench.py [--rounds 11] [--dtypes float32,bfloat16] [--small]
    python benchmarks/hist_bench.py --distributions [--rounds 7] [--threads 1]

Gradients as in the other benchmarks (workloads.make_grads: uniform in (-1, 1), no zeros, so no
chunk runs pass 2). Target: >= 50% of memory_read. Where the CPU has AVX2, the histogram runs
twice per round: the AVX2 kernel (the default choice, hist_avx2.cpp) and the default-capability
loop (hist_cpu.cpp, the one for CPUs without AVX2), so both are timed in the same run.

--distributions: one 8M-element tensor per value distribution (uniform(-1, 1), randn * 1e-3, a
constant, a mostly-zero embedding-like gradient, randn * 1e-3 with NaN / Inf / subnormals / zeros
sprinkled), both loops interleaved, ms per call (median), one thread by default.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

import gradfuse
from gradfuse import histogram as H
from gradfuse.demo import workloads as wl
from gradfuse.ops import library


def has_avx2() -> bool:
    return library.extension.build_info()["best_cpu_capability"] == "avx2"


def with_setting(get, set_, value, fn):
    """A function that runs fn with an extension setting at `value`, then sets it back as it was."""
    def run():
        before = get()
        set_(value)
        try:
            return fn()
        finally:
            set_(before)
    return run


def with_capability(isa, fn):
    """A function that runs fn under CPU capability `isa` (the histogram's loop follows it)."""
    return with_setting(library.extension.cpu_capability, library.extension.set_cpu_capability, isa, fn)


def has_avx512_loop() -> bool:
    return bool(library.extension.build_info().get("histogram_avx512")) and library.extension.histogram_avx512()


def with_avx2_loop(fn):
    """A function that runs fn with the AVX2 kernels' AVX2 counting loop instead of their AVX-512 one."""
    return with_setting(library.extension.histogram_avx512, library.extension.set_histogram_avx512, False, fn)


def calls(named) -> dict:
    grads = [p.grad for _, p in named]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    wide = has_avx512_loop()
    return nbytes, {
        f"histogram (multi_tensor_exponent_histogram{', AVX-512 loop' if wide else ''})":
            lambda: H.multi_tensor_exponent_histogram(grads),
        **({"histogram, AVX2 loop": with_avx2_loop(lambda: H.multi_tensor_exponent_histogram(grads))}
           if wide else {}),
        **({"histogram, default loop": with_capability(
            "default", lambda: H.multi_tensor_exponent_histogram(grads))} if has_avx2() else {}),
        "stats (multi_tensor_stats)": lambda: gradfuse.ops.multi_tensor_stats(grads, 2.0),
        "memory_read (float32 sum, same bytes)": lambda: src.sum(),
    }


def distributions(dtype, n=8 * 2 ** 20) -> dict:
    g = torch.Generator().manual_seed(0)
    randn = torch.randn(n, generator=g) * 1e-3
    emb = torch.zeros(n // 768, 768)
    rows = torch.randperm(n // 768, generator=g)[: n // 768 // 20]  # 5% of the rows hold values
    emb[rows] = torch.randn(len(rows), 768, generator=g) * 1e-3
    special = randn.clone()
    tiny = torch.finfo(dtype).smallest_normal / 8
    for k, v in enumerate((math.nan, math.inf, -math.inf, tiny, 0.0)):
        special[k::1000] = v
    return {
        "uniform(-1, 1)": (torch.rand(n, generator=g) * 2 - 1).to(dtype),
        "randn * 1e-3": randn.to(dtype),
        "constant 0.5": torch.full((n,), 0.5, dtype=dtype),
        "mostly zero (5% rows)": emb.reshape(-1).to(dtype),
        "NaN/Inf/subnormal/0 every 1000": special.to(dtype),
    }


def run_distributions(args) -> int:
    torch.set_num_threads(args.threads)
    isas = ["default", "avx2"] if has_avx2() else ["default"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, loops {isas}, "
          f"{args.rounds} rounds, ms per call (median), 8M elements")
    print("| dtype | values | " + " | ".join(f"{i} ms" for i in isas) + " | new / old |")
    print("|---|---|" + "---:|" * (len(isas) + 1))
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name, x in distributions(dtype).items():
            fns = {isa: with_capability(isa, lambda x=x: H.multi_tensor_exponent_histogram([x])) for isa in isas}
            results = {isa: fn() for isa, fn in fns.items()}  # warm-up; and the loops agree
            assert all(torch.equal(r, results["default"]) for r in results.values()), (dtype, name)
            times = {isa: [] for isa in isas}
            for _ in range(args.rounds):
                for isa, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    times[isa].append(time.perf_counter() - t)
            med = {isa: statistics.median(v) * 1e3 for isa, v in times.items()}
            ratio = f"{med['avx2'] / med['default']:.2f}x" if "avx2" in med else "-"
            print(f"| {dtype_name} | {name} | " + " | ".join(f"{m:.2f}" for m in med.values()) + f" | {ratio} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--small", action="store_true", help="a tiny GPT-2 shape (smoke run)")
    ap.add_argument("--distributions", action="store_true", help="8M elements per value distribution")
    ap.add_argument("--threads", type=int, default=1, help="with --distributions")
    args = ap.parse_args(argv)
    if args.distributions:
        return run_distributions(args)
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
