"""One process of tests/integrations/test_deepspeed.py: DeepSpeed ZeRO stages 0-3 on the CPU over
gloo. Per configuration two engines are trained side by side on the same data from the same
weights: G with ``gradfuse.attach(engine, max_norm=...)`` and D with DeepSpeed's own
``gradient_clipping``. The checks assert on every rank (gloo_checks writes "ok" or the
traceback)."""
import functools
import glob
import importlib
import json
import math
import os
import warnings

import torch
from gloo_checks import run_checks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradfuse

ACCUMULATE = 2  # micro-batches per step: the monitor runs at the boundaries only
STEPS = 3
BATCH = 4
MAX_NORM = 0.05  # small enough that every step clips
OUT_DIR = None  # set by worker: where the JSONL sinks write


def make_model():
    torch.manual_seed(0)
    # 0.weight has 91 elements: split between the two ranks' partitions (stages 1-2) and padded
    # in the second rank's ZeRO-3 partition (46 + 45).
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))


def batch(step, micro, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(BATCH, 7, generator=g).to(dtype), torch.randn(BATCH, 3, generator=g).to(dtype)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean() * 10


def make_engine(stage, dtype, clip, model=None):
    import deepspeed
    model = make_model() if model is None else model
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": ACCUMULATE,
              "gradient_clipping": clip, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


class CountCollectives(TorchDispatchMode):
    """Counts the c10d collectives dispatched inside it (all of torch.distributed's, whichever
    Python function issued them)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def counted_monitor_steps(handle):
    """Collectives per monitor step: a list that grows by one count per step."""
    counts, real = [], handle.monitor.step

    def step(*args, **kwargs):
        with CountCollectives() as c:
            out = real(*args, **kwargs)
        counts.append(len(c.ops))
        return out

    handle.monitor.step = step
    return counts


def full_weights(engine, stage):
    from deepspeed.utils import safe_get_full_fp32_param
    out = {}
    for n, p in engine.module.named_parameters():  # a collective per parameter at stage 3: every rank
        out[n] = (p.detach().float() if stage == 0 else safe_get_full_fp32_param(p)).clone()
    return out


def full_grads(engine):
    from deepspeed.utils import safe_get_full_grad
    return {n: safe_get_full_grad(p).float().clone() for n, p in engine.module.named_parameters()}


def plain_reference_rows(world):
    """The rows of the first step's averaged gradient as plain DDP gets it: the mean over every
    rank's and micro-batch's loss, on one process (fp32)."""
    model = make_model()
    losses = [loss_of(model, *batch(0, m, r)) for r in range(world) for m in range(ACCUMULATE)]
    (sum(losses) / len(losses)).backward()
    return gradfuse.stats(model).to_dict()["params"]


def assert_rows_close(ours, theirs, rtol, what):
    assert set(ours) == set(theirs), (what, sorted(ours), sorted(theirs))
    for name, row in theirs.items():
        for key, value in row.items():
            got = ours[name][key]
            if isinstance(value, int):
                assert got == value, (what, name, key, got, value)
            else:
                assert abs(got - value) <= rtol * max(abs(value), 1e-12), (what, name, key, got, value)


def check_stage(stage, dtype, rank, world):
    bf16 = dtype == torch.bfloat16
    rtol = 2e-2 if bf16 else 1e-5
    G, D = make_engine(stage, dtype, MAX_NORM), make_engine(stage, dtype, MAX_NORM)
    tag = f"stage{stage}_{'bf16' if bf16 else 'fp32'}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = gradfuse.attach(G, max_norm=MAX_NORM, every=1,
                                 sinks=[gradfuse.JsonlSink(f"{OUT_DIR}/{tag}.jsonl")])
    assert any("gradient_clipping=0.05 is off while gradfuse clips" in str(w.message) for w in caught), caught
    assert G.gradient_clipping() == 0.0 and getattr(G.optimizer, "clip_grad", 0.0) == 0.0
    assert stage == 0 or G.optimizer.clip_grad == 0.0
    collectives = counted_monitor_steps(handle)
    reference = plain_reference_rows(world) if not bf16 else None
    totals = []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            x, y = batch(step, micro, rank, dtype)
            for engine in (G, D):
                engine.backward(loss_of(engine, x, y))
            if micro == ACCUMULATE - 1:  # the boundary: the reduced gradients, gathered whole
                if stage > 0:
                    assert all(p.grad is None for p in G.module.parameters())  # what a plain monitor would see
                full = gradfuse.tensor_stats(full_grads(G)).to_dict()["params"]
            for engine in (G, D):
                engine.step()
            assert handle.monitor.step_count == step + (micro == ACCUMULATE - 1)  # boundaries only
        s = handle.last_report.stats.to_dict()
        # The rows are those of the full averaged gradient: as safe_get_full_grad gathers it, and
        # (first step) as plain DDP averages it.
        assert_rows_close(s["params"], full, rtol, f"{tag} step {step} vs safe_get_full_grad")
        if reference is not None and step == 0:
            assert_rows_close(s["params"], reference, rtol, f"{tag} vs plain DDP")
        assert s["params"]["0.weight"]["numel"] == 91 and s["params"]["0.weight"]["l2"] > 0
        # The total norm is DeepSpeed's own (taken before its clip), and every step clipped.
        ds_norm = D.get_global_grad_norm()  # stage 0 keeps none: the full gradients' norm
        ds_norm = float(sum(row["l2"] ** 2 for row in full.values()) ** 0.5 if ds_norm is None else ds_norm)
        assert abs(s["total_norm"] - ds_norm) <= rtol * ds_norm, (tag, step, s["total_norm"], ds_norm)
        assert s["total_norm"] > 2 * MAX_NORM and s["clipped"]
        totals.append(s["total_norm"])
        # G's weights after the step are those DeepSpeed's own clipping gave D.
        ours, theirs = full_weights(G, stage), full_weights(D, stage)
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], rtol=rtol, atol=1e-3 if bf16 else 1e-6)
        assert (ours["2.bias"] - make_model()[2].bias.float()).abs().max() > 1e-3  # they moved
    # One collective per step at stages 1-3 (the rows' all-gather, clip included); none at stage 0.
    assert collectives == [0 if stage == 0 else 1] * STEPS, collectives
    check_skip(G, handle, stage, rank, dtype)
    check_checkpoint(G, handle, stage)
    handle.detach()
    assert G.gradient_clipping() == MAX_NORM and getattr(G.optimizer, "clip_grad", MAX_NORM) == MAX_NORM
    assert "step" not in G.optimizer.__dict__
    if rank == 0:
        with open(f"{OUT_DIR}/{tag}.totals.json", "w") as f:
            json.dump(totals, f)


def check_skip(G, handle, stage, rank, dtype):
    """A step the explosion policy skips is skipped DeepSpeed's way: weights unchanged,
    engine.skipped_steps counts it; the next step trains again. Stages 1-3 decide on the device:
    the report is settled by ``settle()``."""
    before, skipped = full_weights(G, stage), G.skipped_steps
    handle.monitor.explode_threshold, handle.monitor.on_explode = 1e-9, "skip"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for micro in range(ACCUMULATE):
            x, y = batch(50, micro, rank, dtype)
            G.backward(loss_of(G, x, y))
            G.step()
        assert handle.last_report.settled == (stage == 0)
        handle.monitor.settle()
    assert handle.last_report.skip and handle.last_report.anomalies == ["explode"]
    assert G.skipped_steps == skipped + 1 and handle.monitor.skipped_steps == 1
    after = full_weights(G, stage)
    assert all(torch.equal(before[n], after[n]) for n in before)
    handle.monitor.explode_threshold, handle.monitor.on_explode = None, "ignore"
    for micro in range(ACCUMULATE):
        x, y = batch(51, micro, rank, dtype)
        G.backward(loss_of(G, x, y))
        G.step()
    handle.monitor.settle()
    assert not handle.last_report.skip and G.skipped_steps == skipped + 1
    moved = full_weights(G, stage)
    assert max((moved[n] - after[n]).abs().max().item() for n in moved) > 1e-4


def check_checkpoint(G, handle, stage):
    """engine.save_checkpoint / load_checkpoint carry the monitor's state; DeepSpeed's own clip
    setting is what the checkpoint holds, and stays off while gradfuse clips."""
    import torch.distributed as dist
    path = [f"{OUT_DIR}/ckpt_stage{stage}_{G.bfloat16_enabled()}"]
    dist.broadcast_object_list(path, src=0)
    steps, skipped = handle.monitor.step_count, handle.monitor.skipped_steps
    G.save_checkpoint(path[0], tag="t")
    handle.monitor.step_count, handle.monitor.skipped_steps = 0, 0
    _, client = G.load_checkpoint(path[0], tag="t")
    assert (handle.monitor.step_count, handle.monitor.skipped_steps) == (steps, skipped)
    assert "gradfuse" not in (client or {})
    assert G.gradient_clipping() == 0.0 and getattr(G.optimizer, "clip_grad", 0.0) == 0.0
    [rank0_file] = glob.glob(f"{path[0]}/t/*mp_rank_00_model_states.pt")[:1]  # zero_pp_rank_0_... at stage 3
    ckpt = torch.load(rank0_file, weights_only=False)
    assert ckpt["gradfuse"]["step"] == steps


def check_options(rank, world):
    """What cannot be done on fragments refuses, naming the option; the flight recorder works."""
    engine = make_engine(2, torch.float32, 0.0)
    for kwargs, words in (({"noise_scale": True}, "noise_scale="), ({"update_ratios": True}, "update_ratios="),
                          ({"norm_type": 0.0}, "norm_type=0.0"), ({"agc": 0.1}, "agc=")):
        try:
            gradfuse.attach(engine, **kwargs)
        except ValueError as e:
            assert words in str(e), (kwargs, str(e))
        else:
            raise AssertionError(f"{kwargs} was not refused")
    try:
        gradfuse.attach(engine, make_model())
    except TypeError as e:
        assert "pass it alone" in str(e)
    else:
        raise AssertionError("a model with an engine was not refused")
    assert "step" not in engine.optimizer.__dict__  # nothing left behind by the refused attachments
    try:
        gradfuse.attach(engine, recorder=gradfuse.FlightRecorder(record_updates=True))
    except ValueError as e:
        assert "record_updates=True" in str(e)
    else:
        raise AssertionError("record_updates was not refused")
    check_recorder(engine, rank)


def check_recorder(engine, rank):
    """The flight recorder keeps each step's loss (handle.loss) and the full gradients' norm."""
    handle = gradfuse.attach(engine, recorder=True, every=0)
    losses, norms = [], []
    for step in range(2):
        for micro in range(ACCUMULATE):
            x, y = batch(70 + step, micro, rank)
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            if micro == ACCUMULATE - 1:
                handle.loss(loss.detach())
                losses.append(loss.item())
            engine.step()
        norms.append(float(handle.last_report.stats.total_norm))
    header, arrays = handle.monitor.recorder.unroll()
    scalars = arrays["scalars"]
    assert scalars[:, header["scalar_fields"].index("loss")].tolist() == pytest_approx(losses)
    assert scalars[:, header["scalar_fields"].index("grad_norm")].tolist() == pytest_approx(norms)
    assert min(norms) > 0
    handle.detach()


def pytest_approx(values):
    import pytest
    return pytest.approx(values, rel=1e-5)


def check_per(rank, world):
    """per="param" / "layer": each parameter (layer) of the full gradient clipped by its own norm, on
    the fragments; the weights after the step are those of plain SGD after gradfuse.clip_(..., per=)
    of the averaged gradient."""
    for stage, per in ((2, "param"), (3, "layer")):
        engine = make_engine(stage, torch.float32, 0.0)
        handle = gradfuse.attach(engine, max_norm=MAX_NORM, per=per, layer_depth=1, every=0)
        for micro in range(ACCUMULATE):
            x, y = batch(0, micro, rank)
            engine.backward(loss_of(engine, x, y))
            engine.step()
        s = handle.last_report.stats
        assert s.clip_per == per and bool(s.clipped.all()) and s.clipped.numel() == 4
        coef = dict(zip(s.names, s.clip_coef.tolist()))
        # one coefficient per parameter, or per layer ("0", "2") with layer_depth=1
        assert (coef["0.weight"] == coef["0.bias"]) == (per == "layer") and coef["0.weight"] != coef["2.weight"]
        handle.detach()
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        losses = [loss_of(model, *batch(0, m, r)) for r in range(world) for m in range(ACCUMULATE)]
        (sum(losses) / len(losses)).backward()
        gradfuse.clip_(model, MAX_NORM, per=per, layer_depth=1)
        optimizer.step()
        ours = full_weights(engine, stage)
        for name, p in model.named_parameters():
            torch.testing.assert_close(ours[name], p.detach(), rtol=1e-5, atol=1e-6)
            assert (p.detach() - make_model().get_parameter(name)).abs().max() > 1e-4  # moved


def check_zclip(rank, world):
    """A ZClip max_norm takes the full gradients' total norm (its warm-up, its EMA, a spike
    clipped to its threshold) and scales the fragments: each step's coefficient and the weights
    are those of plain SGD after the same ZClip of the averaged gradient."""
    spike = 3  # the loss, and so the gradients, 30x: above the EMA's z threshold
    for stage in (2, 3):
        engine = make_engine(stage, torch.float32, 0.0)
        zclip = gradfuse.ZClip(warmup_steps=2, z_thresh=2.0, max_grad_norm=1e3)
        handle = gradfuse.attach(engine, max_norm=zclip, every=0)
        model, reference = make_model(), gradfuse.ZClip(warmup_steps=2, z_thresh=2.0, max_grad_norm=1e3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        coefs = []
        for step in range(5):
            scale = 30.0 if step == spike else 1.0
            for micro in range(ACCUMULATE):
                x, y = batch(step, micro, rank)
                engine.backward(loss_of(engine, x, y) * scale)
                engine.step()
            losses = [loss_of(model, *batch(step, m, r)) * scale for r in range(world) for m in range(ACCUMULATE)]
            (sum(losses) / len(losses)).backward()
            reference.step(model)
            coef = reference.last_clip_coef
            optimizer.step()
            optimizer.zero_grad()
            torch.testing.assert_close(zclip.last_total_norm, reference.last_total_norm, rtol=1e-5, atol=0)
            torch.testing.assert_close(zclip.last_clip_coef, coef, rtol=1e-5, atol=0)
            coefs.append(float(coef))
            ours = full_weights(engine, stage)
            for name, p in model.named_parameters():  # float32 sums of the 30x gradients in another order
                torch.testing.assert_close(ours[name], p.detach(), rtol=1e-5, atol=1e-5)
        handle.detach()
        assert all((p.detach() - make_model().get_parameter(n)).abs().max() > 1e-4 for n, p in model.named_parameters())
        assert coefs[:2] == [1.0, 1.0] and coefs[spike] < 0.5, coefs  # the warm-up, then the spike clipped
        assert zclip.steps == 5 and handle.monitor.counters()["clipped_steps"] == sum(c < 1 for c in coefs)


def check_activations(rank, world):
    """The activations and the NaN trace are hooks on the engine's model: each logging
    step's record has the rank's module outputs and the gradients into them (as the same monitor
    on a plain copy of the model fed the rank's micro-batches gives them), and a NaN that enters
    a forward on rank 0 is named there by its module, the step skipped on both ranks."""
    nan_at = 2
    for stage in (2, 3):
        engine = make_engine(stage, torch.float32, 0.0)
        log = f"{OUT_DIR}/activations{stage}.{rank}.jsonl"
        handle = gradfuse.attach(engine, max_norm=MAX_NORM, activations=True, trace_nonfinite=True, every=2,
                                 sinks=[gradfuse.JsonlSink(log)], sink_ranks="all")
        plain = make_model()
        alone = gradfuse.GradMonitor(plain, activations=True, every=2, sinks=[gradfuse.JsonlSink(log + ".plain")],
                                     sink_ranks="all")
        planted = {"on": False}
        engine.module[2].register_forward_pre_hook(
            lambda _m, a, planted=planted: (a[0] * math.nan,) if planted["on"] else None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skip's own warning
            for step in range(4):
                for micro in range(ACCUMULATE):
                    planted["on"] = step == nan_at and micro == 0 and rank == 0
                    x, y = batch(step, micro, rank)
                    engine.backward(loss_of(engine, x, y))
                    engine.step()
                    if step == 0:
                        loss_of(plain, x, y).backward()
                if step == 0:
                    alone.step()
                    alone.close()
            handle.detach()
        records = [json.loads(line) for line in open(log)]
        reference = json.loads(open(log + ".plain").readline())
        assert [r["step"] for r in records if "act" in r] == [0, 2], [r["step"] for r in records]
        first = records[0]
        assert set(first["act"]) == set(reference["act"]) >= {"0", "1", "2"}, first["act"].keys()
        for module, row in reference["act"].items():
            assert all(math.isclose(first["act"][module][k], v, rel_tol=1e-5, abs_tol=1e-7) for k, v in row.items()), \
                (module, first["act"][module], row)
        assert first["act_grad"] and set(first["act_grad"]) == set(reference["act_grad"])
        assert handle.monitor.skipped_steps == 1 and engine.skipped_steps == 1
        report = next(r for r in records if r["step"] == nan_at)
        assert "nonfinite" in report["anomalies"], report
        # named where it entered, module "2"'s output, on rank 0; rank 1's forward and backward were
        # finite, its gradients non-finite from the reduction
        assert report.get("first_nonfinite") == (["forward", "2"] if rank == 0 else None), report
        assert "non-finite gradients in 4 parameter(s)" in report["message"], report["message"]


def check_clip_value(rank, world):
    """clip_value=: the fragments clamped in place, the clamped counts and the statistics from
    before clamping those of the full gradients (combined over the ranks); the weights after the
    step those of plain SGD after gradfuse.clip_(..., value=) of the averaged gradient."""
    value = 0.3
    for stage in (2, 3):
        engine = make_engine(stage, torch.float32, 0.0)
        handle = gradfuse.attach(engine, clip_value=value, every=0)
        for micro in range(ACCUMULATE):
            x, y = batch(0, micro, rank)
            engine.backward(loss_of(engine, x, y))
            engine.step()
        handle.detach()
        s = handle.last_report.stats
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        losses = [loss_of(model, *batch(0, m, r)) for r in range(world) for m in range(ACCUMULATE)]
        (sum(losses) / len(losses)).backward()
        want = gradfuse.clip_(model, None, value=value)
        optimizer.step()
        clamped, want_clamped = dict(zip(s.names, s.clamped.tolist())), dict(zip(want.names, want.clamped.tolist()))
        assert clamped == want_clamped and 0 < sum(clamped.values()) < sum(p.numel() for p in model.parameters()), \
            (clamped, want_clamped)
        assert handle.monitor.counters()["clipped_steps"] == 1
        torch.testing.assert_close(s.total_norm, want.total_norm, rtol=1e-5, atol=0)  # from before clamping
        ours = full_weights(engine, stage)
        for name, p in model.named_parameters():
            torch.testing.assert_close(ours[name], p.detach(), rtol=1e-5, atol=1e-6)


def check_histogram(rank, world):
    """histogram=True: each rank's exponent histograms of its fragments, summed over the ranks,
    and the headroom from them and the full max |x|: a logging step's record holds those of the
    same monitor on a plain copy of the model given the averaged gradient, on both ranks."""
    for stage in (2, 3):
        engine = make_engine(stage, torch.float32, 0.0)
        log = f"{OUT_DIR}/histogram{stage}.{rank}.jsonl"
        handle = gradfuse.attach(engine, max_norm=MAX_NORM, histogram=True, every=1,
                                 sinks=[gradfuse.JsonlSink(log)], sink_ranks="all")
        for micro in range(ACCUMULATE):
            x, y = batch(0, micro, rank)
            engine.backward(loss_of(engine, x, y))
            engine.step()
        handle.detach()
        plain = make_model()
        losses = [loss_of(plain, *batch(0, m, r)) for r in range(world) for m in range(ACCUMULATE)]
        (sum(losses) / len(losses)).backward()
        alone = gradfuse.GradMonitor(plain, max_norm=MAX_NORM, histogram=True, every=1,
                                     sinks=[gradfuse.JsonlSink(log + ".plain")], sink_ranks="all")
        alone.step()
        alone.close()
        ours, reference = json.loads(open(log).readline()), json.loads(open(log + ".plain").readline())
        assert set(ours["exponents"]) == set(reference["exponents"]) == {"0", "2"}, ours.keys()
        for layer, entry in reference["exponents"].items():
            got = ours["exponents"][layer]
            # every element of the layer counted once, over both ranks' fragments
            numel = sum(p.numel() for n, p in plain.named_parameters() if n.startswith(layer + "."))
            assert sum(got["counts"]) == sum(entry["counts"]) == numel, (layer, got)
            # the averaged gradients agree within rounding: an element on a binade's edge may move
            a = dict(enumerate(got["counts"], got["first_bin"]))
            b = dict(enumerate(entry["counts"], entry["first_bin"]))
            assert all(abs(a.get(k, 0) - b.get(k, 0)) <= 1 for k in set(a) | set(b)), (layer, got, entry)
            for key, value in reference["headroom"][layer].items():
                assert math.isclose(ours["headroom"][layer][key], value, abs_tol=1.01 / numel), (layer, key)
        assert any(v > 0 for row in ours["headroom"].values() for v in row.values())


class Spare(nn.Module):
    """What real models have beside their used layers: an embedding tied to the output head, a
    layer with a parameter the forward never uses (``mixed.offset``), a layer it never calls
    (``spare``), and embedding rows no input token selects."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.mixed = nn.Module()
        self.mixed.scale = nn.Parameter(torch.ones(6))
        self.mixed.offset = nn.Parameter(torch.zeros(6))
        self.spare = nn.Linear(6, 3)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.body(self.embed(tokens))) * self.mixed.scale)


