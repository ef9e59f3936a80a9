"""The Lightning harness the integration tests share: a tiny LightningModule, an optimizer that
records the gradients it steps with, a logger that keeps the rows, a callback that plants a NaN
and sees which batches changed anything, and fit() on synthetic data (CPU)."""
import math
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import Logger  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x) - y).square().mean() * 50

    def configure_optimizers(self):
        return RecordingAdamW(self.parameters(), lr=0.01, weight_decay=0.1)


class RecordingAdamW(torch.optim.AdamW):
    """Records the gradients it really steps with: after the closure (backward, and Lightning's
    clipping in its hooks) ran, or after the scaler unscaled them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stepped_grads = []

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.stepped_grads.append([p.grad.clone() for group in self.param_groups for p in group["params"]])
        super().step()
        return loss


def loader(batches=8):
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(2 * batches, 6, generator=g),
                                        torch.randn(2 * batches, 3, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=2, shuffle=False)


class CapturingLogger(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    name = "capture"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class Probe(L.Callback):
    """Plants a NaN; records whether each batch changed the parameters and the optimizer state,
    and (through RecordingAdamW) the gradients each real step used."""

    def __init__(self, nan_batch=None):
        self.nan_batch = nan_batch
        self.changed = []
        self.params_changed = []

    def on_train_start(self, trainer, pl_module):
        self.optimizer = trainer.optimizers[0]

    @property
    def stepped_grads(self):
        return self.optimizer.stepped_grads

    def on_after_backward(self, trainer, pl_module):
        if self.nan_batch is not None and trainer.fit_loop.batch_idx == self.nan_batch:
            pl_module.net[2].weight.grad[0, 1] = math.nan

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        opt = trainer.optimizers[0]
        self._before = ([p.detach().clone() for p in pl_module.parameters()],
                        {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params, state = self._before
        opt = trainer.optimizers[0]
        same = all(torch.equal(a, b) for a, b in zip(params, pl_module.parameters()))
        same_state = state.keys() == opt.state.keys() and all(
            torch.equal(state[k][n], opt.state[k][n]) for k in state for n in state[k])
        self.changed.append(not (same and same_state))
        self.params_changed.append(not same)


def fit(callbacks, accumulate=1, batches=8, precision=None, plugins=None, ckpt_path=None,
        max_steps=-1, model=None, max_epochs=1, **trainer_kwargs):
    logger = CapturingLogger()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, max_steps=max_steps, logger=logger,
                        callbacks=callbacks, accumulate_grad_batches=accumulate, precision=precision,
                        plugins=plugins, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, **trainer_kwargs)
    model = model or Tiny()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, loader(batches), ckpt_path=ckpt_path)
    return trainer, model, logger
