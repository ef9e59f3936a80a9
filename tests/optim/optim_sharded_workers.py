"""Run in each gloo process of tests/optim/test_optim_sharded.py: gradfuse.optim's step of an
FSDP2-sharded model (DTensor parameters, gradients and optimizer state) against torch's own step
of the same sharded model, bit for bit on every rank's shard."""
import copy

import torch
from gloo_checks import run_checks
from test_optim_exact import same_bits
from torch import nn

import gradfuse.optim

OPTIMIZERS = [("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
              ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01))]


def _sharded(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_step(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    for name, kwargs in OPTIMIZERS:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(9, 16), nn.ReLU(), nn.Linear(16, 5))  # 16 and 5 rows: uneven shards
        ours, theirs = _sharded(copy.deepcopy(base), mesh), _sharded(copy.deepcopy(base), mesh)
        opt = getattr(gradfuse.optim, name)(ours.parameters(), **kwargs)
        ref = getattr(torch.optim, name)(theirs.parameters(), **kwargs)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 9, generator=gen), torch.randn(8, 5, generator=gen)
            for m in (ours, theirs):
                nn.functional.mse_loss(m(x), y).backward()
            before = [p.to_local().clone() for p in theirs.parameters()]
            opt.step()
            ref.step()
            assert any(not torch.equal(p.to_local(), b) for p, b in zip(theirs.parameters(), before))
            for p, q in zip(ours.parameters(), theirs.parameters()):
                assert type(p).__name__ == "DTensor"
                assert same_bits(p.to_local(), q.to_local()), (name, step)
            for p, q in zip(ours.parameters(), theirs.parameters()):
                for key, value in ref.state[q].items():
                    mine = opt.state[p][key]
                    assert same_bits(mine.to_local() if hasattr(mine, "to_local") else mine,
                                     value.to_local() if hasattr(value, "to_local") else value), (name, key)
            opt.zero_grad()
            ref.zero_grad()


CHECKS = {"step": check_step}


def worker(rank, world, init_file, checks, result_dir):
    run_checks(rank, world, init_file, result_dir, [(name, CHECKS[name]) for name in checks], timeout_s=120)