def spare_loss(engine, step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens, targets = torch.randint(0, 7, (BATCH, 5), generator=g), torch.randint(0, 11, (BATCH, 5), generator=g)
    return nn.functional.cross_entropy(engine(tokens).flatten(0, 1), targets.flatten()) * 10


SKIPPED = 2  # the step whose gradient gets a NaN on rank 0
SPARE_STEPS = 5


def check_skip_leaves_nothing(stage, dtype, rank, world, blocking=None):
    """A NaN in one gradient on one rank, one step: that step skipped on both ranks, every later
    step trains (the parameters that get no gradient included); the weights are those of a run in
    which the step was never taken. Stages 1-3 decide on the device by default: gradfuse reads
    nothing on the host in ``engine.step()``; stage 0 and ``blocking=True`` read the flag."""
    model = Spare()
    G, R = make_engine(stage, dtype, 0.0, model), make_engine(stage, dtype, 0.0, Spare())
    planted = {"on": False}
    model.body.weight.register_hook(lambda g: g * math.nan if planted["on"] else g)
    handles = [gradfuse.attach(e, max_norm=MAX_NORM, on_nonfinite="skip", every=0, blocking=blocking)
               for e in (G, R)]
    start = full_weights(G, stage)
    moved, reads = [], 0
    for step in range(SPARE_STEPS):
        before = full_weights(G, stage)
        for micro in range(ACCUMULATE):
            planted["on"] = step == SKIPPED and micro == 0 and rank == 0
            G.backward(spare_loss(G, step, micro, rank))
            with warnings.catch_warnings(), gradfuse.HostReads() as counted:
                warnings.simplefilter("ignore")  # the skip's own warning
                G.step()
            if step > 0:  # ZeRO-3's first step checks the partition layout once (a read per parameter)
                reads += len(counted.reads_from(gradfuse))
            if step != SKIPPED:
                R.backward(spare_loss(R, step, micro, rank))
                R.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handles[0].monitor.settle()
        report, after = handles[0].last_report, full_weights(G, stage)
        if step == SKIPPED:
            assert report.skip and report.anomalies == ["nonfinite"], (step, report.anomalies)
            assert report.stats.nonfinite_names() == ["body.weight"], report.stats.nonfinite_names()
            assert all(torch.equal(before[n], after[n]) for n in after)
        else:
            assert not report.skip and report.anomalies == [], (step, report.anomalies)
            moved.append(max((after[n] - before[n]).abs().max().item() for n in after))
    assert G.skipped_steps == 1 and handles[0].monitor.skipped_steps == 1, G.skipped_steps
    on_device = stage > 0 and blocking is not True
    assert (reads == 0) if on_device else (reads >= SPARE_STEPS - 1), (stage, blocking, reads)
    assert R.skipped_steps == 0 and R.global_steps == SPARE_STEPS - 1
    assert min(moved) > 1e-4, moved  # every step but the skipped one trained
    ours, theirs = full_weights(G, stage), full_weights(R, stage)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)
    # nothing moved what gets no gradient; what does, moved
    assert torch.equal(ours["spare.weight"], start["spare.weight"])
    assert torch.equal(ours["mixed.offset"], start["mixed.offset"])
    assert (ours["embed.weight"] - start["embed.weight"]).abs().max() > 1e-3
    for handle in handles:
        handle.detach()


