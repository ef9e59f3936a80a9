"""No host synchronisation in the fused paths, checked on the CPU: each call runs under a
TorchDispatchMode that sees every host read a GPU would wait for (tests/sync_guard.py), after one
warm-up call without it. The checked path is the one whose ops the mode sees (a test also checks
that gradfuse's own ops were among them, so that nothing ran past the mode).

Two reads are by design and counted exactly: a monitor with a policy reads one 0-d flag per step
(the decision), and the fast clip of gradfuse.watch reads its 0-d coefficient when it lives on the
CPU (csrc/watch.cpp, scale(): no sync there; it skips the walk when nothing needs scaling). The
functional path, which the fast one hands over to, reads nothing."""
import pytest
import torch
from sync_guard import HostSync, SyncGuard
from torch import nn

import gradfuse
from gradfuse import GradMonitor
from gradfuse.core.watch import GradWatch

LOCAL_SCALAR = "aten._local_scalar_dense.default"
MAX_NORM = 1.0


def model_with_grads(scale=100.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model(torch.randn(5, 8)).square().sum().mul(scale).backward()
    return model


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(), lambda t: bool(t.sum() > 0), lambda t: int(t.sum()), lambda t: float(t.sum()),
    lambda t: t.tolist(), lambda t: t.numpy(), lambda t: torch.equal(t, t), lambda t: t.sum() > 0 and 1,
], ids=["item", "bool", "int", "float", "tolist", "numpy", "equal", "if"])
def test_the_guard_catches_each_kind_of_host_read(read):
    t = torch.ones(3)
    with pytest.raises(HostSync):
        with SyncGuard():
            read(t)
    assert "tolist" not in torch.Tensor.__dict__ and "numpy" not in torch.Tensor.__dict__  # restored
    with SyncGuard(allowed=None) as guard:
        read(t)
    assert len(guard.reads) == 1


def test_stats_and_tensor_stats():
    model = model_with_grads()
    warm = gradfuse.stats(model)
    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (5, 0, 130)]
    warm_t = gradfuse.tensor_stats(tensors)
    with SyncGuard() as guard:
        s = gradfuse.stats(model)
        t = gradfuse.tensor_stats(tensors)
    assert guard.saw_gradfuse_op()
    torch.testing.assert_close(s.total_norm, warm.total_norm, rtol=0, atol=0)
    torch.testing.assert_close(t.l2, warm_t.l2, rtol=0, atol=0)
    assert float(s.total_norm) > MAX_NORM


def test_clip_and_clip_grad_norm():
    model, twin = model_with_grads(), model_with_grads()
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
    gradfuse.clip_(model_with_grads(), MAX_NORM)  # warm-up
    with SyncGuard() as guard:
        s = gradfuse.clip_(model, MAX_NORM)
    assert guard.saw_gradfuse_op()
    torch.testing.assert_close(s.total_norm.float(), expected)
    for a, b in zip(grads(model), grads(twin)):
        torch.testing.assert_close(a, b)
    model = model_with_grads()
    with SyncGuard() as guard:
        total = gradfuse.clip_grad_norm_(list(model.parameters()), MAX_NORM, error_if_nonfinite=False)
    assert guard.saw_gradfuse_op() and isinstance(total, torch.Tensor)
    torch.testing.assert_close(total, expected)
    for a, b in zip(grads(model), grads(twin)):
        torch.testing.assert_close(a, b)


def test_watch_clip_fast_path_reads_nothing_under_a_dispatch_mode():
    """Without a dispatch mode the fast path reads a CPU coefficient (no sync) to leave gradients
    that need no scaling unwalked; under one (the guard) it reads nothing, as on a GPU, and the
    conditional scale op, which the guard sees, clips."""
    model, twin = model_with_grads(), model_with_grads()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
    watch = gradfuse.watch(model)
    watch.stats()  # plans the fast path
    with SyncGuard(allowed=None) as guard:
        s = watch.clip_(MAX_NORM)
    assert watch.last_path == "fast" and guard.reads == [] and "gradfuse.multi_tensor_scale_" in guard.seen
    assert float(s.clip_coef) < 1
    for a, b in zip(grads(model), grads(twin)):
        torch.testing.assert_close(a, b)


def test_watch_clip_functional_path(monkeypatch):
    monkeypatch.setattr(GradWatch, "_fast_ready", lambda self: False)
    model, twin = model_with_grads(), model_with_grads()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
    watch = gradfuse.watch(model)
    watch.stats()
    with SyncGuard() as guard:
        watch.clip_(MAX_NORM)
    assert watch.last_path == "python" and guard.saw_gradfuse_op()
    for a, b in zip(grads(model), grads(twin)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("policy, decisions", [(dict(on_nonfinite="ignore"), 0), ({}, 1)],
                         ids=["no_policy", "default_policy"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast_watch", "functional_watch"])
def test_monitor_step_reads_one_flag_per_decision(monkeypatch, policy, decisions, fast):
    if not fast:
        monkeypatch.setattr(GradWatch, "_fast_ready", lambda self: False)
    model = model_with_grads()
    mon = GradMonitor(model, max_norm=MAX_NORM, every=0, **policy)
    mon.step()  # warm-up (plans the watch)
    for _ in range(3):
        for p in model.parameters():
            p.grad.mul_(100)  # above max_norm again: every step clips
        with SyncGuard(allowed=None) as guard:
            mon.step()
        assert guard.saw_gradfuse_op()
        assert guard.reads == [LOCAL_SCALAR] * decisions
    assert mon.clipped_steps == 4
