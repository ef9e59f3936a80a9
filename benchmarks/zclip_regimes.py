"""gradfuse.ZClip against the ``zclip`` package's ``step``, per regime, on
the CPU, with the bytes each one moves over the gradients per step.

Regimes (every step of a regime is that regime: the gradients, and for the spike regime the
EMA state of both ZClips, are restored before each timed step, untimed):

- ``warmup``: inside the warm-up, no ``max_grad_norm``: the norm only;
- ``warmup_max_norm``: inside the warm-up with ``max_grad_norm`` above the norm (nothing to
  clip): zclip still calls ``torch.nn.utils.clip_grad_norm_``, which computes the norm again and
  multiplies every gradient by its clamped coefficient (1.0);
- ``warmup_max_norm_clip``: the same with ``max_grad_norm`` below the norm (clips);
- ``no_spike``: after the warm-up, the norm at the EMA mean: no clipping;
- ``spike``: after the warm-up, the gradients 10x their warm-up size: ``adaptive_scaling``
  clips (z-score far above ``z_thresh``);
- ``max_norm``: after the warm-up, ``max_grad_norm`` below every norm: clips every step.

For each regime the table gives the bytes of gradient memory each implementation reads and
writes per step (counted from their code: zclip 1.0.0's ``step`` and gradfuse's fused passes,
see benchmarks/RESULTS.md), the ratio of those bytes (the most a CPU can gain when both run at
memory bandwidth) and the measured ratio of medians, interleaved in one run. A ``floor`` row
times the same bytes as plain torch foreach passes (``_foreach_norm`` for a read,
``_foreach_mul_`` for a read and a write) to show how close each is to bandwidth.

    python benchmarks/zclip_regimes.py [--workloads gpt2_small,resnet50,tiny] [--dtypes float32]
                                       [--rounds 9] [--threads 1] [--smoke] [--count-ops]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import gradfuse
from gradfuse.demo import workloads as wl

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from clipping_bench import make_model  # noqa: E402

try:
    import zclip
except ImportError:  # pragma: no cover - zclip is in requirements-dev.txt
    zclip = None

WARMUP = 5
# (zclip passes, gradfuse passes) over the gradients per step: R = one read, RW = a read and a
# write of every gradient element.
PASSES = {
    "warmup": ("R", "R"),
    "warmup_max_norm": ("R + R + RW", "R"),
    "warmup_max_norm_clip": ("R + R + RW", "R + RW"),
    "no_spike": ("R", "R"),
    "spike": ("R + RW", "R + RW"),
    "max_norm": ("R + RW", "R + RW"),
}


def _bytes(passes: str) -> int:
    """Bytes of the gradients moved, in units of the gradients' size."""
    return sum(2 if p.strip() == "RW" else 1 for p in passes.split("+"))


def configs(regime: str, rounds: int) -> tuple[dict, float, int]:
    """(ZClip kwargs, gradient factor of the timed steps, warm-up steps run before timing)."""
    if regime == "warmup":
        return dict(warmup_steps=10 * (rounds + 2), max_grad_norm=None), 1.0, 0
    if regime == "warmup_max_norm":
        return dict(warmup_steps=10 * (rounds + 2), max_grad_norm=1e12), 1.0, 0
    if regime == "warmup_max_norm_clip":
        return dict(warmup_steps=10 * (rounds + 2), max_grad_norm=1e-3), 1.0, 0
    if regime == "no_spike":
        return dict(warmup_steps=WARMUP, max_grad_norm=None), 1.0, WARMUP
    if regime == "spike":
        return dict(warmup_steps=WARMUP, max_grad_norm=None), 10.0, WARMUP
    if regime == "max_norm":
        return dict(warmup_steps=WARMUP, max_grad_norm=1e-3), 1.0, WARMUP
    raise ValueError(regime)


class Pair:
    """zclip's and gradfuse's ZClip on one model, with what restores a step's starting point."""

    def __init__(self, model, regime: str, rounds: int):
        kw, self.factor, warm = configs(regime, rounds)
        self.model = model
        self.grads = [p.grad for p in model.params]
        base = [g.clone() for g in self.grads]
        self.ours = gradfuse.ZClip(**kw)
        self.ref = zclip.ZClip(**kw) if zclip is not None else None
        # warm-up norms 1.00x .. 1.04x of the base: a small, non-zero variance
        for k in range(warm):
            for z in (self.ours, self.ref):
                if z is None:
                    continue
                self.set_grads(base, 1.0 + 0.01 * (k % 5))
                z.step(model)
        self.source = base
        self.ours._state_on(self.grads[0].device)  # its device state exists before the first step
        self.saved = (self.ref.mean, self.ref.var, self.ref.initialized, list(self.ref.buffer)) \
            if self.ref is not None else None
        self.saved_ours = (self.ours.steps, self.ours._buffer, self.ours._mean, self.ours._var)
        self.saved_ours = tuple(t.clone() if isinstance(t, torch.Tensor) else t
                                for t in self.saved_ours)

    def set_grads(self, src, factor: float) -> None:
        torch._foreach_copy_(self.grads, src)
        if factor != 1.0:
            torch._foreach_mul_(self.grads, factor)

    def reset(self) -> None:
        """Before each timed step: the same gradients and state as the first timed step."""
        self.set_grads(self.source, self.factor)
        if self.ref is not None:
            self.ref.mean, self.ref.var, self.ref.initialized, buf = self.saved
            self.ref.buffer = list(buf)
        steps, buf, mean, var = self.saved_ours
        self.ours.steps = steps
        for mine, saved in ((self.ours._buffer, buf), (self.ours._mean, mean), (self.ours._var, var)):
            if mine is not None:
                mine.copy_(saved)

    def norm(self) -> float:
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(self.grads))))


