"""Code run in each process of tests/clip/test_clip_ddp.py: the double-clip check of GradMonitor and
gradfuse.attach under DDP (gloo, CPU), one check per (gradient_as_bucket_view, entry point)."""
import re
import warnings

import torch
import torch.distributed as dist
from gloo_checks import run_checks
from torch import nn

import gradfuse


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _backward(ddp, rank, scale=10.0):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + rank))
    (ddp(x).square().mean() * scale).backward()


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def check_double_clip(rank, world, bucket_view: bool, via: str):
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    if via == "attach":
        handle = gradfuse.attach(opt, model=ddp, max_norm=1.0, every=0)
        step = opt.step
        call = "gradfuse.attach"
    else:
        mon = gradfuse.GradMonitor(ddp, max_norm=1.0, every=0)
        step = mon.step
        call = r"GradMonitor.step\(\)"
    try:
        # Three plain steps (the first DDP iteration rebuilds its buckets): DDP's own write-back
        # of the averaged gradients is not a double clip.
        for _ in range(3):
            opt.zero_grad()
            _backward(ddp, rank)
            grads = _grads(model)
            mine = [g.clone() for g in grads]
            dist.all_reduce(mine[0])  # the gradients really were averaged over the ranks
            torch.testing.assert_close(grads[0] * world, mine[0])
            assert float(torch.stack([g.norm() for g in grads]).norm()) > 1.0  # clipping is due
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                step()
            after = float(torch.stack([p.grad.norm() for p in model.parameters()]).norm())
            assert abs(after - 1.0) < 1e-3, after  # and gradfuse clipped, once
        # The user's own clip after the backward: warned on every rank, naming the call.
        opt.zero_grad()
        _backward(ddp, rank)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        msgs = _runtime_warnings(step)
        assert any(re.search(call + r".*already changed in place", m) for m in msgs), msgs
    finally:
        if via == "attach":
            handle.detach()


def check_no_sync(rank, world):
    """Accumulation under no_sync, then a synchronising backward: quiet; a clip after it: warned."""
    model = _model(1)
    ddp = nn.parallel.DistributedDataParallel(model)
    mon = gradfuse.GradMonitor(ddp, max_norm=1.0, every=0)
    for _ in range(2):
        ddp.zero_grad()
        with ddp.no_sync():
            _backward(ddp, rank)
        _backward(ddp, rank)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mon.step()
    ddp.zero_grad()
    with ddp.no_sync():
        _backward(ddp, rank)
    _backward(ddp, rank)
    torch.nn.utils.clip_grad_value_(ddp.parameters(), 1e-3)  # the user's own clip, by value
    assert _runtime_warnings(mon.step), "a clip after the synchronising backward was not reported"


def _runtime_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


CHECKS = {
    "monitor_bucket_view": lambda r, w: check_double_clip(r, w, True, "monitor"),
    "monitor_copy": lambda r, w: check_double_clip(r, w, False, "monitor"),
    "attach_copy": lambda r, w: check_double_clip(r, w, False, "attach"),
    "no_sync": check_no_sync,
}


def worker(rank, world, init_file, result_dir):
    torch.set_num_threads(1)
    run_checks(rank, world, init_file, result_dir, CHECKS.items())
