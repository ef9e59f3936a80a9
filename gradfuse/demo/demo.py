"""The main job: a short training run on built-in data with GradMonitor watching, a planted
gradient spike and a planted NaN, the per-parameter table, a gradient-flow picture, and a timing
of gradfuse against torch.nn.utils.clip_grad_norm_ and the per-parameter hook/loop approach."""
from __future__ import annotations

import os
import statistics
import time
import warnings

import torch
from torch import nn

import gradfuse
from gradfuse.monitor.sinks import JsonlSink


class TinyTransformer(nn.Module):
    """A small encoder that learns to sort a sequence of digits (built-in data, no download)."""

    def __init__(self, vocab=10, d=64, layers=4, seq=12):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        """Logits ``[batch, seq, vocab]`` for the digit sequences ``x`` (int64 ``[batch, seq]``)."""
        h = self.embed(x) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def sorting_batch(batch, seq, generator):
    """``(x, y)``: ``batch`` random digit sequences of length ``seq``, and the same sequences sorted."""
    x = torch.randint(0, 10, (batch, seq), generator=generator)
    return x, x.sort(dim=1).values


def median_ms(fn, repeats):
    """The median wall time of ``fn()`` over ``repeats`` calls after one warm-up call, in milliseconds."""
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def hook_loop_stats(params):
    """What people write today: per-parameter norms and checks, one host sync each."""
    out = {}
    for name, p in params:
        g = p.grad
        out[name] = (g.norm().item(), g.abs().max().item(), g.mean().item(),
                     int(torch.isnan(g).sum().item()), (g == 0).float().mean().item())
    return out


def timing_table(named_params, repeats):
    """A text table: the median time of ``torch.nn.utils.clip_grad_norm_``, of per-parameter
    ``.item()`` statistics, of ``gradfuse.stats`` and of ``gradfuse.clip_`` over ``named_params``,
    each also as a multiple of ``clip_grad_norm_``'s.
    """
    params = [p for _, p in named_params]
    rows = [
        ("torch clip_grad_norm_(foreach=True)",
         median_ms(lambda: nn.utils.clip_grad_norm_(params, 1e9, foreach=True), repeats)),
        ("hook/loop: per-parameter .item() stats",
         median_ms(lambda: hook_loop_stats(named_params), repeats)),
        ("gradfuse.stats (all statistics)", median_ms(lambda: gradfuse.stats(named_params).total_norm, repeats)),
        ("gradfuse.clip_ (stats + clip, none needed)",
         median_ms(lambda: gradfuse.clip_(named_params, 1e9).total_norm, repeats)),
    ]
    base = rows[0][1]
    lines = [f"{'method':<44} {'median ms':>10} {'vs clip_grad_norm_':>19}"]
    lines += [f"{name:<44} {ms:>10.3f} {ms / base:>18.2f}x" for name, ms in rows]
    return "\n".join(lines)


