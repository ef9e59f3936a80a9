"""The optimizer step alone: gradfuse.optim.AdamW against torch's AdamW in its default CPU form
(the for-loop), its foreach form and fused=True, on the parameter shapes of GPT-2 small, interleaved
in one run (medians), with a copy of the same bytes as the machine's floor.

An AdamW step must read weight, gradient and both moments (4 arrays) and write weight and both
moments (3): 7 x numel x element size bytes. GB/s below counts those bytes for every variant (what
a variant moves beyond them, temporaries and extra passes, shows as a lower rate); the copy reads
and writes the same number of bytes (3.5 arrays read, 3.5 written).

    python benchmarks/optim_step.py [--dtypes float32,bfloat16] [--layers 12] [--rounds 7] [--smoke]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gradfuse.optim  # noqa: E402
from gradfuse.ops import library  # noqa: E402


def gpt2_shapes(layers: int, vocab: int = 50257, d: int = 768, ctx: int = 1024) -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (nanoGPT's layout, tied embeddings), ``layers`` blocks."""
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d)] + block * layers + [(d,), (d,)]


def make_params(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
    return params


class CorrectlyRoundedRoot:
    """gradfuse.optim.AdamW with a correctly rounded square root (the CUDA kernels' and torch's
    fused=True's) in place of torch's CPU one (MKL's, which the exact step must call for float32):
    what matching torch's default costs. Not bit for bit torch's default step."""

    def __init__(self, params):
        self.opt = gradfuse.optim.AdamW(params, lr=1e-3, weight_decay=0.1)

    def step(self):
        library.extension.set_step_torch_sqrt(False)
        try:
            self.opt.step()
        finally:
            library.extension.set_step_torch_sqrt(True)


VARIANTS = {
    "torch (for-loop, the CPU default)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=False),
    "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True),
    "torch fused=True": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
    "gradfuse.optim.AdamW": lambda ps: gradfuse.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "gradfuse.optim.AdamW, correctly rounded root": CorrectlyRoundedRoot,
}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(dtype, args) -> list[str]:
    shapes = gpt2_shapes(args.layers) if not args.smoke else [(33, 7), (5,), (70, 3)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    esize = torch.empty(0, dtype=dtype).element_size()
    nbytes = 7 * numel * esize
    opts = {name: make(make_params(shapes, dtype)) for name, make in VARIANTS.items()}
    src = torch.empty(numel * 7 // 2, dtype=dtype)
    dst = torch.empty_like(src)
    runs = {name: opt.step for name, opt in opts.items()}
    runs["copy"] = lambda: dst.copy_(src)
    times = {k: [] for k in runs}
    for fn in runs.values():  # warm-up: the state is made on the first step
        fn()
    for r in range(args.rounds):
        order = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
        for k in order:
            times[k].append(timed(runs[k]))
    med = {k: statistics.median(v) for k, v in times.items()}
    copy_rate = 2 * src.numel() * esize / med["copy"] / 1e9
    rows = []
    for name in VARIANTS:
        rate = nbytes / med[name] / 1e9
        rows.append(f"| {str(dtype).removeprefix('torch.')} | {name} | {1e3 * med[name]:.1f} | {rate:.1f} "
                    f"| {rate / copy_rate:.0%} | {med['torch fused=True'] / med[name]:.2f} "
                    f"| {med['torch foreach'] / med[name]:.2f} |")
    rows.append(f"| {str(dtype).removeprefix('torch.')} | copy of the same bytes | {1e3 * med['copy']:.1f} "
                f"| {copy_rate:.1f} | 100% | | |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 1 round (not a timing)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds = 1
    shapes = gpt2_shapes(args.layers)
    print(f"AdamW step, GPT-2 small shapes ({sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M parameters, "
          f"{len(shapes)} tensors), {args.rounds} interleaved rounds, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("| dtype | step | median (ms) | GB/s of the 7 arrays | of the copy's rate | speed vs fused=True "
          "| speed vs foreach |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        for row in measure(getattr(torch, name), args):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
