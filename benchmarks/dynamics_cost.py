"""What GradMonitor(noise_scale=..., update_ratios=...) adds to a step:
fused passes counted per step (the statistics op and the optimizer-update op, however they are
reached), and the time of each variant
against the monitor without these options, all variants interleaved in one process, medians.

    python benchmarks/dynamics_cost.py [--layers 4] [--vocab 8192] [--rounds 15] [--accumulate 4]
                                       [--d 768] [--ctx 1024]

The parameter set is GPT-2-small-shaped (gradfuse.demo.workloads.gpt2_small with fewer layers and a
smaller vocabulary by default, so that parameters, gradients and AdamW's two moments fit a shared
CPU machine). A "micro-batch" here is a copy of fixed gradients into .grad (a stand-in for the
backward, the same for every variant), so the times compare what the monitor adds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradfuse
from gradfuse.demo import workloads as wl

# the fused ops that read a model-sized list once: the statistics, the optimizer's update
PASSES = tuple(getattr(torch.ops.gradfuse, name).default
               for name in ("multi_tensor_stats", "multi_tensor_update_stats") if hasattr(torch.ops.gradfuse, name))


class CountPasses(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in PASSES:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--accumulate", type=int, default=4)
    ap.add_argument("--d", type=int, default=768, help="model width (smoke runs: small)")
    ap.add_argument("--ctx", type=int, default=1024)
    args = ap.parse_args(argv)
    k = args.accumulate
    gen = torch.Generator().manual_seed(0)
    named = [(name, torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02))
             for name, shape in wl.gpt2_small(layers=args.layers, d=args.d, vocab=args.vocab, ctx=args.ctx)]
    params = [p for _, p in named]
    grads = [[torch.randn_like(p) * 1e-3 for p in params] for _ in range(k)]
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    for p, g in zip(params, grads[0]):  # AdamW state exists: the update formula reads it
        p.grad = g.clone()
    opt.step()

    def backward(i):
        for p, g in zip(params, grads[i]):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)

    monitors = {
        "monitor": gradfuse.GradMonitor(named, every=0, max_norm=1.0),
        "monitor+noise_scale": gradfuse.GradMonitor(
            named, every=0, max_norm=1.0, noise_scale=gradfuse.NoiseScale(accumulation_steps=k)),
        "monitor, logging step": gradfuse.GradMonitor(named, every=1, max_norm=1.0),
        "monitor+update_ratios, logging step": gradfuse.GradMonitor(named, every=1, max_norm=1.0,
                                                                     update_ratios=opt),
    }

    def step(name):
        """Returns the seconds spent in the monitor's calls (micro_step and step)."""
        mon = monitors[name]
        for p in params:
            p.grad = None
        spent = 0.0
        for i in range(k):
            backward(i)
            t0 = time.perf_counter()
            mon.micro_step()
            spent += time.perf_counter() - t0
        t0 = time.perf_counter()
        mon.step()
        return spent + time.perf_counter() - t0

    passes = {}
    for name in monitors:
        step(name)  # warm-up (the noise scale learns nothing here: accumulation_steps is given)
        with CountPasses() as c:
            step(name)
        passes[name] = c.calls
    times = {name: [] for name in monitors}
    inside = {name: [] for name in monitors}
    names = list(monitors)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            t0 = time.perf_counter()
            inside[name].append(step(name))
            times[name].append(time.perf_counter() - t0)
    t_opt = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        opt.step()
        t_opt.append(time.perf_counter() - t0)
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    mon_med = {name: statistics.median(v) * 1e3 for name, v in inside.items()}
    print(f"{len(params)} tensors, {n / 1e6:.1f}M fp32 parameters, {k} micro-batches per step, "
          f"{args.rounds} rounds, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| variant | fused passes / step | monitor calls, median ms | vs monitor | whole step "
          "(k grad copies + monitor), median ms | vs monitor |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        base = "monitor, logging step" if "logging" in name else "monitor"
        print(f"| {name} | {passes[name]} | {mon_med[name]:.2f} | {mon_med[name] / mon_med[base]:.2f}x "
              f"| {med[name]:.2f} | {med[name] / med[base]:.2f}x |")
    print(f"| (AdamW.step itself, for scale) | - | - | - | {statistics.median(t_opt) * 1e3:.2f} | - |")
    ns = monitors["monitor+noise_scale"].noise_scale
    print(f"noise scale updates: {ns.updates}, its own passes: {ns.extra_passes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
