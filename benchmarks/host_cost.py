"""Per-parameter host cost of one step on many tiny gradients, every call interleaved with the
others in one process (so each finds the caches as the previous calls left them, as in
training), medians, in ns per parameter and as a ratio to clip_grad_norm_(foreach=True).

    python benchmarks/host_cost.py [--count 10000] [--rounds 41] [--threads N]

The named list is workloads.tiny(); the module is the same number of parameters in nested
modules (ParameterLists in Sequentials), whose named_parameters() walk is part of the cost.
Runs on older gradfuse versions too (the calls they lack are left out).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

import gradfuse
from gradfuse.demo import workloads as wl

HUGE = 1e30  # a max_norm that never clips


def nested_module(count: int, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    sizes = iter(torch.randint(4, 17, (count,), generator=g).tolist())
    per_list = 10
    lists = [nn.ParameterList([nn.Parameter(torch.zeros(next(sizes))) for _ in range(per_list)])
             for _ in range(count // per_list)]
    model = nn.Sequential(*[nn.Sequential(*lists[i:i + 10]) for i in range(0, len(lists), 10)])
    for p in model.parameters():
        p.grad = torch.rand(p.shape, generator=g) - 0.5
    return model


def calls(count: int) -> dict:
    named = wl.make_grads(wl.tiny(count=count))
    params = [p for _, p in named]
    grads = [p.grad for p in params]
    model = nested_module(count)
    below_autograd = torch._C._AutoDispatchBelowADInplaceOrView

    def op_below_autograd():
        with below_autograd():
            torch.ops.gradfuse.multi_tensor_stats(grads, 2.0)

    c = {
        "clip_grad_norm_(foreach=True)": lambda: nn.utils.clip_grad_norm_(params, HUGE, foreach=True),
        "[p.grad for p in params]": lambda: [p.grad for p in params],
        "stats op, boxed (torch.ops)": lambda: torch.ops.gradfuse.multi_tensor_stats(grads, 2.0),
        "stats op, below autograd": op_below_autograd,
        "gradfuse.stats(named)": lambda: gradfuse.stats(named),
        "gradfuse.clip_(named)": lambda: gradfuse.clip_(named, HUGE),
        "gradfuse.clip_(module)": lambda: gradfuse.clip_(model, HUGE),
    }
    for label, source in (("named", named), ("module", model)):
        mon = gradfuse.GradMonitor(source, max_norm=HUGE, every=0, on_nonfinite="ignore")
        c[f"GradMonitor.step() ({label})"] = mon.step
    if "blocking" in gradfuse.GradMonitor.__init__.__code__.co_varnames:  # the skip policy, read or on the device
        from gradfuse.optim import SGD as FusedSGD
        opt = FusedSGD(params, lr=0.0)
        blocking = gradfuse.GradMonitor(named, max_norm=HUGE, every=0, on_nonfinite="skip")
        deferred = gradfuse.GradMonitor(named, max_norm=HUGE, every=0, on_nonfinite="skip", optimizer=opt,
                                        blocking=False)
        c["GradMonitor.step(), on_nonfinite='skip' (named)"] = blocking.step
        c["GradMonitor.step(), on_nonfinite='skip', blocking=False (named)"] = deferred.step
    if hasattr(gradfuse, "watch"):
        w_named, w_module = gradfuse.watch(named), gradfuse.watch(model)
        c["watch(named).stats()"] = w_named.stats
        c["watch(named).clip_()"] = lambda: w_named.clip_(HUGE)
        c["watch(module).clip_()"] = lambda: w_module.clip_(HUGE)
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    c = calls(args.count)
    for fn in c.values():  # warm-up: watches make their plans
        fn()
    times = {name: [] for name in c}
    for _ in range(args.rounds):
        for name, fn in c.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["clip_grad_norm_(foreach=True)"])
    print(f"{args.count} tiny gradients, {torch.get_num_threads()} threads, median of {args.rounds}")
    print("| call | median ms | ns per parameter | vs clip_grad_norm_(foreach) |\n|---|---:|---:|---:|")
    for name, v in times.items():
        m = statistics.median(v)
        print(f"| {name} | {m * 1e3:.2f} | {m / args.count * 1e9:.0f} | {m / base:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
