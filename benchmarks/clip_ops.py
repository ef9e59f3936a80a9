"""The clipping kernels against what they replace, interleaved in one run (medians, ratios, GB/s).

The pairs:

  per-tensor scale  ops.multi_tensor_scale_per_tensor_ (one coefficient per tensor, on the device)
                    vs the scalar scale op (torch.ops.gradfuse.multi_tensor_scale_) and
                    torch._foreach_mul_(grads, [0-d tensors]);
  clamp by value    ops.multi_tensor_clamp_ (clamp + statistics before + clamped counts, one pass)
                    vs torch.nn.utils.clip_grad_value_(foreach=True) (clamp only);
  unit statistics   ops.multi_tensor_unit_stats with units = size(0) (AGC's row norms)
                    vs torch.linalg.vector_norm(dim=1..) per parameter;
  memory            a copy of the same tensors (reads and writes every byte once) and a read;
                    float32_mul_same_bytes: torch scaling one float32 tensor of the same bytes in
                    place (x.mul_(c)), the floor of an in-place scale of float16 / bfloat16.

GB/s counts the bytes each method must move: read + write for the scales, the clamp and the copy;
read for the statistics. "% of floor" is, for the in-place scales, the speed of
float32_mul_same_bytes over theirs. Run on GPT-2-small-shaped gradients (gradfuse/workloads.py) or
another workload, fp32 and bf16 (``--methods``: only those, as a comma-separated list):

    .venv/bin/python benchmarks/clip_ops.py [--device cpu|cuda] [--rounds 9] [--workload few_large] [--smoke]
    .venv/bin/python benchmarks/clip_ops.py --workload few_large --dtypes bfloat16,float16,float32 \
        --methods scalar_scale,float32_mul_same_bytes --rounds 15
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gradfuse import ops
from gradfuse.demo import workloads  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make(shapes, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for _, s in shapes]


def methods(grads, params, device):
    n = len(grads)
    # Alternating coefficients keep the values in range (no denormals) over many rounds.
    halves = torch.full((n,), 0.5, device=device)
    doubles = torch.full((n,), 2.0, device=device)
    scalar = [torch.tensor(0.5, device=device), torch.tensor(2.0, device=device)]
    lists = [list(halves.unbind()), list(doubles.unbind())]
    state = {"i": 0}

    def flip():
        state["i"] ^= 1
        return state["i"]

    units = [g.shape[0] if g.dim() > 1 else 1 for g in grads]
    copies = [torch.empty_like(g) for g in grads]
    same_bytes = torch.randn(sum(g.numel() * g.element_size() for g in grads) // 4, device=device)
    return {
        "per_tensor_scale": (lambda: ops.multi_tensor_scale_per_tensor_(grads, (halves, doubles)[flip()], False), 2),
        "scalar_scale": (lambda: torch.ops.gradfuse.multi_tensor_scale_(grads, scalar[flip()], False), 2),
        "foreach_mul_tensors": (lambda: torch._foreach_mul_(grads, lists[flip()]), 2),
        "clamp_with_stats": (lambda: ops.multi_tensor_clamp_(grads, 1.5), 2),
        "clip_grad_value_foreach": (lambda: torch.nn.utils.clip_grad_value_(params, 1.5, foreach=True), 2),
        "unit_stats_rows": (lambda: ops.multi_tensor_unit_stats(grads, units), 1),
        "row_norms_loop": (lambda: [torch.linalg.vector_norm(g, 2, dim=tuple(range(1, g.dim())) or None)
                                    for g in grads], 1),
        "copy": (lambda: torch._foreach_copy_(copies, grads), 2),
        "read_sum": (lambda: [g.sum() for g in grads], 1),
        "float32_mul_same_bytes": (lambda: same_bytes.mul_((0.5, 2.0)[flip()]), 2),
    }


WORKLOAD_TITLES = {"gpt2_small": "GPT-2 small", "few_large": "4 x 2**24 elements"}
SCALES = ("per_tensor_scale", "scalar_scale", "foreach_mul_tensors", "float32_mul_same_bytes")


def run(shapes, dtype, device, rounds, only=None):
    grads = make(shapes, dtype, device)
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty(g.shape, device=device, dtype=dtype))
        p.grad = g  # clip_grad_value_ clamps exactly these tensors
        params.append(p)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    table = methods(grads, params, device)
    if only:
        table = {k: v for k, v in table.items() if k in only}
    times = {k: [] for k in table}
    for fn, _ in table.values():  # warm-up
        fn()
    sync(device)
    for _ in range(rounds):
        for name, (fn, _) in table.items():  # interleaved: every method once per round
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), table[k][1] * nbytes) for k, v in times.items()}, nbytes, len(grads)


def report(results, nbytes, count, title):
    base = {"per_tensor_scale": "foreach_mul_tensors", "scalar_scale": "foreach_mul_tensors",
            "foreach_mul_tensors": "foreach_mul_tensors", "clamp_with_stats": "clip_grad_value_foreach",
            "clip_grad_value_foreach": "clip_grad_value_foreach", "unit_stats_rows": "row_norms_loop",
            "row_norms_loop": "row_norms_loop"}
    copy_gbs = results["copy"][1] / results["copy"][0] / 1e9 if "copy" in results else None
    floor = results.get("float32_mul_same_bytes")
    lines = [f"**{title}** ({count} tensors, {nbytes / 1e6:.0f} MB)", "",
             "| method | median ms | vs baseline | GB/s | % of copy GB/s | % of floor |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, (t, moved) in results.items():
        b = base.get(name)
        ratio = f"{t / results[b][0]:.2f}x {b}" if b in results else "-"
        gbs = moved / t / 1e9
        of_copy = f"{100 * gbs / copy_gbs:.0f}%" if copy_gbs else "-"
        of_floor = f"{100 * floor[0] / t:.0f}%" if floor and name in SCALES else "-"
        lines.append(f"| {name} | {t * 1e3:.3f} | {ratio} | {gbs:.1f} | {of_copy} | {of_floor} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--workload", default="gpt2_small", choices=["gpt2_small", "few_large"],
                    help="gpt2_small: GPT-2 small's gradients; few_large: 4 tensors of 2**24 elements")
    ap.add_argument("--methods", default="", help="only these methods (comma-separated; default all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round (untimed check)")
    args = ap.parse_args(argv)
    only = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(only) - set(methods([], [], torch.device("cpu"))))
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.workload == "few_large":
        shapes = workloads.few_large(4, 2**10 if args.smoke else 2**24)
    else:
        shapes = workloads.gpt2_small(layers=1, d=64, vocab=500, ctx=32) if args.smoke else workloads.gpt2_small()
    rounds = 1 if args.smoke else args.rounds
    print(f"# torch {torch.__version__}, {device}, threads {torch.get_num_threads()}, rounds {rounds}, "
          f"workload {args.workload}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        results, nbytes, count = run(shapes, dtype, device, rounds, only)
        print(report(results, nbytes, count, f"{WORKLOAD_TITLES[args.workload]}, {name}, {device}"))
        print()


if __name__ == "__main__":
    main()