def run(steps: int = 200, out_dir: str = "runs/demo", tiny: bool = False, seed: int = 0,
        timing: bool = True) -> dict:
    """Runs the demo and prints what it finds.

    Trains ``TinyTransformer`` to sort digits with ``gradfuse.attach`` on its optimizer, in the
    configuration the README recommends: every statistic on, the clip riding the optimizer's
    fused step, the decisions taken on the device (the host never waits; it hears of each step
    at the next one). A gradient spike, a NaN gradient and a NaN in a forward output are planted.
    Prints what the monitor caught, how often gradfuse's step read a value of the step on the
    host (``gradfuse.HostReads``: 0), the flight recorder's explanation of the spike, the final
    per-parameter table, the dead-layer example and the gradient noise scale; draws the pictures
    when matplotlib is installed; with ``timing``, prints the timing table.

    Args:
        steps: Optimizer steps to train.
        out_dir: Where the JSONL log (``run.jsonl``, started afresh) and the pictures go; created if
            missing.
        tiny: A smaller model, and a smaller timing workload.
        seed: Seed of the model's initialisation and of the data.
        timing: Print the timing table at the end.

    Returns:
        dict: ``caught`` (a line per anomaly step), ``skipped`` (the count of skipped steps),
            ``host_reads`` (reads of the steps' values in ``opt.step()``), ``spike_dump`` (the
            flight recorder's dump of the spike, or None), ``log``
            (the JSONL path), ``picture`` and ``activations_picture`` (paths, None without
            matplotlib), ``exponents_picture`` and ``noise_scale_picture`` (when ``picture`` was
            drawn), ``loss_first``, ``loss_last``, ``dead_layers`` and ``noise_scale`` (the
            estimate's host values, or None).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    # Each step's batch of 64 sequences is taken as 2 accumulated micro-batches of 32 (the same
    # data and, up to rounding, the same gradient as one batch of 64): the gradient noise scale
    # needs the gradient at two batch sizes, and gradient accumulation gives them.
    seq, batch, micro_batches = 12, 64, 2
    model = TinyTransformer(d=32 if tiny else 64, layers=2 if tiny else 4, seq=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, "run.jsonl")
    if os.path.exists(log_path):
        os.remove(log_path)  # the demo starts a fresh log each time
    # One line: statistics, clip and policies run inside every opt.step() below. The explosion
    # threshold is a circuit breaker: that step is skipped, not applied in a clipped form.
    # activations=True: module outputs and their gradients on logged steps (hooks on those steps
    # only); trace_nonfinite=True: names the module where a NaN first appears, on any step.
    # fused_step=True: AdamW becomes gradfuse.optim.AdamW (torch's, bit for bit), whose step
    # applies the clip and takes the skip on the device, so attach never waits (blocking=False).
    handle = gradfuse.attach(opt, model, max_norm=1.0, every=max(steps // 40, 1),
                             on_nonfinite="skip", explode_threshold=1e3, on_explode="skip",
                             sinks=[JsonlSink(log_path)], activations=True, trace_nonfinite=True,
                             # the exponent heatmap and numeric headroom on logging steps, and the
                             # gradient noise scale (attach sees the micro-batches' backward passes)
                             histogram=True,
                             noise_scale=gradfuse.NoiseScale(batch_size=batch // micro_batches,
                                                             accumulation_steps=micro_batches),
                             # update-to-weight ratios, and the last 64 steps' statistics, losses and
                             # updates kept on the device for a dump that explains an anomaly
                             update_ratios=True, fused_step=True,
                             recorder=gradfuse.FlightRecorder(dump_dir=os.path.join(out_dir, "dumps"),
                                                              record_updates=True))
    mon = handle.monitor
    spike_step, nan_step, forward_nan_step = steps // 3, (2 * steps) // 3, (5 * steps) // 6
    reports, losses = [], []
    host_reads = gradfuse.HostReads()  # counts the host's reads of values, in opt.step() below
    print(f"gradfuse demo: {sum(p.numel() for p in model.parameters()):,} parameters in "
          f"{len(list(model.parameters()))} tensors, {steps} steps; backend {gradfuse.backend('cpu')}")
    print(f"planted: a gradient spike at step {spike_step}, a NaN gradient at step {nan_step}, "
          f"a NaN in the forward output of layers.0.linear1 at step {forward_nan_step}")
    for step in range(steps):
        x, y = sorting_batch(batch, seq, gen)
        loss = 0.0
        for micro, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            plant = (model.layers[0].linear1.register_forward_hook(_plant_nan, prepend=True)
                     if step == forward_nan_step and micro == 0 else None)
            part = nn.functional.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / micro_batches
            if plant is not None:
                plant.remove()
            (part * (1e6 if step == spike_step else 1.0)).backward()
            loss = loss + part.detach()
        if step == nan_step:
            model.layers[1].linear1.weight.grad[3, 5] = float("nan")
        handle.loss(loss)  # for the flight recorder (read on the device)
        with warnings.catch_warnings(), host_reads:  # the demo prints what the monitor caught below
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()  # gradfuse runs first, and the step may be skipped (on the device)
        opt.zero_grad()
        reports.append(handle.last_report)  # filled in when the host hears of it, a step later
        losses.append(loss)
    # One more backward for a table of the final gradients.
    x, y = sorting_batch(batch, seq, gen)
    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    final = gradfuse.stats(model)
    handle.detach()  # settles and logs the last step, closes the log
    caught = [f"step {r.step}: {', '.join(r.anomalies)} -> "
              f"{'skipped the optimizer step' if r.skip else 'clipped and went on'}\n    {r.message}"
              for r in reports if r.anomalies]
    applied = [loss.item() for loss, r in zip(losses, reports) if not r.skip]
    print(f"\nloss {applied[0]:.3f} -> {applied[-1]:.3f}; the monitor caught:")
    print("\n".join("  " + c for c in caught) or "  nothing")
    print(f"  skipped steps: {mon.skipped_steps}, clipped steps: {mon.clipped_steps}, "
          f"anomaly steps: {mon.anomaly_steps}")
    print(f"  in opt.step() (statistics, clip, policies, the update) the host waited for the device "
          f"{len(host_reads.reads)} times in {steps} steps; it read {len(host_reads.copy_reads)} values "
          "from copies made without waiting, a step later")
    spike_dump = next((str(r.dump) for r in reports if r.step == spike_step and r.dump), None)
    if spike_dump is not None:
        print(f"\nthe flight recorder on the spike (python -m gradfuse explain {spike_dump}):")
        print(gradfuse.explain(gradfuse.load_dump(spike_dump)).text())
    print("\nper-parameter gradient statistics after training (top 10 by L2):")
    print(final.table(top=10))
    dead = dead_layer_demo()
    picture = act_picture = None
    try:
        from gradfuse.viz.activations import plot_activations
        from gradfuse.viz.gradflow import plot_gradflow
        # also draws gradflow_exponents.png (histogram=True) and gradflow_noise_scale.png
        picture = plot_gradflow(log_path, os.path.join(out_dir, "gradflow.png"))
        act_picture = plot_activations(log_path, os.path.join(out_dir, "gradflow_activations.png"))
    except ImportError as e:
        print(f"\n(no picture: {e})")
    extra = {}
    if picture:
        root, ext = os.path.splitext(picture)
        extra = {"exponents_picture": f"{root}_exponents{ext}", "noise_scale_picture": f"{root}_noise_scale{ext}"}
    noise = mon.noise_scale.host_values() if mon.noise_scale is not None else None
    if noise is not None:
        print(f"\ngradient noise scale (2 accumulated micro-batches of {batch // micro_batches}): "
              f"B_simple = {noise['noise_scale']:.0f} sequences (|G|^2 = {noise['G2']:.3g}, "
              f"tr(Sigma) = {noise['trSigma']:.3g}); the demo's batch is {batch}")
    print(f"\nlog: {log_path}" + (f"\npicture: {picture}" if picture else "")
          + (f"\nactivations: {act_picture}" if act_picture else "")
          + "".join(f"\n{k.split('_picture')[0].replace('_', ' ')}: {v}" for k, v in extra.items()))

    if timing:
        print_timing(tiny)
    return {"caught": caught, "skipped": mon.skipped_steps, "log": log_path, "picture": picture,
            "host_reads": len(host_reads.reads), "spike_dump": spike_dump,
            "loss_first": applied[0], "loss_last": applied[-1], "dead_layers": dead,
            "activations_picture": act_picture, "noise_scale": noise, **extra}


def _plant_nan(module, args, output):
    output = output.clone()
    output[0, 0, 0] = float("nan")
    return output


def dead_layer_demo() -> list[str]:
    """One capture of a small MLP whose second ReLU never fires (its bias was pushed to -1e3, as
    a bad initialisation or one huge update does): every unit of that layer is dead, and no
    gradient flows behind it."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():
        mlp[2].bias.fill_(-1e3)
    x, y = torch.randn(64, 12), torch.randint(0, 10, (64,))
    with gradfuse.capture_activations(mlp) as cap:
        nn.functional.cross_entropy(mlp(x), y).backward()
    print("\na dead layer, found by gradfuse.capture_activations (module outputs of a small MLP):")
    print(cap.forward.table())
    rows = cap.forward.to_dict()["params"]
    dead = [name for name, r in rows.items() if r["units"] and r["dead_units"] == r["units"]]
    grads = cap.backward.to_dict()["params"]
    print("dead layers: " + ", ".join(f"{n} ({rows[n]['dead_units']}/{rows[n]['units']} units dead)" for n in dead)
          + f"; the gradient reaching module 0's output is {100 * grads['0']['zero_fraction']:.0f}% zeros")
    return dead


def print_timing(tiny: bool) -> None:
    """Prints ``timing_table`` for GPT-2 small's gradients on the CPU (``tiny``: a 1-layer slice)."""
    from gradfuse.demo.workloads import gpt2_small, make_grads
    shapes = gpt2_small(layers=1, vocab=1000, ctx=64) if tiny else gpt2_small()
    label = "a 1-layer GPT-2 slice" if tiny else "GPT-2 small (124M fp32 gradients, 148 tensors)"
    print(f"\ntiming on {label}, {torch.get_num_threads()} CPU threads, median of repeats:")
    print(timing_table(make_grads(shapes), repeats=3 if tiny else 7))
