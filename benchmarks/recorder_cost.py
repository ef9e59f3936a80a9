"""What the flight recorder adds to a training step: a GPT-2 small step on the CPU (transformers'
GPT2LMHeadModel, random init, AdamW, clipped by the monitor, logging every 100 steps), with the
monitor alone, with ``recorder=FlightRecorder(record_updates=False)`` (the ring, the spike
detector, the per-layer rows: the recorder's own work) and with ``record_updates=True`` (also the
update statistics it records). The variants take turns step by step in one process; medians of the
step times and of the time in ``monitor.step()`` alone, each variant's median step over the
monitor alone's, and what the variant adds inside ``monitor.step()`` as a fraction of the step
(the difference of the ``monitor.step()`` medians over the monitor alone's median step: a figure
that the noise of the forward and backward does not swamp).

    python benchmarks/recorder_cost.py [--steps 12] [--batch 2] [--seq 128] [--layers 12]

``--layers`` / ``--width`` shrink the model for a smoke run. Needs transformers (no download:
the model is made from its configuration).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gradfuse  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12, help="timed steps per variant (after 2 warm-up steps)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    args = ap.parse_args(argv)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64))
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    tmp = tempfile.mkdtemp()
    variants = {
        "monitor": gradfuse.GradMonitor(model, max_norm=1.0, every=100),
        "recorder": gradfuse.GradMonitor(model, max_norm=1.0, every=100, recorder=gradfuse.FlightRecorder(
            record_updates=False, dump_dir=tmp)),
        "recorder+updates": gradfuse.GradMonitor(model, max_norm=1.0, every=100, recorder=gradfuse.FlightRecorder(
            optimizer=opt, record_updates=True, dump_dir=tmp)),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    in_monitor: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.steps + 2):
        for name, monitor in (variants.items() if i % 2 == 0 else reversed(variants.items())):
            t0 = time.perf_counter()
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            t1 = time.perf_counter()
            report = monitor.step(loss=loss)
            t2 = time.perf_counter()
            if not report.skip:
                opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
                in_monitor[name].append(t2 - t1)
    n = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 ({args.layers} layers, width {args.width}, {n / 1e6:.1f}M parameters), batch "
          f"{args.batch} x {args.seq}, AdamW, clipped, logging every 100 steps; {args.steps} steps per "
          f"variant, taking turns, {torch.get_num_threads()} threads")
    base = statistics.median(times["monitor"])
    base_in = statistics.median(in_monitor["monitor"])
    print("| variant | median step (ms) | / monitor | median monitor.step() (ms) | added, % of the step |")
    print("|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        m, m_in = statistics.median(ts), statistics.median(in_monitor[name])
        print(f"| {name} | {1e3 * m:.1f} | {m / base:.3f} | {1e3 * m_in:.2f} | {100 * (m_in - base_in) / base:.2f} |")
    for monitor in variants.values():
        monitor.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