def check_a_skip_deepspeed_did_not_take_raises(rank, world):
    """Decided on the device, the skip reaches DeepSpeed as the planted NaN; were it not seen,
    the step's settling says so (a RuntimeError naming the step) rather than train on silently."""
    G = make_engine(2, torch.float32, 0.0)
    handle = gradfuse.attach(G, max_norm=MAX_NORM, on_explode="skip", explode_threshold=1e-9, every=0)
    handle._plant._plant = lambda flag: None  # a configuration whose overflow check sees nothing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for micro in range(ACCUMULATE):
            x, y = batch(0, micro, rank)
            G.backward(loss_of(G, x, y))
            G.step()
        try:
            handle.detach()
        except RuntimeError as e:
            assert "DeepSpeed did not skip step 0" in str(e), e
        else:
            raise AssertionError("no RuntimeError")
    assert G.skipped_steps == 0 and handle.monitor.skipped_steps == 1


CHECKS = {
    **{f"stage{s}_fp32": functools.partial(check_stage, s, torch.float32) for s in (0, 1, 2, 3)},
    **{f"stage{s}_bf16": functools.partial(check_stage, s, torch.bfloat16) for s in (0, 1, 2, 3)},
    "options": check_options,
    "per": check_per,
    "zclip": check_zclip,
    "activations": check_activations,
    "histogram": check_histogram,
    "clip_value": check_clip_value,
    **{f"skip_spare_stage{s}_fp32": functools.partial(check_skip_leaves_nothing, s, torch.float32)
       for s in (0, 1, 2, 3)},
    "skip_spare_stage3_bf16": functools.partial(check_skip_leaves_nothing, 3, torch.bfloat16),
    "unseen_skip_raises": check_a_skip_deepspeed_did_not_take_raises,
    "skip_spare_stage2_fp32_blocking": functools.partial(check_skip_leaves_nothing, 2, torch.float32,
                                                         blocking=True),
}


def worker(rank, world, init_file, result_dir, port):
    global OUT_DIR
    OUT_DIR = result_dir
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    # The CPU accelerator builds its shared-memory op (about 100 s) on init_distributed; gloo
    # does without it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import logging

    import deepspeed
    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)

    def init(rank, world):
        deepspeed.init_distributed(dist_backend="gloo")

    run_checks(rank, world, init_file, result_dir, [("init", init), *CHECKS.items()], timeout_s=120)
