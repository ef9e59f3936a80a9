"""Where a captured step's extra time goes, on the CPU.

The plain step against the step under ``capture_activations`` (and the trace-only capture of
``trace_nonfinite``), with the time spent inside the hooks split by what it was spent on,
measured with the thread's CPU clock around each call, summed per step:

- ``stats op``: the fused statistics op (``gradfuse._C``), per tensor shape, with its rate;
- ``t.sum() on the same tensors``: one plain read of each of those tensors, right after the op
  (in cache: a lower bound of any read; untimed in the step's total);
- ``dead units``: the per-unit passes, the corner probes and the one-slice tests;
- ``trace sums``: the trace mode's one ``sum()`` per output and output gradient;
- ``rest of the hooks``: everything else inside the hooks (Python bookkeeping, tensor hooks).

    python benchmarks/activations_profile.py [--models resnet,gpt2] [--rounds 7]

Medians over ``--rounds`` steps; one torch thread. The step totals are process CPU time, the
parts thread CPU time (the backward runs on the calling thread on the CPU).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import activations_bench as ab  # noqa: E402

import gradfuse  # noqa: E402
from gradfuse.activations import capture as acts  # noqa: E402
from gradfuse.activations import dead_units  # noqa: E402

clock = time.thread_time


class Timed:
    """Wraps the dead-unit functions the capture calls, summing their CPU time per step by key."""

    def __init__(self):
        self.t = collections.defaultdict(float)
        self.n = collections.defaultdict(int)
        self.floor = collections.defaultdict(float)
        self.saved = {}

    def wrap(self, name, key_of=None):
        real = getattr(dead_units, name)
        self.saved[name] = real

        def f(*a):
            s = clock()
            r = real(*a)
            k = name if key_of is None else key_of(*a)
            self.t[k] += clock() - s
            self.n[k] += 1
            return r
        setattr(dead_units, name, f)

    def restore(self):
        for k, v in self.saved.items():
            setattr(dead_units, k, v)


def hooked_step(model, loss_fn, timed: Timed, stats: bool):
    cap = acts.ActivationCapture(model, stats=stats)
    real = cap._stats_op(torch.device("cpu"))

    def op(tensors):
        s = clock()
        r = real(tensors)
        e = clock()
        key = "stats op " + "x".join(map(str, tensors[0].shape))
        timed.t[key] += e - s
        timed.n[key] += 1
        timed.t["bytes " + key] += sum(t.numel() * t.element_size() for t in tensors)
        s = clock()
        for t in tensors:
            t.sum()
        timed.floor[key] += clock() - s
        return r
    cap._ops[torch.device("cpu")] = op
    real_trace = cap._trace_rows_cpu

    def trace(tensors):
        s = clock()
        r = real_trace(tensors)
        timed.t["trace sums"] += clock() - s
        return r
    cap._trace_rows_cpu = trace
    hook_time = [0.0]
    real_record = cap._record_forward

    def record(*a):
        s = clock()
        real_record(*a)
        hook_time[0] += clock() - s
    cap._record_forward = record
    real_grad_hook = cap._grad_hook

    def grad_hook(*a):
        h = real_grad_hook(*a)

        def timed_hook(g):
            s = clock()
            r = h(g)
            hook_time[0] += clock() - s
            return r
        return timed_hook
    cap._grad_hook = grad_hook
    t0 = time.process_time()
    cap.arm()
    try:
        loss_fn().backward()
    finally:
        cap.disarm()
    if stats:
        cap.forward.to_dict(), cap.backward.to_dict()
    total = time.process_time() - t0
    floor = sum(timed.floor.values())  # not part of the capture: taken out of the hooks' time
    timed.floor_total = getattr(timed, "floor_total", 0.0) + floor
    timed.t["hooks (all)"] += hook_time[0] - floor
    return total - floor


VARIANTS = {"capture": ("capture_activations (statistics)", True, False),
            "capture_no_probe": ("capture_activations without the corner probe (before/after)",
                                 True, True),
            "trace": ("trace-only capture (trace_nonfinite)", False, False)}


def profile(label, model, loss_fn, rounds, variants=("capture", "capture_no_probe", "trace")):
    params = list(model.parameters())

    def zero():
        for p in params:
            p.grad = None

    def plain():
        t0 = time.process_time()
        loss_fn().backward()
        return time.process_time() - t0

    def hooked(key, timed):
        _title, stats, no_probe = VARIANTS[key]
        real = dead_units._probe_alive
        if no_probe:
            dead_units._probe_alive = lambda t, dim: None
        timed.wrap("_unit_activity", lambda t, d: "dead units: per-unit passes")
        timed.wrap("_probe_alive", lambda t, d: "dead units: corner probes")
        timed.wrap("_one_slice_alive", lambda t, d: "dead units: one-slice tests")
        try:
            return hooked_step(model, loss_fn, timed, stats)
        finally:
            timed.restore()
            dead_units._probe_alive = real

    for _ in range(2):
        plain(), zero()
        for key in variants:
            hooked(key, Timed()), zero()
    results = {k: ([], [], []) for k in variants}  # plain, hooked, parts per round
    for _ in range(rounds):
        for key in variants:  # each variant right after its own plain step
            timed = Timed()
            p = plain()
            zero()
            c = hooked(key, timed)
            zero()
            results[key][0].append(p)
            results[key][1].append(c)
            results[key][2].append((dict(timed.t), dict(timed.n), dict(timed.floor)))
    out = [f"**{label}**, {rounds} rounds (medians per step; each variant right after a plain step; "
           "parts: thread CPU time summed over the step)", ""]
    for key in variants:
        plains, caps, per_round = results[key]
        mp = statistics.median(plains)
        ratio = statistics.median(c / p for c, p in zip(caps, plains))
        out += [f"{VARIANTS[key][0]}: plain step {1e3 * mp:.1f} ms, with hooks {1e3 * statistics.median(caps):.1f} ms, "
                f"{ratio:.3f}x (median of per-round ratios)", "",
                "| part | calls/step | ms/step | % of the plain step | rate | t.sum() on the same tensors |",
                "|---|---:|---:|---:|---:|---:|"]
        keys = sorted({k for t, _n, _f in per_round for k in t if not k.startswith("bytes ")},
                      key=lambda k: -statistics.median(t.get(k, 0) for t, _n, _f in per_round))
        parts = 0.0
        for k in keys:
            ms = 1e3 * statistics.median(t.get(k, 0.0) for t, _n, _f in per_round)
            calls = statistics.median(n.get(k, 0) for _t, n, _f in per_round)
            rate = floor = ""
            if k.startswith("stats op"):
                b = per_round[0][0].get("bytes " + k, 0)
                rate = f"{b / (ms / 1e3) / 1e9:.1f} GB/s" if ms else ""
                fl = 1e3 * statistics.median(f.get(k, 0.0) for _t, _n, f in per_round)
                floor = f"{fl:.2f} ms ({b / (fl / 1e3) / 1e9:.1f} GB/s)" if fl else ""
            if k != "hooks (all)":
                parts += ms
            lines_k = "**all time inside the hooks**" if k == "hooks (all)" else k
            out.append(f"| {lines_k} | {calls or '':} | {ms:.2f} | {100 * ms / (1e3 * mp):.1f}% | {rate} | {floor} |")
        hooks = 1e3 * statistics.median(t.get("hooks (all)", 0.0) for t, _n, _f in per_round)
        out.append(f"| rest of the hooks (bookkeeping, tensor hooks) | | {hooks - parts:.2f} | "
                   f"{100 * (hooks - parts) / (1e3 * mp):.1f}% | | |")
        extra = 1e3 * statistics.median(c - p for c, p in zip(caps, plains)) - hooks
        out.append(f"| outside the hooks (arming, autograd calling them, results, noise) | | {extra:.2f} | "
                   f"{100 * extra / (1e3 * mp):.1f}% | | |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, default=None, help="as in activations_bench.py")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 CPU thread, gradfuse backend {gradfuse.backend('cpu')}")
    for name in args.models.split(","):
        label, model, loss_fn = ab.MODELS[name](args.smoke, args.batch)
        print(profile(label, model, loss_fn, args.rounds) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
