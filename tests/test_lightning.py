"""GradfuseCallback against the real Lightning Trainer (CPU, a tiny module, synthetic data)."""
import math
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import Logger  # noqa: E402

from gradfuse.integrations.lightning import GradfuseCallback  # noqa: E402

MAX_NORM = 0.05


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


@pytest.mark.parametrize("accumulate", [1, 2])
def test_clip_matches_lightnings_own_and_accumulation(accumulate):
    """Same gradients stepped as with Lightning's gradient_clip_val, once per optimizer step."""
    ref_probe, probe = Probe(), Probe()
    fit([ref_probe], accumulate, gradient_clip_val=MAX_NORM)
    cb = GradfuseCallback()  # takes over gradient_clip_val
    trainer, _, logger = fit([probe, cb], accumulate, gradient_clip_val=MAX_NORM, log_every_n_steps=2)
    assert trainer.gradient_clip_val == MAX_NORM  # handed back after the fit
    steps = 8 // accumulate
    assert len(probe.stepped_grads) == len(ref_probe.stepped_grads) == steps
    for ours, ref in zip(probe.stepped_grads, ref_probe.stepped_grads):
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    mon = cb.monitor
    assert mon.step_count == steps and mon.clipped_steps == steps  # every step really clipped
    assert all(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])) <= MAX_NORM * 1.0001
               for grads in probe.stepped_grads)
    # log_every_n_steps=2: Lightning's own cadence and step numbers (its loss rows share them).
    grad_rows = [(step, m) for step, m in logger.rows if "grad/total_norm" in m]
    assert [step for step, _ in grad_rows] == [s for s in range(steps) if (s + 1) % 2 == 0]
    row = grad_rows[-1][1]
    assert row["grad/clipped_steps"] == (grad_rows[-1][0] + 1) and row["grad/clip_coef"] < 1
    assert {"grad_l2/net.0", "grad_l2/net.2", "grad_zero_fraction/net.0", "grad_nonfinite/net.2"} <= set(row)


def test_planted_nan_is_skipped_and_logged():
    probe, cb = Probe(nan_batch=3), GradfuseCallback(max_norm=1.0)
    with pytest.warns(RuntimeWarning, match=r"step 3: optimizer step skipped: .*net\.2\.weight \(nan=1") as rec:
        trainer, _, logger = fit([probe, cb], log_every_n_steps=50)
    assert [w.filename for w in rec if "skipped" in str(w.message)] == [__file__]  # the fit() line
    # Batch 3 changed nothing (parameters, AdamW moments and step count); the others did.
    assert probe.changed == [True, True, True, False, True, True, True, True]
    assert len(probe.stepped_grads) == 7
    mon = cb.monitor
    assert (mon.skipped_steps, mon.nonfinite_steps, mon.step_count) == (1, 1, 8)
    events = [(step, m) for step, m in logger.rows if m.get("grad/skipped") == 1.0]
    assert [step for step, _ in events] == [3]  # the anomaly reached the logger when it happened
    assert events[0][1]["grad_nonfinite/net.2"] == 1.0 and events[0][1]["grad/nonfinite_steps"] == 1.0


def test_amp_16_mixed_overflow_left_to_the_scaler():
    """A 16-mixed precision plugin with a GradScaler: Lightning unscales before the hook; an Inf
    is an AMP overflow for the scaler to skip, not an anomaly, and the scale backs off."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    probe, cb = Probe(nan_batch=2), GradfuseCallback(max_norm=MAX_NORM)
    probe_ref = Probe()
    fit([probe_ref], plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler(
        "cpu", init_scale=2.0**8))], batches=4, gradient_clip_val=MAX_NORM)
    fit([probe, cb], plugins=[plugin], batches=4)
    mon = cb.monitor
    assert (mon.amp_overflow_steps, mon.anomaly_steps, mon.skipped_steps) == (1, 0, 0)
    assert probe.changed == [True, True, False, True] and scaler.get_scale() < 2.0**8
    for step in (0, 1):  # before the overflow: unscaled and clipped as Lightning does it
        for a, b in zip(probe.stepped_grads[step], probe_ref.stepped_grads[step]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_checkpoint_resume_continues_steps_and_counts(tmp_path):
    cb = GradfuseCallback(max_norm=1.0)
    trainer, model, _ = fit([Probe(nan_batch=1), cb], max_steps=4)
    assert cb.monitor.state_dict()["skipped_steps"] == 1
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    cb2 = GradfuseCallback(max_norm=1.0)
    trainer2, _, logger = fit([cb2], max_steps=8, ckpt_path=str(path), log_every_n_steps=1,
                               max_epochs=2)
    state = cb2.monitor.state_dict()
    assert (state["step"], state["skipped_steps"], state["nonfinite_steps"]) == (8, 1, 1)
    steps = [step for step, m in logger.rows if "grad/total_norm" in m]
    assert steps == [4, 5, 6, 7]  # numbering continues
