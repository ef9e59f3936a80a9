"""Code run in each process of the distributed tests (spawned by test_distributed.py)."""
import math
import traceback

import torch
import torch.distributed as dist
from torch import nn

import gradfuse


def close(a, b, rtol=1e-5, atol=1e-8):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64),
                               torch.as_tensor(b, dtype=torch.float64), rtol=rtol, atol=atol, equal_nan=True)


def full_grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(13, 7, generator=g), "b": torch.randn(5, 9, generator=g),
            "c": torch.randn(1, 3, generator=g), "d": torch.randn(10, generator=g),
            "e": torch.randn(6, generator=g)}


def dtensor_params(mesh, grads, rank, nan_on_rank=None):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    layout = {"a": [Shard(0)], "b": [Shard(1)], "c": [Shard(0)], "d": [Replicate()], "e": None}
    params = []
    for name, g in grads.items():
        if layout[name] is None:  # a plain tensor, the same on every rank (as under DDP)
            p = nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
        else:
            p = nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, layout[name]))
            p.grad = distribute_tensor(g.clone(), mesh, layout[name])
        params.append((name, p))
    if nan_on_rank is not None and rank == nan_on_rank:
        params[1][1].grad.to_local()[0, 0] = math.nan  # "b", only in this rank's shard
    return params


def check_dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    grads = full_grads()
    params = dtensor_params(mesh, grads, rank)
    assert params[2][1].grad.to_local().numel() == (3 if rank == 0 else 0)  # an empty shard
    s = gradfuse.stats(params)
    ref = gradfuse.tensor_stats(grads)  # one process holding the full gradients
    row = {n: i for i, n in enumerate(s.names)}
    for j, name in enumerate(ref.names):
        i = row[name]
        close(s.l2[i], ref.l2[j])
        close(s.linf[i], ref.linf[j])
        close(s.mean[i], ref.mean[j])
        assert s.numel[i].item() == ref.numel[j].item(), (name, s.numel[i], ref.numel[j])
        assert s.zero_count[i].item() == ref.zero_count[j].item()
    close(s.total_norm, ref.total_norm)
    for p in (1.0, math.inf, 3.0):
        close(gradfuse.stats(params, norm_type=p).total_norm, gradfuse.tensor_stats(grads, norm_type=p).total_norm)
    # torch's clip_grad_norm_ on the same DTensors is the reference for total norm and clipping
    # (it cannot mix DTensors with plain tensors: compare on the DTensors)
    ours = [p for n, p in dtensor_params(mesh, grads, rank) if n != "e"]
    theirs = [p for n, p in dtensor_params(mesh, grads, rank) if n != "e"]
    t_total = nn.utils.clip_grad_norm_(theirs, 0.1).full_tensor()
    close(gradfuse.clip_grad_norm_(ours, 0.1), t_total)
    for a, b in zip(ours, theirs):
        close(a.grad.to_local(), b.grad.to_local())
    # NaN in one rank's shard only: every rank sees it
    params = dtensor_params(mesh, grads, rank, nan_on_rank=1)
    s = gradfuse.stats(params)
    i = s.names.index("b")
    assert s.nan_count[i].item() == 1 and bool(s.nonfinite) and math.isnan(s.l2[i].item())
    assert math.isnan(s.linf[i].item())


def check_group(rank, world):
    """Pipeline-style: each rank owns different parameters; the last owns none."""
    def own(r):
        if r == world - 1:
            return {}
        g = torch.Generator().manual_seed(100 + r)
        return {f"stage{r}.w": torch.randn(50 + r, generator=g), f"stage{r}.b": torch.randn(3, generator=g)}
    everyone = {}
    for r in range(world):
        everyone.update(own(r))
    mine = own(rank)
    params = []
    for name, g in mine.items():
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append((name, p))
    s = gradfuse.stats(params, group=dist.group.WORLD)
    assert s.scope == "rank" and s.names == list(mine)
    close(s.total_norm, gradfuse.tensor_stats(everyone).total_norm)
    assert not bool(s.nonfinite)
    s = gradfuse.stats(params, group=dist.group.WORLD, norm_type=math.inf)
    close(s.total_norm, gradfuse.tensor_stats(everyone, norm_type=math.inf).total_norm)
    before = {n: p.grad.clone() for n, p in params}
    c = gradfuse.clip_(params, max_norm=0.5, group=dist.group.WORLD)
    coef = 0.5 / (gradfuse.tensor_stats(everyone).total_norm.item() + 1e-6)
    close(c.clip_coef, min(coef, 1.0))
    for n, p in params:
        close(p.grad, before[n] * min(coef, 1.0))
    if rank == 0:
        params[0][1].grad[1] = math.nan
    s = gradfuse.stats(params, group=dist.group.WORLD)
    assert bool(s.nonfinite) and math.isnan(s.total_norm.item())


def check_fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(1 + rank)
    model(torch.randn(4, 8)).square().mean().backward()
    s = gradfuse.stats(model)
    full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    ref = gradfuse.tensor_stats(full)
    for j, name in enumerate(ref.names):
        i = s.names.index(name)
        close(s.l2[i], ref.l2[j])
        assert s.numel[i].item() == ref.numel[j].item()
    t_total = nn.utils.get_total_norm([p.grad for p in model.parameters()])
    t_total = t_total.full_tensor() if hasattr(t_total, "full_tensor") else t_total
    close(gradfuse.clip_(model, max_norm=1e-3).total_norm, t_total)
    close(nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor(), 1e-3, rtol=1e-4)


CHECKS = {"dtensor": check_dtensor, "group": check_group, "fsdp2": check_fsdp2}


def worker(rank, world, init_file, checks, result_dir):
    import datetime
    # A check failing on one rank leaves the others in a collective: time out, do not hang.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for name in checks:
            try:
                CHECKS[name](rank, world)
                status = "ok"
            except Exception:
                status = traceback.format_exc()
            with open(f"{result_dir}/{name}.{rank}", "w") as f:
                f.write(status)
            dist.barrier()
    finally:
        dist.destroy_process_group()
