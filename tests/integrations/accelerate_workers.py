"""One process of tests/integrations/test_accelerate.py: the plain accelerate loop (no Trainer),
run twice side by side on identical copies of a model, once with ``gradfuse.attach`` on the
prepared optimizer and once with ``accelerator.clip_grad_norm_``; what each saw goes to
``out_dir/rank{rank}.json``."""
import json
import os
import warnings

import torch
from torch import nn

MICRO_BATCHES = 10  # per process; with ACCUMULATE=4: steps after 4, 8 and the loader's end
ACCUMULATE = 4
BATCH = 4
MAX_NORM = 0.05  # small enough that every step clips


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def total_norm(model):
    return float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad.float()) for p in model.parameters() if p.grad is not None])))


def worker(rank, world, port, out_dir, mixed_precision):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_OFFLINE="1")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from accelerate import Accelerator

    import gradfuse

    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, mixed_precision=mixed_precision,
                              cpu=True)
    g = torch.Generator().manual_seed(1)
    n = world * MICRO_BATCHES * BATCH
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 3, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    model_g, model_a = make_model(), make_model()
    opt_g = torch.optim.SGD(model_g.parameters(), lr=0.5, momentum=0.9)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.5, momentum=0.9)
    model_g, opt_g, model_a, opt_a, loader = accelerator.prepare(model_g, opt_g, model_a, opt_a, loader)
    handle = gradfuse.attach(opt_g, model_g, max_norm=MAX_NORM, every=1,
                             sinks=[gradfuse.JsonlSink(f"{out_dir}/run{rank}.jsonl")])
    out = {"world": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
           "mixed_precision": accelerator.mixed_precision, "micro_batches": 0, "optimizer_steps": 0,
           "monitor_steps": [], "norm_before": [], "norm_after": [], "ref_norm_before": [],
           "ref_norm_after": [], "loss": [], "ref_loss": [], "max_norm": MAX_NORM}
    for x, y in loader:
        with accelerator.accumulate(model_g, model_a):
            loss = nn.functional.mse_loss(model_g(x), y) * 100
            ref_loss = nn.functional.mse_loss(model_a(x), y) * 100
            accelerator.backward(loss)
            accelerator.backward(ref_loss)
            out["micro_batches"] += 1
            out["loss"].append(float(loss))
            out["ref_loss"].append(float(ref_loss))
            if accelerator.sync_gradients:
                out["optimizer_steps"] += 1
                out["ref_norm_before"].append(float(accelerator.clip_grad_norm_(model_a.parameters(),
                                                                                MAX_NORM)))
                out["ref_norm_after"].append(total_norm(model_a))
            opt_g.step()  # gradfuse: statistics and clip first, on the steps accelerate takes
            opt_a.step()
            if accelerator.sync_gradients:
                out["norm_before"].append(float(handle.last_report.stats.total_norm))
                out["norm_after"].append(total_norm(model_g))
            out["monitor_steps"].append(handle.monitor.step_count)
            opt_g.zero_grad()
            opt_a.zero_grad()
    out["weights_max_diff"] = max(float((p - q).abs().max())
                                  for p, q in zip(model_g.parameters(), model_a.parameters()))
    out["weights_moved"] = max(float((p - q).abs().max())
                               for p, q in zip(model_g.parameters(), make_model().parameters()))
    out["clipped_steps"] = handle.monitor.clipped_steps
    handle.detach()
    accelerator.wait_for_everyone()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)
