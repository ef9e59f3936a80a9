"""The clipping modes against their baselines, CPU, interleaved in one process, medians and
ratios from the same run.

The pairs and their targets:

- ``clip_(per="layer")`` / ``clip_(per="param")`` vs gradfuse's global ``clip_``, all clipping
  (target: at most 1.15x);
- ``gradfuse.clip_grad_value_`` and ``clip_(value=)`` (with statistics) vs
  ``torch.nn.utils.clip_grad_value_(foreach=True)`` (target: at most 1x);
- ``gradfuse.adaptive_clip_grad_`` vs ``timm.utils.adaptive_clip_grad`` (target: 3x faster);
- ``gradfuse.ZClip.step`` vs ``zclip.ZClip.step`` after the warm-up (target: 3x faster).

    python benchmarks/clipping_bench.py [--workloads gpt2_small,resnet50] [--dtypes float32,bfloat16]
                                        [--rounds 7] [--threads 1] [--smoke] [--methods a,b]

``--workloads tiny``: 10 000 tensors of 4-16 elements, where the host work per parameter is
what a call costs.

``--smoke``: tiny shapes, 1 round (the test suite runs it so the script cannot rot). Each round
calls every method once per (workload, dtype) in turn; the table gives each method's median
over the rounds and its ratio to its baseline's median.
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

try:
    from timm.utils import adaptive_clip_grad as timm_agc
except ImportError:  # pragma: no cover - timm is in requirements-dev.txt
    timm_agc = None
try:
    import zclip
except ImportError:  # pragma: no cover
    zclip = None

TINY_MAX_NORM = 1e-3  # clips every call (the coefficient stays below 1 after the first)


def make_model(shapes, dtype, seed=0) -> nn.Module:
    """A module holding real parameters of ``shapes`` (weights for AGC) with random gradients."""
    g = torch.Generator().manual_seed(seed)
    m = nn.Module()
    m.params = nn.ParameterList()
    names = []
    for name, shape in shapes:
        p = nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(dtype))
        p.grad = (torch.rand(shape, generator=g) * 2 - 1 + 1e-3).to(dtype)
        m.params.append(p)
        names.append(name)
    m.names = names
    return m


def methods(model: nn.Module) -> dict:
    named = list(zip(model.names, model.params))
    params = list(model.params)
    z_ours = gradfuse.ZClip(warmup_steps=2, max_grad_norm=TINY_MAX_NORM)
    out = {
        "clip_global": lambda: gradfuse.clip_(named, TINY_MAX_NORM),
        "clip_per_layer": lambda: gradfuse.clip_(named, TINY_MAX_NORM, per="layer"),
        "clip_per_param": lambda: gradfuse.clip_(named, TINY_MAX_NORM, per="param"),
        "torch_value_foreach": lambda: torch.nn.utils.clip_grad_value_(params, 0.01, foreach=True),
        "gradfuse_value": lambda: gradfuse.clip_grad_value_(params, 0.01),
        "gradfuse_value_stats": lambda: gradfuse.clip_(named, None, value=0.01),
        "gradfuse_agc": lambda: gradfuse.adaptive_clip_grad_(params, 0.01),
        "gradfuse_zclip": lambda: z_ours.step(model),
    }
    if timm_agc is not None:
        out["timm_agc"] = lambda: timm_agc(params, 0.01)
    if zclip is not None:
        z_ref = zclip.ZClip(warmup_steps=2, max_grad_norm=TINY_MAX_NORM)
        out["zclip_step"] = lambda: z_ref.step(model)
    # past both ZClips' warm-up, so that the timed steps are the EMA steps
    for _ in range(3):
        out["gradfuse_zclip"]()
        if "zclip_step" in out:
            out["zclip_step"]()
    return out


BASELINES = {"clip_global": None, "clip_per_layer": "clip_global", "clip_per_param": "clip_global",
             "torch_value_foreach": None, "gradfuse_value": "torch_value_foreach",
             "gradfuse_value_stats": "torch_value_foreach", "timm_agc": None,
             "gradfuse_agc": "timm_agc", "zclip_step": None, "gradfuse_zclip": "zclip_step"}


def run(workload: str, dtype: torch.dtype, rounds: int, smoke: bool,
        only: list[str] | None = None) -> list[str]:
    shapes = wl.WORKLOADS[workload]()
    if smoke:
        shapes = [(n, tuple(max(1, d // 64) for d in s)) for n, s in shapes[:12]]
    model = make_model(shapes, dtype)
    calls = methods(model)
    if only:
        calls = {k: v for k, v in calls.items() if k in only}
    times: dict[str, list[float]] = {k: [] for k in calls}
    for name in calls:  # warm-up round (plans, caches), untimed
        calls[name]()
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    lines = [f"**{workload}, {str(dtype).replace('torch.', '')}** ({len(shapes)} tensors, "
             f"{wl.numel(shapes) / 1e6:.1f}M elements, {rounds} rounds)", "",
             "| method | median ms | vs baseline | baseline |", "|---|---:|---:|---|"]
    for name in BASELINES:
        if name not in med:
            continue
        base = BASELINES[name]
        ratio = f"{med[name] / med[base]:.2f}x" if base in med else "-"
        lines.append(f"| {name} | {med[name]:.3f} | {ratio} | {base or '-'} |")
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="gpt2_small,resnet50")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--methods", default="",
                    help="comma-separated subset of the methods (default: all), e.g. "
                         "clip_global,clip_per_layer,clip_per_param")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine a thread pool waits for "
                         "descheduled workers, which swamps what is measured)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = 1 if args.smoke else args.rounds
    print(f"gradfuse backend cpu: {gradfuse.backend('cpu')}; torch {torch.__version__}; "
          f"threads {torch.get_num_threads()}")
    for workload in args.workloads.split(","):
        for dt in args.dtypes.split(","):
            print("\n".join(run(workload, getattr(torch, dt), rounds, args.smoke,
                                 [m for m in args.methods.split(",") if m])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
