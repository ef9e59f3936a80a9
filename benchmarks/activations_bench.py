"""What watching activations costs, per training step (forward + backward), on the CPU.

(a) a step under ``gradfuse.capture_activations`` (every module, outputs and output gradients)
    against the same step unwatched;
(b) against the hook loop it replaces: per module output and output gradient ``.mean().item()``,
    ``.std().item()``, ``.norm().item()``, ``isnan().any().item()``, the zero fraction and the
    dead units, each read with ``.item()``;
(c) an unsampled step of ``GradMonitor(activations=True)`` against the monitor without it (no
    hook is registered on such a step);
(d) ``GradMonitor(trace_nonfinite=True)`` on every step against the monitor without it, side by
    side with ``torch.autograd.detect_anomaly`` on the same step.

Every variant runs once per round, in a shuffled order, for ``--rounds`` rounds in one process;
the table gives medians and the median of the per-round ratios to the baseline of the round
(``--adjacent``: each variant runs right after a baseline step of its own, and the ratio is to
that step). Time
is the process's CPU time (one torch thread by default): on a shared machine, wall time mostly
measures the other processes; wall-time medians are shown too.

    python benchmarks/activations_bench.py [--models gpt2,resnet] [--rounds 15] [--batch N] [--smoke]
                                           [--variants capture,...]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import warnings
import weakref

import torch
from torch import nn

import gradfuse

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# -- models --------------------------------------------------------------------------------------
def gpt2(smoke: bool, batch: int | None = None):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    if smoke:
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        default, seq = 2, 8
    else:  # GPT-2 small's shape (124M parameters), random weights, no download
        config = GPT2Config()
        default, seq = 1, 64
    batch = batch or default
    model = GPT2LMHeadModel(config)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    label = f"GPT-2 {'tiny' if smoke else 'small'} (transformers, random weights), batch {batch} x {seq} tokens"
    return label, model, lambda: model(ids, labels=ids).loss


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18Style(nn.Module):
    """torchvision's ResNet-18 layout (2 basic blocks per stage), for 32x32 images."""

    def __init__(self, width=64, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        stages, cin = [], width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            stages.append(nn.Sequential(BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(smoke: bool, batch: int | None = None):
    torch.manual_seed(0)
    width, default = (4, 2) if smoke else (32, 16)
    batch = batch or default
    model = ResNet18Style(width)
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1))
    label = f"ResNet-18-style CNN (width {width}), batch {batch} x 3x32x32"
    return label, model, lambda: nn.functional.cross_entropy(model(x), y)


MODELS = {"gpt2": gpt2, "resnet": resnet}


# -- the hook loop gradfuse replaces --------------------------------------------------------------
def _outputs(output):
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        return [t for v in output.values() for t in _outputs(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in _outputs(v)]
    return []


def item_stats(t: torch.Tensor, module: nn.Module) -> dict:
    """The classic hook body: every number read with .item() (a device sync each on a GPU)."""
    dim = gradfuse.activations.capture.unit_dim(module, t)
    alive = t.ne(0)
    if t.dim() > 1:
        alive = alive.any(dim=tuple(d for d in range(t.dim()) if d != dim))
    return {"mean": t.mean().item(), "std": t.std().item() if t.numel() > 1 else float("nan"),
            "norm": t.norm().item(), "nan": t.isnan().any().item(),
            "zero_fraction": (t == 0).float().mean().item(), "dead": (~alive).sum().item()}


ITEMS_PER_TENSOR = 6


class HookLoop:
    def __init__(self, model):
        self.model = model
        self.handles, self.rows, self.tensors, self.bytes = [], [], 0, 0

    def __enter__(self):
        for name, module in self.model.named_modules():
            self.handles.append(module.register_forward_hook(self._hook(name, module)))
        return self

    def _hook(self, name, module):
        def hook(_m, _a, output):
            for t in _outputs(output):
                with torch.no_grad():
                    self.rows.append((name, item_stats(t.detach(), module)))
                self.tensors += 1
                self.bytes += t.numel() * t.element_size()
                if t.requires_grad:
                    t.register_hook(lambda g: self._grad(name, module, g))
        return hook

    def _grad(self, name, module, g):
        self.rows.append((name + " grad", item_stats(g, module)))
        self.tensors += 1
        self.bytes += g.numel() * g.element_size()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class ReadFloor:
    """The floor of any exact capture: one read of every distinct output and output gradient
    (``t.sum()``, no result kept, a value seen by the previous hook not read again, as gradfuse
    reuses its rows) and nothing else: no statistics, no dead units, no bookkeeping."""

    def __init__(self, model):
        self.model = model
        self.handles, self.last, self.bytes, self.tensors = [], [None, None], 0, 0

    def __enter__(self):
        for module in self.model.modules():
            self.handles.append(module.register_forward_hook(self._hook))
        return self

    def _read(self, t, side):
        # the very object (a weak reference, as gradfuse's memo: an id can be handed on to a
        # new gradient once the previous one is freed) at the same version
        last = self.last[side]
        if last is None or last[0]() is not t or last[1] != t._version:
            self.last[side] = (weakref.ref(t), t._version)
            t.detach().sum()
            self.bytes += t.numel() * t.element_size()
            self.tensors += 1

    def _hook(self, _m, _a, output):
        for t in _outputs(output):
            self._read(t, 0)
            if t.requires_grad:
                t.register_hook(lambda g: self._read(g, 1))

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def count_capture_bytes(model, loss_fn) -> dict:
    """What one capture step reads: the fused statistics (each distinct value once) and the
    per-unit dead-unit passes it could not skip (abs: read + write, sum: read)."""
    acts = gradfuse.activations.dead_units
    real_op, real_activity = None, acts._unit_activity
    seen = {"stats": 0, "activity": 0, "activity_passes": 0}

    def activity(t, dim):
        seen["activity"] += 3 * t.numel() * t.element_size()
        seen["activity_passes"] += 1
        return real_activity(t, dim)

    acts._unit_activity = activity
    try:
        with gradfuse.capture_activations(model) as cap:
            real_op = cap._stats_op(torch.device("cpu"))

            def op(tensors):
                seen["stats"] += sum(t.numel() * t.element_size() for t in tensors)
                return real_op(tensors)
            cap._ops[torch.device("cpu")] = op
            loss_fn().backward()
    finally:
        acts._unit_activity = real_activity
    return seen


# -- timing ---------------------------------------------------------------------------------------
def run_model(label, model, loss_fn, rounds: int, seed: int = 0, only=None,
              adjacent: bool = False) -> tuple[str, dict]:
    params = list(model.parameters())

    def zero():
        for p in params:
            p.grad = None

    def plain():
        loss_fn().backward()

    def capture():
        with gradfuse.capture_activations(model) as cap:
            loss_fn().backward()
        cap.forward.to_dict(), cap.backward.to_dict()  # the one transfer, included

    def hook_loop():
        with HookLoop(model):
            loss_fn().backward()

    def read_floor():
        with ReadFloor(model):
            loss_fn().backward()

    acts = gradfuse.activations.dead_units  # the per-unit pass and its CPU shortcuts

    def capture_no_dead_units():  # decomposition: the capture without its dead-unit passes
        real = acts._unit_activity
        acts._unit_activity = lambda t, dim: 0
        try:
            capture()
        finally:
            acts._unit_activity = real

    def capture_no_probe():  # before/after: the capture without the corner probe
        real = acts._probe_alive
        acts._probe_alive = lambda t, dim: None
        try:
            capture()
        finally:
            acts._probe_alive = real

    def hooks_only():  # decomposition: the capture's hooks and bookkeeping, reading no tensor
        cap = gradfuse.activations.ActivationCapture(model, stats=False)
        zeros = torch.zeros((1, 4), dtype=torch.int64)
        cap._rows = lambda tensors, dims: (None, zeros.expand(len(tensors), 4), None)
        cap.arm()
        try:
            loss_fn().backward()
        finally:
            cap.disarm()

    mon_plain = gradfuse.GradMonitor(model, every=10 ** 9, start_step=1, on_nonfinite="ignore")
    mon_act = gradfuse.GradMonitor(model, every=10 ** 9, start_step=1, on_nonfinite="ignore", activations=True)
    mon_trace = gradfuse.GradMonitor(model, every=10 ** 9, start_step=1, on_nonfinite="ignore",
                                     trace_nonfinite=True)
    hooks_seen = {}

    def monitored(mon, key):
        def step():
            if mon._act_hooks is not None and mon._act_hooks.trace_nonfinite:
                # the monitors share the model: the trace monitor's hooks, which its step() arms
                # for the next step, are taken off after its step (untimed) and armed again here
                # (timed; its step() arms once more: a second arm counted against it)
                mon.arm_activations(full=False)
            hooks_seen[key] = sum(len(m._forward_hooks) for m in model.modules())
            loss_fn().backward()
            mon.step()
        return step

    def anomaly():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly():
                loss_fn().backward()

    variants = {"plain": plain, "capture": capture, "capture_no_probe": capture_no_probe,
                "capture_no_dead_units": capture_no_dead_units,
                "hooks_only": hooks_only, "hook_loop": hook_loop, "read_floor": read_floor,
                "monitor": monitored(mon_plain, "monitor"),
                "monitor_activations_unsampled": monitored(mon_act, "monitor_activations_unsampled"),
                "monitor_trace": monitored(mon_trace, "monitor_trace"), "detect_anomaly": anomaly}
    if only:
        keep = set(only) | {BASELINE[k] for k in only}
        variants = {k: v for k, v in variants.items() if k in keep}
    # warm up every variant (allocator, first-call costs) and count what each side reads
    with HookLoop(model) as loop:
        loss_fn().backward()
    zero()
    with ReadFloor(model) as floor:
        loss_fn().backward()
    zero()
    with gradfuse.capture_activations(model) as cap:
        loss_fn().backward()
    zero()
    read = count_capture_bytes(model, loss_fn)
    zero()
    for fn in variants.values():
        fn()
        mon_trace._act_hooks.take()
        zero()
    times = {k: [] for k in variants}
    walls = {k: [] for k in variants}
    rng = random.Random(seed)

    def timed(k):
        w, t = time.perf_counter(), time.process_time()
        variants[k]()
        cpu, wall = time.process_time() - t, time.perf_counter() - w
        mon_trace._act_hooks.take()
        zero()
        return cpu, wall

    adjacent_base: dict = {}  # adjacent: variant -> its baseline's times, each run right before it
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        if adjacent:  # each variant right after its own baseline step: load changes over a
            order = [k for k in order if k in BASELINE]  # round cancel out of the ratio
            for k in order:
                cpu, wall = timed(BASELINE[k])
                times[BASELINE[k]].append(cpu)
                walls[BASELINE[k]].append(wall)
                adjacent_base.setdefault(k, []).append(cpu)
                cpu, wall = timed(k)
                times[k].append(cpu)
                walls[k].append(wall)
            continue
        for k in order:
            cpu, wall = timed(k)
            times[k].append(cpu)
            walls[k].append(wall)
    mon_trace.close()
    times["_adjacent"] = adjacent_base
    return report(label, times, walls, loop, cap, hooks_seen, rounds, floor, read), times


def report(label, times, walls, loop, cap, hooks_seen, rounds, floor, read) -> str:
    return partial_report(label, times, walls, loop, cap, rounds, floor, read, hooks_seen)


BASELINE = {"capture": "plain", "capture_no_probe": "plain", "capture_no_dead_units": "plain", "hooks_only": "plain",
            "hook_loop": "plain", "read_floor": "plain", "detect_anomaly": "plain",
            "monitor_activations_unsampled": "monitor", "monitor_trace": "monitor"}
TITLES = {"plain": "plain forward+backward", "capture": "(a) capture_activations, every module",
          "capture_no_probe": "  capture without the corner probe (before/after)",
          "capture_no_dead_units": "  capture without its dead-unit passes (decomposition)",
          "hooks_only": "  capture's hooks and bookkeeping only, no tensor read (decomposition)",
          "hook_loop": "(b) hook loop with .item()",
          "read_floor": "floor: one t.sum() per distinct output and output gradient, nothing else",
          "detect_anomaly": "detect_anomaly", "monitor": "monitor step (fwd+bwd+GradMonitor.step)",
          "monitor_activations_unsampled": "(c) monitor, activations=True, unsampled step",
          "monitor_trace": "(d) monitor, trace_nonfinite=True"}


def partial_report(label, times, walls, loop, cap, rounds, floor, read, hooks_seen) -> str:
    """The table for the variants run (all, or ``--variants``), each against its baseline of the
    round. Bytes: gradfuse's counted from the ops as run (the fused statistics on each distinct
    value, 3 N per dead-unit pass taken); the hook loop's per activation/gradient byte N (fp32:
    a bool is N/4): mean N, std N, norm N, isnan N + N/4 + any N/4, ==0 N + N/4, .float() N/4 + N,
    mean N, ne(0) N + N/4, any N/4 = 9.75 N."""
    adjacent = times.pop("_adjacent", None) or {}
    med = {k: statistics.median(v) for k, v in times.items()}
    wall = {k: statistics.median(v) for k, v in walls.items()}

    def ratio(k, base):
        return statistics.median(a / b for a, b in zip(times[k], adjacent.get(k, times[base])))

    lines = [f"**{label}**: {len(cap.forward)} forward rows and {len(cap.backward)} backward rows per step, "
             f"{loop.bytes / 1e6:.1f} MB of outputs and output gradients as the hooks see them, "
             f"{floor.bytes / 1e6:.1f} MB distinct values; {rounds} rounds", "",
             "| variant | median CPU ms | median wall ms | vs its baseline (CPU time, median of "
             + ("ratios to the baseline step run right before it) |" if adjacent else "per-round ratios) |"),
             "|---|---:|---:|---:|"]
    for k in TITLES:
        if k in times:
            r = f"{ratio(k, BASELINE[k]):.3f}x" if k in BASELINE else "baseline"
            lines.append(f"| {TITLES[k]} | {1e3 * med[k]:.1f} | {1e3 * wall[k]:.1f} | {r} |")
    lines.append("")
    if {"capture", "hook_loop"} <= set(times):
        oc, ol = med["capture"] - med["plain"], med["hook_loop"] - med["plain"]
        lines.append(f"- overhead (medians): capture {100 * oc / med['plain']:.1f}% of the step, hook loop "
                     f"{100 * ol / med['plain']:.1f}%: {ol / oc if oc > 0 else float('inf'):.1f}x more than capture's")
    if "read_floor" in times:
        of = med["read_floor"] - med["plain"]
        lines.append(f"- floor (one read of every distinct value, nothing else): "
                     f"{100 * of / med['plain']:.1f}% "
                     f"of the step (medians), {ratio('read_floor', 'plain'):.3f}x by per-round ratios")
    if read is not None:
        lines.append(f"- bytes per step: floor {floor.bytes / 1e6:.0f} MB ({floor.tensors} distinct values read "
                     f"once); gradfuse {(read['stats'] + read['activity']) / 1e6:.0f} MB = fused stats "
                     f"{read['stats'] / 1e6:.0f} MB + {read['activity_passes']} dead-unit passes "
                     f"{read['activity'] / 1e6:.0f} MB (abs read+write, sum read; the other rows' dead units are "
                     f"decided by their zero count, the corner probe or the one-slice test); the hook loop ~"
                     f"{9.75 * loop.bytes / 1e6:.0f} MB (9.75 N) and {ITEMS_PER_TENSOR * loop.tensors} `.item()` calls")
    if "monitor_activations_unsampled" in times:
        lines.append("- hooks registered during an unsampled monitor step: "
                     f"{hooks_seen.get('monitor_activations_unsampled')}")
    if "monitor_trace" in times:
        lines.append(f"- trace_nonfinite vs detect_anomaly: {ratio('monitor_trace', 'monitor'):.3f}x"
                     + (f" vs {ratio('detect_anomaly', 'plain'):.3f}x" if "detect_anomaly" in times else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,resnet")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--adjacent", action="store_true",
                        help="run each variant right after its own baseline step and take the ratio "
                             "to that step (on a loaded machine, steadier than one baseline per round)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, for the test suite")
    parser.add_argument("--variants", default="",
                        help="comma list of variants to time (their baselines are added): capture, "
                             "hook_loop, read_floor, detect_anomaly, monitor_activations_unsampled, "
                             "monitor_trace; default: all")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, steadier than 2)")
    parser.add_argument("--batch", type=int, default=None,
                        help="batch size (default: 1 sequence of 64 tokens for GPT-2, 16 images for "
                             "the CNN); the issue asks for steps of 0.2-1 s")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, gradfuse backend "
          f"{gradfuse.backend('cpu')}")
    for name in args.models.split(","):
        label, model, loss_fn = MODELS[name](args.smoke, args.batch)
        only = [v for v in args.variants.split(",") if v]
        unknown = set(only) - set(BASELINE)
        if unknown:
            parser.error(f"--variants: unknown {sorted(unknown)}; choose from {sorted(BASELINE)}")
        text, _ = run_model(label, model, loss_fn, args.rounds, only=only, adjacent=args.adjacent)
        print(text + "\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
