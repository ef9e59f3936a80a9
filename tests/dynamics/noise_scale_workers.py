"""Code run in each gloo process of tests/dynamics/test_noise_scale.py (DDP noise-scale source)."""
import datetime
import traceback

import torch
import torch.distributed as dist
from torch import nn


def quadratic_ddp(rank, world, d, s, g_norm, batch, steps, accumulate=1, seed=0, via_attach=False):
    """Per-example loss 0.5 |w - x_i|^2, x_i ~ N(mu, s^2 I): B_simple = d s^2 / |w - mu|^2. w is
    not stepped (the gradient statistics stay those of one point). Returns the estimates, the
    number of scalar all_reduce calls and the monitor's stats passes per step. ``via_attach``:
    ``gradfuse.attach(optimizer, ddp_model, noise_scale=...)`` registers the hook and counts the
    micro-batches by itself (the optimizer's lr is 0: w stays put)."""
    import gradfuse
    torch.manual_seed(seed)  # same mu and w on every rank
    mu = torch.randn(d)
    direction = torch.nn.functional.normalize(torch.randn(d), dim=0)
    model = nn.Linear(1, d, bias=False)  # weight [d, 1]: w = weight[:, 0]
    with torch.no_grad():
        model.weight.copy_((mu + g_norm * direction)[:, None])
    ddp = nn.parallel.DistributedDataParallel(model)
    ns = gradfuse.NoiseScale(batch_size=batch, beta=0.998)
    if via_attach:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
        handle = gradfuse.attach(opt, ddp, every=0, on_nonfinite="ignore", noise_scale=ns)
    else:
        ns.register_ddp(ddp)
        mon = gradfuse.GradMonitor(ddp.module, every=0, on_nonfinite="ignore", noise_scale=ns)
    gen = torch.Generator().manual_seed(1000 + 10 * seed + rank)  # each rank its own examples
    calls = []
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        if tensor.numel() == 1:  # not a gradient bucket: the estimator's scalar
            calls.append(1)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        one = torch.ones(batch, 1)
        for _ in range(steps):
            model.weight.grad = None
            for m in range(accumulate):
                x = mu + s * torch.randn(batch, d, generator=gen)
                ctx = ddp.no_sync() if m < accumulate - 1 else torch.enable_grad()
                with ctx:
                    w = ddp(one)  # [batch, d], every row is w
                    loss = 0.5 * (w - x).square().sum(1).mean() / accumulate
                    loss.backward()
                if not via_attach:
                    mon.micro_step()
            if via_attach:
                opt.step()
                opt.zero_grad()
            else:
                mon.step()
    finally:
        dist.all_reduce = real
    if via_attach:
        handle.detach()
    v = ns.host_values()
    return {"ratio": v["noise_scale"] / (d * s * s / g_norm ** 2), "G2": v["G2"] / g_norm ** 2,
            "trSigma": v["trSigma"] / (d * s * s), "all_reduce_calls": len(calls), "steps": steps,
            "extra_passes": ns.extra_passes, "bucket_passes": ns.bucket_passes}


def worker(rank, world, init_file, result_dir, cases):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for name, kwargs in cases.items():
            try:
                out = repr(quadratic_ddp(rank, world, **kwargs))
            except Exception:
                out = "ERROR " + traceback.format_exc()
            with open(f"{result_dir}/{name}.{rank}", "w") as f:
                f.write(out)
            dist.barrier()
    finally:
        dist.destroy_process_group()
