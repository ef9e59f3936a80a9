"""The whole step with everything on and never waiting, against torch's clipped step and the
monitor's default, on one device: a small transformer (torch's own layers, no download), AdamW,
two micro-batches per step, the variants taking turns step by step, medians of the whole step
(forward, backward, monitor, optimizer; the device synchronised after each step on CUDA), and
gradfuse's host reads from the monitor's step to the end of the optimizer's counted
(``gradfuse.HostReads``) in a separate pass.

- ``torch clip``: ``clip_grad_norm_(model.parameters(), 1.0)``, then torch's AdamW (fused where
  the device has it);
- ``monitor (default)``: ``GradMonitor(model, max_norm=1.0, every=0)`` before that AdamW,
  nothing logged: it reads the skip decision on the host each step;
- ``everything, never waiting``: ``gradfuse.optim.AdamW`` with the clip riding its step
  (``fused_step=True``), ``blocking=False``, histograms, activations, the NaN trace, noise scale,
  update ratios and the flight recorder with updates, logging every step to a JSONL file.

    python benchmarks/never_waits.py [--device cuda] [--steps 30] [--layers 4] [--width 256]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gradfuse  # noqa: E402
import gradfuse.optim  # noqa: E402

VARIANTS = ("torch clip", "monitor (default)", "everything, never waiting")


def build(args):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(args.width, nhead=max(1, args.width // 64), dim_feedforward=4 * args.width,
                                       dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False),
                          nn.Linear(args.width, args.width)).to(args.device)
    x = torch.randn(2, args.batch, args.seq, args.width, generator=torch.Generator().manual_seed(1)).to(args.device)
    return model, x


def make_step(name: str, model, tmp: str):
    """The variant's step (its own AdamW and monitor), its closer, and its optimizer."""
    if name == "everything, never waiting":
        opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-4)
        monitor = gradfuse.GradMonitor(
            model, max_norm=1.0, every=1, optimizer=opt, fused_step=True, blocking=False, histogram=True,
            activations=True, trace_nonfinite=True, noise_scale=True, update_ratios=opt,
            sinks=[gradfuse.JsonlSink(os.path.join(tmp, "run.jsonl"))],
            recorder=gradfuse.FlightRecorder(optimizer=opt, record_updates=True, dump_dir=tmp))
    else:
        fused = {"fused": True} if model[1].weight.device.type == "cuda" else {}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        monitor = gradfuse.GradMonitor(model, max_norm=1.0, every=0) if name == "monitor (default)" else None

    def step(x, counted: list | None = None):
        for micro in range(x.shape[0]):
            (model(x[micro]).square().mean() / x.shape[0]).backward()
            if monitor is not None:
                monitor.micro_step()
        with gradfuse.HostReads() if counted is not None else contextlib.nullcontext() as reads:
            if monitor is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            elif not monitor.step().skip:
                opt.step()
        if counted is not None:
            counted.append(len(reads.reads_from(gradfuse)))
        opt.zero_grad(set_to_none=True)

    return step, (monitor.close if monitor is not None else (lambda: None)), opt


def host_reads(step, x, steps: int = 4) -> float:
    """Gradfuse's own reads of tensor values on the host per step, from the monitor's step to the
    end of the optimizer's (what waits for the device; the activation hooks' CPU shortcuts in the
    forward and backward, which an accelerator does not take, are left out)."""
    counted: list[int] = []
    for _ in range(steps):
        step(x, counted)
    return sum(counted) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant (after 3 warm-up steps)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    tmp = tempfile.mkdtemp()
    runs = {}
    for name in VARIANTS:
        model, x = build(args)  # the same seed: the same initial weights
        runs[name] = (*make_step(name, model, tmp), x)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for i in range(args.steps + 3):
        for name in (VARIANTS if i % 2 == 0 else reversed(VARIANTS)):
            step, _close, _opt, x = runs[name]
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(x)
            if cuda:
                torch.cuda.synchronize()
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    reads = {name: host_reads(step, x) for name, (step, _c, _opt, x) in runs.items()}
    for _step, close, _opt, _x in runs.values():
        close()
    n = sum(p.numel() for p in runs[VARIANTS[0]][2].param_groups[0]["params"])
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"transformer ({args.layers} layers, width {args.width}, {n / 1e6:.1f}M parameters), 2 micro-batches of "
          f"{args.batch} x {args.seq}, AdamW; {args.steps} steps per variant, taking turns; {where}, "
          f"torch {torch.__version__}")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print("| variant | median step (ms) | / torch clip | gradfuse's host reads per step |")
    print("|---|---:|---:|---:|")
    for name in VARIANTS:
        print(f"| {name} | {1e3 * med[name]:.2f} | {med[name] / med['torch clip']:.3f} | {reads[name]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
