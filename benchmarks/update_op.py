"""The fused optimizer-update pass against the bytes it must read, interleaved in one run (medians).

For Adam (w, g, m, v: four reads per element), Adam with amsgrad (five) and SGD with momentum
(w, g, buf: three), in float32, bfloat16 and float16, ``multi_tensor_update_stats`` is timed
against ``torch.sum`` of each input tensor (the read floor of the same bytes, tensor by tensor) and
against a copy of the same bytes (read + write), all interleaved, on ``--tensors`` tensors of
``--numel`` elements. GB/s counts the bytes read (the copy's: read + written). Also the update
clip (``multi_tensor_update_clip_``) with every tensor clipped (reads the state, writes w) and with
none (reads one coefficient per tensor).

    python benchmarks/update_op.py [--tensors 10] [--numel 2500000] [--rounds 11] [--smoke]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gradfuse.ops.layout import HYPER_COLUMNS  # noqa: E402

STATS = torch.ops.gradfuse.multi_tensor_update_stats
CLIP = torch.ops.gradfuse.multi_tensor_update_clip_
AMSGRAD, DECOUPLED = 4, 8


def inputs(rule: str, dtype, tensors: int, numel: int):
    g = torch.Generator().manual_seed(0)

    def make(scale=1.0, positive=False):
        draw = torch.rand if positive else torch.randn
        return [(draw(numel, generator=g) * scale).to(dtype) for _ in range(tensors)]

    empty = [torch.empty(0, dtype=dtype)] * tensors
    w, grad = make(), make(0.5)
    if rule.startswith("adam"):
        amsgrad = rule == "adam amsgrad"
        m, v = make(0.1), make(0.01, positive=True)
        v_max = make(0.02, positive=True) if amsgrad else empty
        hyper = dict(lr=1e-3, weight_decay=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=10,
                     flags=DECOUPLED | (AMSGRAD if amsgrad else 0))
        code = 1
    else:
        m, v, v_max = make(0.1), empty, empty
        hyper = dict(lr=0.1, weight_decay=1e-2, beta1=0.9, beta2=0.0, eps=0.0, step=1, flags=0)
        code = 0
    table = torch.tensor([[float(hyper[c]) for c in HYPER_COLUMNS]] * tensors, dtype=torch.float64)
    return (w, grad, m, v, v_max, table, code)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(rule: str, dtype, args) -> str:
    """One row of the table: the medians of the interleaved runs."""
    op_args = inputs(rule, dtype, args.tensors, args.numel)
    read = [t for lst in op_args[:5] for t in lst if t.numel()]
    nbytes = sum(t.numel() * t.element_size() for t in read)
    dst = [torch.empty_like(t) for t in read]
    n = len(op_args[0])
    clip_all = torch.full((n,), 0.5, dtype=torch.float64)
    clip_none = torch.ones(n, dtype=torch.float64)
    clip_args = [[t.clone() for t in op_args[0]], *op_args[1:6]]
    runs = {"stats": lambda: STATS(*op_args), "sum": lambda: [t.sum() for t in read],
            "copy": lambda: [d.copy_(s) for d, s in zip(dst, read)],
            "clip all": lambda: CLIP(*clip_args, clip_all, op_args[6]),
            "clip none": lambda: CLIP(*clip_args, clip_none, op_args[6])}
    times = {k: [] for k in runs}
    for fn in runs.values():  # warm-up
        fn()
    for r in range(args.rounds):
        for k in list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]:  # rotate the order
            times[k].append(timed(runs[k]))
    med = {k: statistics.median(v) for k, v in times.items()}
    return (f"| {rule} | {str(dtype).removeprefix('torch.')} | {nbytes / 1e6:.0f} | {1e3 * med['stats']:.1f} "
            f"| {nbytes / med['stats'] / 1e9:.1f} | {1e3 * med['sum']:.1f} | {nbytes / med['sum'] / 1e9:.1f} "
            f"| {med['sum'] / med['stats']:.0%} | {2 * nbytes / med['copy'] / 1e9:.1f} "
            f"| {1e3 * med['clip all']:.1f} | {1e3 * med['clip none']:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=10)
    ap.add_argument("--numel", type=int, default=2_500_000)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 round (not a timing)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tensors, args.numel, args.rounds = 3, 1000, 1
    print(f"{args.tensors} tensors of {args.numel} elements, {args.rounds} interleaved rounds, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| rule | dtype | read (MB) | update stats (ms) | GB/s | torch.sum of the inputs (ms) | GB/s "
          "| stats / read floor | copy GB/s | clip, all (ms) | clip, none (ms) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rule in ("adam", "adam amsgrad", "sgd momentum"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            print(measure(rule, dtype, args), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
