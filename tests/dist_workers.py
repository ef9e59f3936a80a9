"""Code run in each process of the distributed tests (spawned by core/test_distributed.py and
clip/test_fsdp2_torch_clip.py)."""
import contextlib
import copy
import math

import torch
import torch.distributed as dist
from gloo_checks import run_checks
from torch import nn

import gradfuse


def full(t):
    """A DTensor's full value (a collective: call on every rank), anything else as it is."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def close(a, b, rtol=1e-5, atol=1e-8):
    torch.testing.assert_close(torch.as_tensor(full(a), dtype=torch.float64),
                               torch.as_tensor(full(b), dtype=torch.float64), rtol=rtol, atol=atol,
                               equal_nan=True)


@contextlib.contextmanager
def counting_all_reduces():
    """Counts torch.distributed.all_reduce calls (gradfuse.distributed looks it up per call)."""
    calls = []
    real = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(kwargs.get("op"))
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = real


@contextlib.contextmanager
def functional_all_reduces():
    """Counts c10d_functional.all_reduce calls (what torch's FSDP2 clip test counts)."""
    from torch.distributed.tensor.debug import CommDebugMode
    with CommDebugMode() as comm_mode:
        yield lambda: comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]


def assert_total_like_torch(ours, theirs):
    """The total norm as torch returns it for DTensor gradients: a DTensor, same mesh and
    placements, same full value."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    assert isinstance(ours, DTensor), type(ours)
    if theirs is None:  # torch has no such total here (check_mesh2d): the caller compares values
        return
    # torch 2.6 returns _NormPartial placements: for a finite order an unreduced total
    # (p-th powers summed on read) where newer torch returns it Replicate, and
    # _NormPartial("max"/"min") where newer torch has Partial("max"/"min"). gradfuse returns
    # the newer form on every version, of the same full value (docs/supported-versions.md).
    def newer(pl):
        if type(pl).__name__ != "_NormPartial":
            return pl
        return Replicate() if pl.reduce_op == "sum" else Partial(pl.reduce_op)
    want = tuple(newer(pl) for pl in theirs.placements)
    assert ours.placements == want, (ours.placements, theirs.placements)
    assert ours.device_mesh == theirs.device_mesh
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    close(ours.full_tensor(), theirs.full_tensor())


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
    t_total = nn.utils.clip_grad_norm_(theirs, 0.1)
    assert_total_like_torch(gradfuse.clip_grad_norm_(ours, 0.1), t_total)
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
    assert_total_like_torch(gradfuse.clip_(model, max_norm=1e-3).total_norm, t_total)
    close(nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor(), 1e-3, rtol=1e-4)
    # the monitor clips the shards too (its policy flag reads the DTensor total)
    report = gradfuse.GradMonitor(model, max_norm=1e-4, explode_threshold=1e9).step()
    assert not report.skip and not report.anomalies
    close(nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor(), 1e-4, rtol=2e-3)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):  # tanh: no gradient element is exactly 0, so negative orders are not 0
        return x + self.down(torch.tanh(self.up(x)))


def check_fsdp2_clip(rank, world):
    """PyTorch's FSDP2 clip-grad-norm test (test_fully_shard_clip_grad_norm_.py) with gradfuse
    clipping the sharded model: against a full replica clipped by torch, for orders beyond
    torch's (2, 1, inf); the total norm a DTensor placed as torch places it; 2 collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for norm_type in (2.0, 1.0, math.inf, 0.0, -1.0, -math.inf):
        torch.manual_seed(42)
        # no empty shard on 4 ranks: torch's inf norm raises on one (gradfuse's does not)
        model = nn.Sequential(nn.Linear(6, 8), Block(8), Block(8), nn.Linear(8, 4))
        ref_model = copy.deepcopy(model)
        for block in (model[1], model[2]):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(42 + rank + 1)
        for _ in range(2):
            inp = torch.randn(4, 6)
            ref_model.zero_grad()
            model.zero_grad()
            ref_model(inp).sum().backward()
            model(inp).sum().backward()
            for p in ref_model.parameters():  # what replicate()/DDP does: average over ranks
                dist.all_reduce(p.grad)
                p.grad /= world
            ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
            local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
            for ref_grad, param in zip(ref_grads, model.parameters()):
                close(ref_grad, param.grad.full_tensor())
            ref_total = nn.utils.get_total_norm(ref_grads, norm_type)
            max_norm = float(ref_total) / 2  # clipping is never vacuous
            t_total = nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
            close(nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm, norm_type), ref_total)
            with counting_all_reduces() as calls, functional_all_reduces() as functional:
                total = gradfuse.clip_grad_norm_(model.parameters(), max_norm, norm_type)
            if norm_type > 0:  # the total alone: one functional scalar all-reduce, as torch
                assert not calls and functional() == 1, (calls, functional())
            else:  # rows reduced: one sharded layout on one mesh dimension, 2 collectives
                assert len(calls) == 2 and functional() == 0, (calls, functional())
            assert_total_like_torch(total, t_total)
            close(total.full_tensor(), ref_total)
            for param, ref_param, local in zip(model.parameters(), ref_model.parameters(), local_grads):
                close(param.grad.full_tensor(), ref_param.grad)
                if bool((local != 0).any()):
                    assert not torch.equal(param.grad.to_local(), local)


