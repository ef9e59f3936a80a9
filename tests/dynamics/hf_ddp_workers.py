"""One rank of tests/dynamics/test_transformers_ddp_noise.py: the HF Trainer under DDP on CPU (gloo)."""
import json
import os
import warnings

import torch
from torch import nn

D, BATCH, STEPS = 64, 4, 300


class Quadratic(nn.Module):
    """Per-example loss 0.5 |w - x_i|^2 (B_simple = D / |w - mu|^2 = 16); lr 0 keeps w fixed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mu = torch.randn(D)
        self.w = nn.Parameter(self.mu + 2.0 * nn.functional.normalize(torch.randn(D), dim=0))

    def forward(self, x):
        return {"loss": 0.5 * (self.w - x).square().sum(1).mean()}


class Rows(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"x": self.data[i]}


def worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), HF_HUB_OFFLINE="1")
    warnings.simplefilter("ignore")
    from transformers import Trainer, TrainingArguments

    from gradfuse.integrations.transformers import attach
    model = Quadratic()
    g = torch.Generator().manual_seed(3)
    data = model.mu + torch.randn(world * BATCH * STEPS, D, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    args = TrainingArguments(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=BATCH,
                             logging_steps=100, report_to=[], use_cpu=True, disable_tqdm=True,
                             save_strategy="no", dataloader_num_workers=0, seed=0,
                             ddp_backend="gloo", remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(data),
                      optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
    cb = attach(trainer, noise_scale=True)
    try:
        trainer.train()
    finally:
        # Without this, a rank could leave with gloo's threads still running: rank 0 once ended in
        # "terminate called without an active exception" (SIGABRT) after a finished run.
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    ns = cb.monitor.noise_scale
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"values": ns.host_values(), "updates": ns.updates, "ddp": ns._ddp_group is not None,
                   "bucket_passes": ns.bucket_passes, "extra_passes": ns.extra_passes,
                   "batch_size": ns.batch_size, "world": trainer.args.world_size,
                   "logged": [h.get("grad/noise_scale") for h in trainer.state.log_history
                              if "loss" in h]}, f)
