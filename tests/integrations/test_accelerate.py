"""gradfuse.attach in the plain accelerate loop (``accelerator.prepare``, ``accelerator.accumulate``,
``accelerator.backward``, no Trainer), in place of ``accelerator.clip_grad_norm_``: one process
and two processes (gloo), without and with bf16 mixed precision. An identical copy of the model
is trained side by side with ``accelerator.clip_grad_norm_`` as the reference."""
import json
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytest.importorskip("accelerate")

import accelerate_workers as W  # noqa: E402

import gradfuse  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path, world, mixed_precision):
    mp.spawn(W.worker, args=(world, free_port(), str(tmp_path), mixed_precision), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def check_rank(out, world, mixed_precision):
    steps = math.ceil(W.MICRO_BATCHES / W.ACCUMULATE)  # the loader's end closes the last one
    assert out["world"] == world and out["mixed_precision"] == mixed_precision
    assert out["micro_batches"] == W.MICRO_BATCHES
    assert out["optimizer_steps"] == steps
    # The monitor steps once per optimizer step, on the micro-batch that takes it, never on the others.
    expected, n = [], 0
    for i in range(W.MICRO_BATCHES):
        n += (i + 1) % W.ACCUMULATE == 0 or i + 1 == W.MICRO_BATCHES
        expected.append(n)
    assert out["monitor_steps"] == expected
    # The accumulated gradients were clipped to max_norm, as accelerator.clip_grad_norm_ clips them.
    assert out["clipped_steps"] == steps
    assert all(b > 2 * W.MAX_NORM for b in out["norm_before"])
    assert out["norm_after"] == pytest.approx([W.MAX_NORM] * steps, rel=1e-4)
    assert out["ref_norm_after"] == pytest.approx([W.MAX_NORM] * steps, rel=1e-4)
    assert out["norm_before"] == pytest.approx(out["ref_norm_before"], rel=1e-4)
    # Same training: the same losses and weights as the copy clipped by accelerate.
    tol = 1e-2 if mixed_precision == "bf16" else 1e-5
    assert out["loss"] == pytest.approx(out["ref_loss"], rel=tol)
    assert out["weights_max_diff"] < tol * 0.1 and out["weights_moved"] > 1e-3


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_loop_one_process(tmp_path, mixed_precision):
    [out] = run(tmp_path, 1, mixed_precision)
    check_rank(out, 1, mixed_precision)
    records = [json.loads(line) for line in (tmp_path / "run0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]  # one record per optimizer step (every=1)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_loop_two_processes_gloo(tmp_path, mixed_precision):
    outs = run(tmp_path, 2, mixed_precision)
    for out in outs:
        check_rank(out, 2, mixed_precision)
        assert out["distributed_type"].endswith("MULTI_CPU")
    # Gradients are all-reduced before the monitor runs: both ranks saw the same norms.
    assert outs[0]["norm_before"] == pytest.approx(outs[1]["norm_before"], rel=1e-5)
    # Sinks write on rank 0 only by default (GradMonitor's sink_ranks=0).
    records = [json.loads(line) for line in (tmp_path / "run0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]  # one record per optimizer step (every=1)
    assert (tmp_path / "run1.jsonl").read_text() == ""


def test_attach_recognises_the_accelerated_optimizer():
    """Without processes: attach gates the AcceleratedOptimizer, passes its micro-steps through."""
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState, GradientState

    from gradfuse.integrations.pytorch import accelerate_parts
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert accelerate_parts(opt) is None
    try:
        from accelerate import Accelerator
        Accelerator(cpu=True)
        wrapped = AcceleratedOptimizer(opt, device_placement=False)
        inner, state, scaler = accelerate_parts(wrapped)
        assert inner is opt and scaler is None and state is wrapped.gradient_state
        with gradfuse.attach(wrapped, model, max_norm=1.0, every=0) as handle:
            model(torch.randn(3, 4)).sum().backward()
            state._set_sync_gradients(False)
            wrapped.step()
            assert handle.monitor.step_count == 0
            state._set_sync_gradients(True)
            wrapped.step()
            assert handle.monitor.step_count == 1
        assert "step" not in wrapped.__dict__
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_accelerate_scaler_is_taken_and_its_bookkeeping_kept():
    """fp16 in accelerate needs a GPU; its AcceleratedOptimizer with a GradScaler is built here by
    hand on the CPU: attach takes that scaler, unscales fused with its statistics, clips as
    scaler.unscale_ + clip_grad_norm_ would, and a step its policy skips still updates the scaler."""
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState, GradientState
    try:
        from accelerate import Accelerator
        Accelerator(cpu=True)

        def setup():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
            opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       device_placement=False, scaler=scaler)
            return model, opt, scaler

        g = torch.Generator().manual_seed(2)
        batches = [torch.randn(5, 4, generator=g) * 10 for _ in range(4)]
        model, opt, scaler = setup()
        ref_model, ref_opt, ref_scaler = setup()
        handle = gradfuse.attach(opt, model, max_norm=0.5, every=0, explode_threshold=1e6,
                                 on_explode="skip")
        assert handle.scaler is scaler and handle.monitor.scaler is scaler
        for x in batches:
            scaler.scale(model(x).square().sum()).backward()
            opt.step()
            opt.zero_grad()
            ref_scaler.scale(ref_model(x).square().sum()).backward()
            ref_scaler.unscale_(ref_opt.optimizer)
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
            for p, q in zip(model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(p, q)
        assert handle.monitor.step_count == 4 and handle.monitor.clipped_steps == 4
        assert scaler.get_scale() == ref_scaler.get_scale()
        # A step the policy skips: no update, and the scaler is ready for the next step.
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(model(batches[0]).square().sum() * 1e9).backward()
        opt.step()
        assert handle.last_report.skip and handle.last_report.anomalies == ["explode"]
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        opt.zero_grad()
        scaler.scale(model(batches[1]).square().sum()).backward()
        unscaled = float(torch.linalg.vector_norm(torch.stack(
            [p.grad.norm() for p in model.parameters()]))) / scaler.get_scale()
        opt.step()  # the scaler was updated after the skip: these gradients are unscaled again
        assert not handle.last_report.skip
        assert float(handle.last_report.stats.total_norm) == pytest.approx(unscaled, rel=1e-5)
        handle.detach()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()



def train_with_a_nan_at_step_2(accelerator, model, opt, sched):
    """Four steps of a prepared loop, a NaN in step 2's input: the learning rate after each
    step, and whether the step changed the weights."""
    lrs, taken = [], []
    for i in range(4):
        x = torch.randn(3, 4)
        if i == 2:
            x[0, 0] = math.nan
        before = model.weight.detach().clone()
        accelerator.backward(model(x).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
        taken.append(not torch.equal(before, model.weight))
    return lrs, taken

def test_a_skipped_step_does_not_advance_the_prepared_scheduler():
    """accelerator.prepare(model, optimizer, scheduler): a step gradfuse skips (non-finite
    gradients) is not taken, and accelerate's scheduler, which steps only when the optimizer's
    step was not skipped, stays where it is, as after an fp16 overflow; the steps around it move
    the learning rate as in a loop without the bad batch."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    try:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        handle = gradfuse.attach(opt, model, every=0, on_nonfinite="skip")
        lrs, taken = train_with_a_nan_at_step_2(accelerator, model, opt, sched)
        assert taken == [True, True, False, True] and handle.monitor.skipped_steps == 1
        assert lrs == pytest.approx([0.05, 0.025, 0.025, 0.0125])
        assert not opt.step_was_skipped  # the last step was taken
        handle.detach()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.parametrize("blocking", [None, False], ids=["default", "blocking=False"])
def test_with_an_optimizer_that_skips_on_the_device(blocking):
    """A fused AdamW (its step takes the skip on the device) prepared with its scheduler. By
    default the monitor decides on the host, so that accelerate's scheduler, which reads
    step_was_skipped there, stays put at a skip. With blocking=False gradfuse reads nothing of a
    step: the skip is the optimizer's, on the device, and the scheduler is not told of it (it
    advances, as in a loop without accelerate)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from sync_guard import SyncGuard
    try:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        handle = gradfuse.attach(opt, model, every=0, on_nonfinite="skip",
                                 **({} if blocking is None else {"blocking": blocking}))
        guard = SyncGuard(allowed=None, host_copies=True)
        with pytest.warns(RuntimeWarning, match="gradfuse step 2: optimizer step skipped"), guard:
            lrs, taken = train_with_a_nan_at_step_2(accelerator, model, opt, sched)
            handle.detach()
        assert taken == [True, True, False, True] and handle.monitor.skipped_steps == 1
        assert handle.monitor._defers is (blocking is False)
        if blocking is False:
            assert guard.reads_from(gradfuse) == []
            assert lrs == pytest.approx([0.05, 0.025, 0.0125, 0.00625])
        else:
            assert len(guard.reads_from(gradfuse)) >= 4
            assert lrs == pytest.approx([0.05, 0.025, 0.025, 0.0125])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _accelerated_run(order, attached, out_dir=None, steps=4):
    """A plain accelerate loop (a LambdaLR scheduler, SGD, one process) built in ``order``, with
    ``gradfuse.attach`` (clipping every step) or without it; returns what it left behind."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    try:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def scheduler(o):
            return torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s)

        def attach(o):
            return gradfuse.attach(o, model, max_norm=0.05, every=0) if attached else None

        handle = None
        if order == "scheduler_then_prepare":  # the usual order: prepare(model, optimizer, scheduler)
            sched = scheduler(opt)
            model, opt, sched = accelerator.prepare(model, opt, sched)
            handle = attach(opt)
        elif order == "scheduler_on_prepared":  # as the Trainer does: on the AcceleratedOptimizer
            model, opt = accelerator.prepare(model, opt)
            sched = accelerator.prepare(scheduler(opt))
            handle = attach(opt)
        else:  # "attach_then_scheduler"
            model, opt = accelerator.prepare(model, opt)
            handle = attach(opt)
            sched = accelerator.prepare(scheduler(opt))
        g = torch.Generator().manual_seed(1)
        lrs, norms = [], []
        for _ in range(steps):
            accelerator.backward(model(torch.randn(6, 4, generator=g) * 10).square().sum())
            norms.append(None if attached else float(accelerator.clip_grad_norm_(model.parameters(), 0.05)))
            opt.step()
            sched.step()
            opt.zero_grad()
            lrs.append(sched.get_last_lr()[0])
        if out_dir is not None:
            accelerator.save_state(str(out_dir))
        result = {"lrs": lrs, "norms": norms, "skipped": accelerator.optimizer_step_was_skipped,
                  "steps": sched.scheduler._step_count,
                  "params": [p.detach().clone() for p in model.parameters()]}
        if handle is not None:
            result["clipped"] = handle.monitor.clipped_steps
            handle.detach()
        return result
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("order", ["scheduler_then_prepare", "scheduler_on_prepared", "attach_then_scheduler"])
def test_scheduler_state_and_results_as_without_gradfuse(tmp_path, order):
    """In every order of building scheduler, accelerate's wrappers and attach: no warning (torch's
    scheduler warnings included, as errors), and what accelerate saves (save_state), returns
    (optimizer_step_was_skipped, the scheduler's learning rates and counts) and trains is what the
    same loop clipped by accelerator.clip_grad_norm_ gives, but for the clip's rounding."""
    ref = _accelerated_run(order, attached=False, out_dir=tmp_path / "ref")
    ours = _accelerated_run(order, attached=True, out_dir=tmp_path / "ours")
    assert all(n > 0.05 for n in ref["norms"]) and ours["clipped"] == 4  # clipped at every step
    assert ours["lrs"] == ref["lrs"] and ours["steps"] == ref["steps"]
    assert ours["skipped"] is ref["skipped"] is False
    for p, q in zip(ours["params"], ref["params"]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "ref"))
    for name in ("optimizer.bin", "scheduler.bin"):
        mine, theirs = (torch.load(tmp_path / run / name, weights_only=False) for run in ("ours", "ref"))
        if name == "scheduler.bin":
            assert mine == theirs
        else:
            assert mine["param_groups"] == theirs["param_groups"]
            for k in theirs["state"]:
                torch.testing.assert_close(mine["state"][k], theirs["state"][k], rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("error")
def test_the_handle_is_saved_and_loaded_with_accelerates_state(tmp_path):
    """accelerator.register_for_checkpointing(handle): save_state / load_state carry the monitor's
    step number and counters."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    try:
        accelerator = Accelerator(cpu=True)
        model = nn.Linear(4, 2)
        model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        handle = gradfuse.attach(opt, model, max_norm=1e-3, every=0)
        accelerator.register_for_checkpointing(handle)

        def step():
            accelerator.backward(model(torch.randn(3, 4)).sum())
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            step()
        accelerator.save_state(str(tmp_path))
        saved = handle.state_dict()
        step()
        assert handle.state_dict() != saved
        accelerator.load_state(str(tmp_path))
        assert handle.state_dict() == saved and saved["step"] == 3 and saved["clipped_steps"] == 3
        handle.detach()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