def check_mesh2d(rank, world):
    """A 2-d mesh (data x tensor parallel) with gradients sharded on either, both or neither
    dimension: placements (Partial(max)/Partial(min) for +-inf where some gradient is sharded),
    values and clipped shards as torch's; 2 collectives per sharded layout and dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world // 2, 2))
    layouts = {"a": [Shard(0), Replicate()], "b": [Shard(0), Shard(1)],
               "c": [Replicate(), Shard(0)], "d": [Replicate(), Replicate()]}
    g = torch.Generator().manual_seed(7)
    full_grads = {n: torch.randn(6, 4, generator=g) for n in layouts}

    def params():
        out = []
        for n, layout in layouts.items():
            p = nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, layout))
            p.grad = distribute_tensor(full_grads[n].clone(), mesh, layout)
            out.append(p)
        return out

    # rows: 2 per sharded layout and mesh dimension: layouts a, b (two sharded dims), c; d is
    # replicated. The total alone (p > 0): one functional scalar all-reduce per layout and dim.
    expected_all_reduces = 2 * (1 + 2 + 1)
    for norm_type in (2.0, math.inf, -math.inf, 1.0, 0.0, -1.0, 3.0):
        ref = nn.utils.get_total_norm(list(full_grads.values()), norm_type)
        ours, theirs = params(), params()
        try:
            t_total = nn.utils.clip_grad_norm_(theirs, float(ref) / 2, norm_type)
        except NotImplementedError as e:
            # torch 2.6: no DTensor total norm of order 0 (_NormPartial raises "Unsupported
            # norm type"); the total is then compared with ref below.
            if "Unsupported norm type" not in str(e):
                raise
            t_total = None
        if t_total is None or any(type(pl).__name__ == "_NormPartial" and pl.reduce_op == "sum"
                                  for pl in t_total.placements):
            # torch 2.6 also clips with the total left unreduced (_NormPartial): its
            # max_norm / (total + 1e-6) adds the 1e-6 to each rank's partial value, off by
            # ~1e-6 / total (1.5e-4 for order -1 here). The reference for the clipped gradients
            # is then torch on the full gradients, distributed as ours.
            clipped = {n: nn.Parameter(torch.zeros(6, 4)) for n in layouts}
            for n, q in clipped.items():
                q.grad = full_grads[n].clone()
            nn.utils.clip_grad_norm_(list(clipped.values()), float(ref) / 2, norm_type)
            for b, (n, layout) in zip(theirs, layouts.items()):
                b.grad = distribute_tensor(clipped[n].grad, mesh, layout)
        with counting_all_reduces() as calls, functional_all_reduces() as functional:
            total = gradfuse.clip_grad_norm_(ours, float(ref) / 2, norm_type)
        if norm_type > 0:
            assert not calls and functional() == 1 + 2 + 1, (calls, functional())
        else:
            assert len(calls) == expected_all_reduces and functional() == 0, calls
        assert_total_like_torch(total, t_total)
        close(total.full_tensor(), ref)
        for a, b, before in zip(ours, theirs, params()):
            close(a.grad.to_local(), b.grad.to_local())
            assert not torch.equal(a.grad.to_local(), before.grad.to_local())  # it clipped
        s = gradfuse.stats(params(), norm_type=norm_type)
        assert_total_like_torch(s.total_norm, t_total)
        assert_total_like_torch(gradfuse.clip_(params(), 1.0, norm_type).total_norm, t_total)
        assert_total_like_torch(gradfuse.get_total_norm([p.grad for p in params()], norm_type),
                                t_total)
        # the split: a DTensor total norm from either library scales the shards as torch
        for total_norm in (total, t_total):
            if total_norm is None:
                continue
            split = params()
            gradfuse.clip_grads_with_norm_(split, float(ref) / 2, total_norm)
            for a, b in zip(split, theirs):
                close(a.grad.to_local(), b.grad.to_local())


# FSDP2 (fully_shard) on CPU: torch 2.6's torch.cpu.Stream has no record_event, which
# fully_shard's all-gather calls ("'Stream' object has no attribute 'record_event'"); torch 2.8
# has it (docs/supported-versions.md). Checks that need it are not run where it is missing.
FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")
NEEDS_FSDP2 = ("fsdp2", "fsdp2_clip")
FSDP2_SKIP_REASON = (f"torch {torch.__version__}: FSDP2 (fully_shard) on CPU needs torch >= 2.8 "
                     "(torch.cpu.Stream.record_event, missing in torch 2.6)")

CHECKS = {"dtensor": check_dtensor, "group": check_group, "fsdp2": check_fsdp2,
          "fsdp2_clip": check_fsdp2_clip, "mesh2d": check_mesh2d}


def worker(rank, world, init_file, checks, result_dir):
    run_checks(rank, world, init_file, result_dir, [(name, CHECKS[name]) for name in checks])
