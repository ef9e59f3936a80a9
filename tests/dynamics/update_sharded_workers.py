"""Run in each gloo process of tests/dynamics/test_update_sharded.py: the update statistics and
update clipping of an FSDP2-sharded model (DTensor parameters, gradients and optimizer state)
against the same model unsharded on every rank."""
import copy

import torch
from gloo_checks import run_checks
from torch import nn

import gradfuse
from gradfuse.dynamics.update_plan import plan_updates


def _models(world, make_optimizer):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 16), nn.ReLU(), nn.Linear(16, 5))  # 16 and 5 rows: uneven shards
    ref = copy.deepcopy(model)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, make_optimizer(model.parameters()), ref, make_optimizer(ref.parameters())


def _backward(model, ref, step):
    gen = torch.Generator().manual_seed(step)  # the same batch on every rank: the averaged gradient is it
    x, y = torch.randn(8, 9, generator=gen), torch.randn(8, 5, generator=gen)
    for m in (model, ref):
        nn.functional.mse_loss(m(x), y).backward()


OPTIMIZERS = [lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
              lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)]


def check_rows(rank, world):
    for make in OPTIMIZERS:
        model, opt, ref, ref_opt = _models(world, make)
        for step in range(3):
            _backward(model, ref, step)
            rows, want = plan_updates([opt]), plan_updates([ref_opt])
            torch.testing.assert_close(rows.counts, want.counts, rtol=0, atol=0)
            torch.testing.assert_close(rows.floats, want.floats, rtol=1e-5, atol=1e-12)
            assert float(rows.floats[:, 0].min()) > 0
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()


def check_clip(rank, world):
    for make in OPTIMIZERS:
        model, opt, ref, ref_opt = _models(world, make)
        limits = [gradfuse.clip_update_rms(o, 2e-3) for o in (opt, ref_opt)]
        for step in range(3):
            _backward(model, ref, step)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
        assert limits[0].counts() == limits[1].counts()
        assert limits[0].counts()["update_clipped_params"] > 0


CHECKS = {"rows": check_rows, "clip": check_clip}


def worker(rank, world, init_file, checks, result_dir):
    run_checks(rank, world, init_file, result_dir, [(name, CHECKS[name]) for name in checks], timeout_s=120)
