"""The methods the benchmarks compare, each computing what it claims, and the bytes each must
move through memory (for achieved GB/s): N is the gradients' size in bytes."""
from __future__ import annotations

import math

import torch
from torch import nn

import gradfuse

HUGE = 1e30  # a max_norm that never clips


def torch_clip_foreach(named):
    params = [p for _, p in named]
    return lambda: nn.utils.clip_grad_norm_(params, HUGE, foreach=True)


def torch_clip_loop(named):
    params = [p for _, p in named]
    return lambda: nn.utils.clip_grad_norm_(params, HUGE, foreach=False)


def hook_loop(named):
    """What gradfuse replaces: a hook per parameter clones its gradient as autograd produces it,
    then a Python loop computes each statistic with .item() (a host sync per value)."""
    captured = {}

    def make_hook(name):
        def hook(grad):
            captured[name] = grad.detach().clone()
        return hook

    hooks = [(make_hook(name), p) for name, p in named]

    def run():
        for hook, p in hooks:  # what autograd would do during backward
            hook(p.grad)
        out = {}
        for name, g in captured.items():
            out[name] = (g.norm().item(), g.abs().max().item(), g.mean().item(),
                         int(torch.isnan(g).sum().item()), (g == 0).float().mean().item())
        return out

    return run


def torch_foreach_stats(named):
    """The best plain-PyTorch way to the same statistics without a sync per parameter:
    foreach norms, stacked per-tensor reductions, one transfer at the end."""
    grads = [p.grad for _, p in named]

    def run():
        l2 = torch.stack(torch._foreach_norm(grads, 2.0))
        linf = torch.stack(torch._foreach_norm(grads, math.inf))
        sums = torch.stack([g.sum(dtype=torch.float32) for g in grads])
        nans = torch.stack([g.isnan().sum() for g in grads])
        zeros = torch.stack([(g == 0).sum() for g in grads])
        total = torch.linalg.vector_norm(l2.float())
        return torch.cat([l2.float(), linf.float(), sums, nans.float(), zeros.float(), total[None]]).cpu()

    return run


def gradfuse_stats(named):
    return lambda: gradfuse.stats(named).total_norm


def gradfuse_clip_noclip(named):
    return lambda: gradfuse.clip_(named, HUGE).total_norm


def gradfuse_clip_grad_norm(named):
    params = [p for _, p in named]
    return lambda: gradfuse.clip_grad_norm_(params, HUGE)


def gradfuse_watch_stats(named):
    g = gradfuse.watch(named)  # resolved once; the benchmark's warm-up round makes the plan
    return lambda: g.stats().total_norm


def gradfuse_watch_clip(named):
    g = gradfuse.watch(named)
    return lambda: g.clip_(HUGE).total_norm


def gradfuse_monitor_step(named):
    """GradMonitor.step() with max_norm set, no policy and no logging: a training loop's cost."""
    mon = gradfuse.GradMonitor(named, max_norm=HUGE, every=0, on_nonfinite="ignore")
    return lambda: mon.step()


def stats_op(named):
    """The fused op alone on the gradients: per-tensor rows, norm 2 (what every entry point runs)."""
    grads = [p.grad for _, p in named]
    return lambda: gradfuse.ops.multi_tensor_stats(grads, 2.0)


def moments_op(named):
    """The same pass with the stable second moment (activation std): its cost over stats_op."""
    grads = [p.grad for _, p in named]
    return lambda: gradfuse.ops.multi_tensor_moments(grads)


def memory_read(named):
    """The machine's read bandwidth on as many bytes as the gradients: a float32 sum."""
    src = torch.ones(grad_bytes(named) // 4, dtype=torch.float32, device=named[0][1].grad.device)
    return lambda: src.sum()


def memory_copy(named):
    """The machine's copy bandwidth on as many bytes as the gradients (read + write)."""
    src = torch.ones(grad_bytes(named) // 4, dtype=torch.float32, device=named[0][1].grad.device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


# name -> (factory, bytes moved as a multiple of N, description)
METHODS = {
    "torch_clip_foreach": (torch_clip_foreach, 3, "clip_grad_norm_(foreach=True): norm read + scale read/write"),
    "torch_clip_loop": (torch_clip_loop, 3, "clip_grad_norm_(foreach=False)"),
    "hook_loop": (hook_loop, 7, "hooks clone (r+w), then 5 reductions with .item() per parameter"),
    "torch_foreach_stats": (torch_foreach_stats, 5, "foreach norms + stacked reductions, one transfer"),
    "gradfuse_stats": (gradfuse_stats, 1, "gradfuse.stats: all statistics, one read"),
    "gradfuse_clip_noclip": (gradfuse_clip_noclip, 1, "gradfuse.clip_, no clipping needed: one read"),
    "gradfuse_clip_clipping": (None, 3, "gradfuse.clip_, clipping needed: read + scale read/write"),
    "gradfuse_clip_grad_norm_": (gradfuse_clip_grad_norm, 1, "gradfuse.clip_grad_norm_ (no clipping)"),
    "gradfuse_watch_stats": (gradfuse_watch_stats, 1, "gradfuse.watch(...).stats(): parameters resolved once"),
    "gradfuse_watch_clip": (gradfuse_watch_clip, 1, "gradfuse.watch(...).clip_(), no clipping needed"),
    "gradfuse_monitor_step": (gradfuse_monitor_step, 1, "GradMonitor.step(): max_norm set, no policy, no logging"),
    "stats_op": (stats_op, 1, "ops.multi_tensor_stats (norm 2) alone: one read"),
    "moments_op": (moments_op, 1, "ops.multi_tensor_moments alone: the same read, with sum (x - mean)^2"),
    "memory_read": (memory_read, 1, "float32 sum of N bytes: the read bandwidth"),
    "memory_copy": (memory_copy, 2, "copy of N bytes: the copy bandwidth"),
}


def grad_bytes(named) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for _, p in named)
