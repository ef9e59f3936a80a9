"""GradfuseCallback(noise_scale=True) under Lightning's DDP (ddp_spawn, 2 CPU processes, gloo):
the callback registers the bucket-norm communication hook, and the estimate on the quadratic
problem of tests/dynamics/test_noise_scale.py (B_simple = d s^2 / |w - mu|^2) is within 10%."""
import json
import math
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")
import torch.distributed as dist  # noqa: E402

from gradfuse.integrations.lightning import GradfuseCallback  # noqa: E402

D, BATCH, STEPS = 64, 4, 300


class Quadratic(L.LightningModule):
    """Per-example loss 0.5 |w - x_i|^2; the optimizer's lr is 0, so w stays where G = w - mu."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mu = torch.randn(D)
        self.w = nn.Parameter(self.mu + 2.0 * nn.functional.normalize(torch.randn(D), dim=0))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return 0.5 * (self.w - x).square().sum(1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Report(L.Callback):
    def __init__(self, gradfuse_cb, out_dir):
        self.gradfuse_cb, self.out_dir = gradfuse_cb, out_dir

    def on_train_end(self, trainer, pl_module):
        ns = self.gradfuse_cb.monitor.noise_scale
        with open(f"{self.out_dir}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({"values": ns.host_values(), "updates": ns.updates, "ddp": ns._ddp_group is not None,
                       "bucket_passes": ns.bucket_passes, "extra_passes": ns.extra_passes,
                       "batch_size": ns.batch_size}, f)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_lightning_ddp_spawn_noise_scale_within_10_percent(tmp_path):
    g = torch.Generator().manual_seed(3)
    model = Quadratic()
    data = model.mu.detach() + torch.randn(2 * BATCH * STEPS, D, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=BATCH)
    cb = GradfuseCallback(noise_scale=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1,
                        callbacks=[cb, Report(cb, str(tmp_path))], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader)
    truth = D / 4.0
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["ddp"] and out["batch_size"] == BATCH
        assert out["updates"] == STEPS and out["bucket_passes"] == STEPS and out["extra_passes"] == 0
        assert math.isfinite(out["values"]["noise_scale"])
        assert out["values"]["noise_scale"] == pytest.approx(truth, rel=0.10)
