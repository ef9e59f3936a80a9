"""The full health of a run on every step, against torch's clipped step and the monitor that clips.

A GPT-2 small step on the CPU (transformers' GPT2LMHeadModel, random init, AdamW, batch 2 x 128),
with

- ``torch clip``: ``clip_grad_norm_(model.parameters(), 1.0)`` then ``optimizer.step()``;
- ``monitor (clip)``: ``GradMonitor(model, max_norm=1.0, every=0)``: the fused statistics and the
  clip, nothing logged;
- ``full health``: the same monitor logging every step to a JSONL file with everything on: the
  exponent histograms and numeric headroom, the noise scale, the activations and the gradients
  flowing into them, the optimizer's update, weight and moment statistics per layer, and the
  flight recorder (with the updates);
- ``full health, gradfuse.optim``: the same with ``gradfuse.optim.AdamW`` (torch's AdamW bit for
  bit, its step one fused pass) and ``fused_step=True`` (the clip applied inside that pass),
  against the other variants' ``torch.optim.AdamW``;
- ``full health, never waiting``: that one with ``blocking=False`` (every decision on the device,
  the host told a step later) and ``trace_nonfinite=True``: all of it at once.

Each variant has its own copy of the model (the same initial weights) and its own AdamW, so that
the activation hooks one variant arms never run in another's step; they take turns step by step
in one process (medians of the whole step: forward, backward, monitor, optimizer). First, each
variant runs alone in a fresh process with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed blocks go back
to the system, so the peak is live memory, not the heap's fragmentation) and the extra peak RSS
(``VmHWM``) over ``monitor (clip)`` is given as a fraction of the parameters' bytes.

    python benchmarks/full_health.py [--steps 12] [--batch 2] [--seq 128] [--layers 12] [--width 768]
                                     [--no-memory]

``--layers`` / ``--width`` shrink the model for a smoke run. Needs transformers (no download:
the model is made from its configuration).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gradfuse  # noqa: E402
import gradfuse.optim  # noqa: E402

VARIANTS = ("torch clip", "monitor (clip)", "full health", "full health, gradfuse.optim",
            "full health, never waiting")


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64))
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    return model, tokens


def make_step(name: str, model, tokens, tmp: str):
    """A step function for the variant (its own AdamW) and a closer."""
    waits = not name.endswith("never waiting")
    fused = name.endswith("gradfuse.optim") or not waits
    opt = (gradfuse.optim.AdamW if fused else torch.optim.AdamW)(model.parameters(), lr=1e-4, weight_decay=0.1)
    monitor = None
    if name == "monitor (clip)":
        monitor = gradfuse.GradMonitor(model, max_norm=1.0, every=0)
    elif name.startswith("full health"):
        monitor = gradfuse.GradMonitor(
            model, max_norm=1.0, every=1, histogram=True, noise_scale=True, update_ratios=opt,
            activations=True, sinks=[gradfuse.JsonlSink(os.path.join(tmp, f"health-{VARIANTS.index(name)}.jsonl"))],
            recorder=gradfuse.FlightRecorder(optimizer=opt, record_updates=True, dump_dir=tmp),
            **({"optimizer": opt, "fused_step": True} if fused else {}),
            **({} if waits else {"blocking": False, "trace_nonfinite": True}))

    def step():
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        if monitor is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        elif not monitor.step(loss=loss).skip:
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (monitor.close if monitor is not None else (lambda: None)), opt


def peak_of_this_process() -> float:
    """MB: the peak RSS of this process's image (VmHWM). Not ``ru_maxrss``: Linux carries that
    over from the parent's image across fork and exec, so a child of a large parent reads large."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss(args, name: str) -> float:
    """MB of peak RSS of a fresh process taking 4 steps of the variant."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--peak-rss-of", name, "--batch", str(args.batch), "--seq", str(args.seq),
           "--layers", str(args.layers), "--width", str(args.width)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12, help="timed steps per variant (after 2 warm-up steps)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs")
    ap.add_argument("--peak-rss-of", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp()
    if args.peak_rss_of:  # the child of peak_rss
        model, tokens = build(args)
        step, close, _ = make_step(args.peak_rss_of, model, tokens, tmp)
        for _ in range(4):
            step()
        close()
        print(json.dumps({"peak_rss_mb": peak_of_this_process()}))
        return 0

    rss = {} if args.no_memory else {name: peak_rss(args, name) for name in VARIANTS}
    steps = {}
    for name in VARIANTS:
        model, tokens = build(args)  # the same seed: the same initial weights
        steps[name] = make_step(name, model, tokens, tmp)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for i in range(args.steps + 2):
        for name in (VARIANTS if i % 2 == 0 else reversed(VARIANTS)):
            t0 = time.perf_counter()
            steps[name][0]()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    for _, close, _ in steps.values():
        close()
    n = sum(p.numel() for p in model.parameters())
    param_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(f"GPT-2 ({args.layers} layers, width {args.width}, {n / 1e6:.1f}M parameters, {param_mb:.0f} MB), "
          f"batch {args.batch} x {args.seq}, AdamW; {args.steps} steps per variant, taking turns, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print("| variant | median step (ms) | / torch clip | / monitor (clip) | peak RSS (MB) "
          "| extra over monitor (clip), % of parameters |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in VARIANTS:
        mem = (f"{rss[name]:.0f} | {100 * (rss[name] - rss['monitor (clip)']) / param_mb:+.1f}" if rss else "- | -")
        print(f"| {name} | {1e3 * med[name]:.1f} | {med[name] / med['torch clip']:.3f} "
              f"| {med[name] / med['monitor (clip)']:.3f} | {mem} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
