"""Run in each gloo process of tests/optim/test_optim_sharded.py: gradfuse.optim's step of an
FSDP2-sharded model (DTensor parameters, gradients and optimizer state) against torch's own step
of the same sharded model, bit for bit on every rank's shard; its update-statistics rows and its
update clipping against the same model unsharded on every rank."""
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


def _pair(mesh, name, kwargs):
    """An FSDP2-sharded model and the same model unsharded, each with its gradfuse.optim optimizer.
    The last layer has one output: its weight and bias are empty on rank 1's shard."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(9, 16), nn.ReLU(), nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 1))
    sharded, plain = copy.deepcopy(base), copy.deepcopy(base)
    for layer in (sharded[0], sharded[2], sharded[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    make = getattr(gradfuse.optim, name)
    return sharded, make(sharded.parameters(), **kwargs), plain, make(plain.parameters(), **kwargs)


def _backward(models, step):
    gen = torch.Generator().manual_seed(step)  # the same batch on every rank: the averaged gradient is it
    x, y = torch.randn(8, 9, generator=gen), torch.randn(8, 1, generator=gen)
    for m in models:
        nn.functional.mse_loss(m(x), y).backward()


def _rows_by_param(opt, params):
    """(floats, counts) of the latest step's rows, in the order of ``params``."""
    where = {id(p): (r, i) for r in opt.last_rows for i, p in enumerate(r.params)}
    picked = [where[id(p)] for p in params]
    return (torch.stack([r.floats[i] for r, i in picked]), torch.stack([r.counts[i] for r, i in picked]))


def check_rows(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    for name, kwargs in OPTIMIZERS:
        sharded, opt, plain, ref = _pair(mesh, name, kwargs)
        assert any(p.to_local().numel() == 0 for p in sharded.parameters()) == (rank == 1)  # an empty shard
        for step in range(3):
            _backward((sharded, plain), step)
            opt.step(stats=True)
            ref.step(stats=True)
            floats, counts = _rows_by_param(opt, list(sharded.parameters()))
            want_f, want_c = _rows_by_param(ref, list(plain.parameters()))
            local = torch.tensor([p.to_local().numel() for p in sharded.parameters()])
            assert not torch.equal(local, want_c[:, -1])  # a shard's own rows would not do
            torch.testing.assert_close(counts, want_c, rtol=0, atol=0)
            torch.testing.assert_close(floats, want_f, rtol=1e-5, atol=0)
            assert float(want_f[:, 0].min()) > 0 and float(want_f[:, 1].min()) > 0  # updates and weights
            for p, q in zip(sharded.parameters(), plain.parameters()):
                assert same_bits(p.full_tensor(), q.detach()), (name, step)
            opt.zero_grad()
            ref.zero_grad()


def check_max_update_rms(rank, world):
    """The coefficient of a DTensor comes from its whole update (where a shard's own update would
    give another): the sharded model's coefficients and weights are the unsharded model's, with
    some tensors clipped and some not. The rows are sums over chunks of float32 values, so the two
    coefficients agree to float32 rounding, and so do the clipped weights (the others, bit for bit
    until a clipped weight's rounding reaches them through the gradients)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    for name, kwargs in OPTIMIZERS:
        sharded, opt, plain, ref = _pair(mesh, name, kwargs)
        clipped = kept = 0
        shard_would_differ = False
        for step in range(3):
            _backward((sharded, plain), step)
            probe = copy.deepcopy(ref)  # the unclipped update of each tensor, for a limit between them
            for p, q in zip(probe.param_groups[0]["params"], ref.param_groups[0]["params"]):
                p.grad = q.grad
            before = [p.detach().clone() for p in probe.param_groups[0]["params"]]
            probe.step(stats=True)
            limit = 0.93 * float(probe.last_rows[0].update_rms().median())
            for p, b, s in zip(probe.param_groups[0]["params"], before, sharded.parameters()):
                u = (p.detach().double() - b.double()).reshape(p.shape[0], -1)
                mine = u[s.to_local().shape[0] * rank:][:s.to_local().shape[0]] if s.to_local().numel() else None
                if mine is not None and mine.numel():  # the coefficient this shard's own update would give
                    whole, own = (min(1.0, limit / float(t.square().mean().sqrt())) for t in (u, mine))
                    shard_would_differ |= abs(own - whole) > 1e-3 * whole
            opt.step(max_update_rms=limit)
            ref.step(max_update_rms=limit)
            coefs = torch.cat([c.coefs for c in opt.last_update_coefs])
            want = torch.cat([c.coefs for c in ref.last_update_coefs])
            torch.testing.assert_close(coefs, want, rtol=1e-6, atol=0)
            clipped += int((want < 1).sum())
            kept += int((want == 1).sum())
            for p, q, c in zip(sharded.parameters(), plain.parameters(), want.tolist()):
                # after a step, a clipped weight's rounding reaches every gradient, hence every tensor
                if c < 1 or step:
                    torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-7)
                else:
                    assert same_bits(p.full_tensor(), q.detach()), (name, step)
            opt.zero_grad()
            ref.zero_grad()
        assert clipped >= 3 and kept >= 3 and shard_would_differ, (clipped, kept, shard_would_differ)


CHECKS = {"step": check_step, "rows": check_rows, "max_update_rms": check_max_update_rms}


def worker(rank, world, init_file, checks, result_dir):
    run_checks(rank, world, init_file, result_dir, [(name, CHECKS[name]) for name in checks], timeout_s=120)