def run(workload: str, dtype: torch.dtype, regimes: list[str], rounds: int, smoke: bool) -> list[str]:
    shapes = wl.WORKLOADS[workload]()
    if smoke:
        shapes = [(n, tuple(max(1, d // 64) for d in s)) for n, s in shapes[:12]]
    model = make_model(shapes, dtype)
    grads = [p.grad for p in model.params]
    lines = [f"**{workload}, {str(dtype).replace('torch.', '')}** ({len(shapes)} tensors, "
             f"{wl.numel(shapes) / 1e6:.1f}M elements, "
             f"{sum(g.numel() * g.element_size() for g in grads) / 1e6:.0f} MB of gradients, "
             f"{rounds} rounds)", "",
             "| regime | zclip passes | gradfuse passes | bytes ratio | zclip ms | gradfuse ms | "
             "measured ratio | clipped (zclip / gradfuse) |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    floor_t = {"R": [], "RW": []}
    one = torch.tensor(1.0)
    for regime in regimes:
        pair = Pair(model, regime, rounds)
        times = {"zclip": [], "gradfuse": []}
        clipped = {}
        for r in range(rounds + 1):  # the first round is untimed (caches, plans)
            for name, z in (("zclip", pair.ref), ("gradfuse", pair.ours)):
                if z is None:
                    continue
                pair.reset()
                before = pair.norm() if r == 0 else None
                t0 = time.perf_counter()
                z.step(pair.model)
                dt = time.perf_counter() - t0
                if r == 0:
                    clipped[name] = pair.norm() < before * (1 - 1e-6)
                else:
                    times[name].append(dt)
            if regime == regimes[0] and r > 0:  # the floors, interleaved with the first regime
                t0 = time.perf_counter()
                torch._foreach_norm(grads)
                floor_t["R"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                torch._foreach_mul_(grads, one)
                floor_t["RW"].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items() if v}
        zp, gp = PASSES[regime]
        ratio = f"{med['zclip'] / med['gradfuse']:.2f}x" if "zclip" in med else "-"
        lines.append(f"| {regime} | {zp} | {gp} | {_bytes(zp) / _bytes(gp):.2f}x | "
                     f"{med.get('zclip', float('nan')):.3f} | {med['gradfuse']:.3f} | {ratio} | "
                     f"{'yes' if clipped.get('zclip') else 'no'} / "
                     f"{'yes' if clipped.get('gradfuse') else 'no'} |")
        pair.set_grads(pair.source, 1.0)
    f = {k: statistics.median(v) * 1e3 for k, v in floor_t.items() if v}
    if f:
        lines += ["", f"floor (torch foreach, same run): one read (`_foreach_norm`) {f['R']:.3f} ms, "
                  f"one read + write (`_foreach_mul_`) {f['RW']:.3f} ms"]
    return lines + [""]


def count_ops(workload: str, regimes: list[str]) -> list[str]:
    """Operators one step dispatches (each a kernel launch on CUDA, except views and no-op
    casts), and host reads (``_local_scalar_dense``: ``.item()``), per implementation: what a
    GPU estimate starts from. Shapes are cut 64x: the counts depend on the tensor count only."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    shapes = [(n, tuple(max(1, d // 64) for d in s)) for n, s in wl.WORKLOADS[workload]()]
    lines = [f"**{workload}: operators dispatched by one step** ({len(shapes)} tensors)", "",
             "| regime | zclip ops | zclip host reads | gradfuse ops | gradfuse host reads |",
             "|---|---:|---:|---:|---:|"]
    for regime in regimes:
        pair = Pair(make_model(shapes, torch.float32), regime, 3)
        counts = {}
        for name, z in (("zclip", pair.ref), ("gradfuse", pair.ours)):
            if z is None:
                continue
            for _ in range(2):  # plans and caches first
                pair.reset()
                z.step(pair.model)
            pair.reset()
            with Count() as c:
                z.step(pair.model)
            counts[name] = (sum(c.ops.values()), c.ops["aten._local_scalar_dense"])
        z_ops, z_reads = counts.get("zclip", ("-", "-"))
        g_ops, g_reads = counts["gradfuse"]
        lines.append(f"| {regime} | {z_ops} | {z_reads} | {g_ops} | {g_reads} |")
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="gpt2_small,resnet50,tiny")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--regimes", default=",".join(PASSES))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--count-ops", action="store_true",
                    help="count the operators (CUDA launches) and host reads of one step instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = 1 if args.smoke else args.rounds
    print(f"gradfuse backend cpu: {gradfuse.backend('cpu')}; torch {torch.__version__}; "
          f"zclip {'present' if zclip is not None else 'missing'}; threads {torch.get_num_threads()}")
    if args.count_ops:
        for workload in args.workloads.split(","):
            print("\n".join(count_ops(workload, args.regimes.split(","))), flush=True)
        return 0
    for workload in args.workloads.split(","):
        for dt in args.dtypes.split(","):
            print("\n".join(run(workload, getattr(torch, dt), args.regimes.split(","), rounds,
                                args.smoke)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
