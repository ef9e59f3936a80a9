"""gradfuse.attach in the plain accelerate loop (``accelerator.prepare``, ``accelerator.accumulate``,
``accelerator.backward``, no Trainer), in place of ``accelerator.clip_grad_norm_``: one process
and two processes (gloo), without and with bf16 mixed precision. An identical copy of the model
is trained side by side with ``accelerator.clip_grad_norm_`` as the reference."""
import json
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytest.importorskip("accelerate")

import gradfuse  # noqa: E402

import accelerate_workers as W  # noqa: E402


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
