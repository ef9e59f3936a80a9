"""GradfuseCallback against the real Lightning Trainer (CPU, a tiny module, synthetic data)."""
import warnings

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import lightning_harness  # noqa: E402
from lightning_harness import Probe, fit  # noqa: E402

from gradfuse.integrations.lightning import GradfuseCallback  # noqa: E402

MAX_NORM = 0.05


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
    # the warning points at the harness's trainer.fit() line
    assert [w.filename for w in rec if "skipped" in str(w.message)] == [lightning_harness.__file__]
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


class Decides(lightning_harness.Tiny):
    """A configure_gradient_clipping override that decides per step: by batch index, no clip, a
    value and algorithm of its own, or Lightning's default (the Trainer's settings)."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        choice = self.plan[self.trainer.fit_loop.batch_idx % len(self.plan)]
        if choice == "default":
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        elif choice is not None:
            self.clip_gradients(optimizer, *choice)


@pytest.fixture
def torch_clips(monkeypatch):
    """The calls of torch's clipping functions (what Lightning clips with) during the test."""
    calls = []

    def spy(name):
        clip = getattr(torch.nn.utils, name)

        def clip_and_note(*args, **kwargs):
            calls.append(name)
            return clip(*args, **kwargs)
        return clip_and_note

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        monkeypatch.setattr(torch.nn.utils, name, spy(name))
    return calls


def _assert_same_steps(ours, ref):
    assert len(ours) == len(ref) > 0
    for a_step, b_step in zip(ours, ref):
        for a, b in zip(a_step, b_step):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("trainer_clip", [None, MAX_NORM])
def test_configure_gradient_clipping_override_decides(trainer_clip, torch_clips):
    """The override skips the clip, asks for another value (with the Trainer's value unset, as
    Lightning requires) or algorithm, or keeps Lightning's default: the same gradients are stepped
    as without gradfuse, each clipped once, by gradfuse (torch's clip never runs)."""
    plan = [None, "default"] if trainer_clip else [None, (0.01, "norm"), (1e-3, "value"), "default"]
    kwargs = {"gradient_clip_val": trainer_clip} if trainer_clip else {}
    ref_probe, probe = Probe(), Probe()
    fit([ref_probe], model=Decides(plan), **kwargs)
    assert torch_clips  # Lightning clipped with torch without gradfuse ...
    torch_clips.clear()
    cb = GradfuseCallback()
    trainer, _, _ = fit([probe, cb], model=Decides(plan), **kwargs)
    assert torch_clips == [] and trainer.gradient_clip_val == trainer_clip  # ... and not with it
    _assert_same_steps(probe.stepped_grads, ref_probe.stepped_grads)
    choices = [plan[step % len(plan)] for step in range(8)]
    clipped = [c for c in choices if c not in (None, "default") or (c == "default" and trainer_clip)]
    assert cb.monitor.step_count == 8 and cb.monitor.clipped_steps == len(clipped)
    for grads, choice in zip(probe.stepped_grads, choices):  # clipped as asked, or not at all
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        if choice == (0.01, "norm"):
            assert norm == pytest.approx(0.01, rel=1e-4)
        elif choice == (1e-3, "value"):
            assert max(g.abs().max() for g in grads) <= 1e-3
        elif choice == "default" and trainer_clip:
            assert norm == pytest.approx(trainer_clip, rel=1e-4)
        else:
            assert norm > 0.05


def test_conflicting_clip_values_keep_lightnings_error():
    """Trainer(gradient_clip_val=1e-4) and the module asking clip_gradients for 0.01: Lightning's
    MisconfigurationException, as without gradfuse."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    cb = GradfuseCallback()
    with pytest.raises(MisconfigurationException, match=r"gradient_clip_val=0.0001\)` and have passed"):
        fit([cb], model=Decides([(0.01,)]), gradient_clip_val=1e-4)
    assert cb.monitor.step_count == 0  # the error came first: no step, no clip


class ManualClip(lightning_harness.Tiny):
    """Manual optimization that clips (by norm) before it steps, on even batches only."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        if batch_idx % 2 == 0:
            self.clip_gradients(opt, MAX_NORM, "norm")
        opt.step()


def test_manual_optimization_clip_gradients_made_once_by_gradfuse():
    ref_probe, probe = Probe(), Probe()
    fit([ref_probe], model=ManualClip())
    cb = GradfuseCallback()
    fit([probe, cb], model=ManualClip())
    _assert_same_steps(probe.stepped_grads, ref_probe.stepped_grads)
    assert cb.monitor.step_count == 8 and cb.monitor.clipped_steps == 4


class Scheduled(lightning_harness.Tiny):
    def configure_optimizers(self):
        opt = super().configure_optimizers()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit_recording_warnings(callbacks, **kwargs):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer, model, logger = fit(callbacks, model=Scheduled(), **kwargs)
    return trainer, sorted({(w.category.__name__, str(w.message)) for w in seen})


@pytest.mark.parametrize("nan_batch", [None, 0])
def test_lr_scheduler_sees_the_step_it_wrapped(nan_batch):
    """configure_optimizers builds the scheduler before the callback gates the step: no warning
    that a fit without gradfuse does not raise (torch's "optimizer.step() has been overridden"
    among them), and the scheduler counts as it does without gradfuse, a first step that the
    policy skips included."""
    ref_trainer, ref_warnings = _fit_recording_warnings([Probe()], gradient_clip_val=MAX_NORM)
    trainer, ours = _fit_recording_warnings([Probe(nan_batch=nan_batch), GradfuseCallback()],
                                            gradient_clip_val=MAX_NORM)
    skipped = [w for w in ours if "optimizer step skipped" in w[1]]
    assert [w for w in ours if w not in skipped] == ref_warnings
    assert len(skipped) == (nan_batch is not None)
    sched, ref_sched = trainer.lr_scheduler_configs[0].scheduler, ref_trainer.lr_scheduler_configs[0].scheduler
    assert (sched._step_count, sched.last_epoch, sched.get_last_lr()) == (
        ref_sched._step_count, ref_sched.last_epoch, ref_sched.get_last_lr())
    assert hasattr(trainer.optimizers[0].step, "_wrapped_by_lr_sched")  # the scheduler's wrapper, back


class ClipsInItsHook(lightning_harness.Tiny):
    """Clips the gradients itself in on_before_optimizer_step (before Lightning's clipping path)."""

    def on_before_optimizer_step(self, optimizer):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


def _double_clip_warnings(seen):
    return [w for w in seen if "already changed in place" in str(w.message)]


def test_double_clip_warned_on_steps_gradfuse_clips_only():
    """A module that clips in its own hook before gradfuse clips: warned once. An override of
    configure_gradient_clipping that changes the gradients itself and asks for no clip (as one of
    Lightning's own tests does): gradfuse clips nothing and does not warn. 16-mixed: the scaler's
    unscale is no double clip."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class ClampsItself(lightning_harness.Tiny):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            for p in self.parameters():
                p.grad.clamp_(min=0, max=1e-2)

    cases = [(ClipsInItsHook(), {}, 1), (ClampsItself(), {}, 0),
             (lightning_harness.Tiny(), {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler(
                 "cpu", init_scale=2.0**8))]}, 0)]
    for model, kwargs, expected in cases:
        cb = GradfuseCallback()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fit([cb], model=model, gradient_clip_val=MAX_NORM, **kwargs)
        assert len(_double_clip_warnings(seen)) == expected, type(model).__name__
        assert cb.monitor.clipped_steps == (0 if isinstance(model, ClampsItself) else 8)


class SkipsOddBatches(lightning_harness.Tiny):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


class CountingScaler(torch.amp.GradScaler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"unscale_": 0, "step": 0, "update": 0}

    def unscale_(self, optimizer):
        self.calls["unscale_"] += 1
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, *args, **kwargs):
        self.calls["update"] += 1
        return super().update(*args, **kwargs)


def test_amp_training_step_returning_none_leaves_the_scaler_to_lightning():
    """16-mixed with a training_step that returns None on some batches: Lightning skips their
    backward, unscale and scaler step; gradfuse runs on the other steps only, and the scaler is
    called as without gradfuse (an unscale of its own would make Lightning's next one raise)."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    counts, records = [], []
    sink = type("Rows", (), {"write": lambda self, record: records.append(record["step"])})()
    for callbacks in ([], [GradfuseCallback(sinks=[sink])]):
        scaler = CountingScaler("cpu", init_scale=2.0**8)
        fit(callbacks, model=SkipsOddBatches(), plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
            gradient_clip_val=MAX_NORM, log_every_n_steps=1)
        counts.append(scaler.calls)
    assert counts[0] == counts[1] == {"unscale_": 4, "step": 4, "update": 4}
    assert len(records) == 4 and callbacks[0].monitor.clipped_steps == 4


class SteppedOnTheDevice(lightning_harness.Tiny):
    """An optimizer whose step takes the skip on the device, and an LR scheduler stepped per batch."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def configure_optimizers(self):
        import gradfuse
        params = dict(lr=0.01, weight_decay=0.1)
        opt = (gradfuse.optim.AdamW(self.parameters(), **params) if self.kind == "gradfuse.optim"
               else torch.optim.AdamW(self.parameters(), fused=True, **params))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _same_rows(a, b) -> bool:
    """Logger rows equal, a NaN equal to a NaN."""
    def same(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)
    return len(a) == len(b) and all(
        sa == sb and ma.keys() == mb.keys() and all(same(ma[k], mb[k]) for k in ma) for (sa, ma), (sb, mb) in zip(a, b))


@pytest.mark.parametrize("kind", ["gradfuse.optim", "torch fused"])
def test_the_default_never_waits_where_the_optimizer_takes_the_skip(kind):
    """With an optimizer that takes the skip on the device the callback decides there by default:
    gradfuse reads nothing of a step on the host (against the same fit with blocking=True), the
    planted NaN step is not applied, and the weights, the optimizer state, the LR scheduler, the
    counters and what the logger got are those of the blocking fit (the skip's row one step later
    on the host, under its own step number)."""
    from sync_guard import SyncGuard

    import gradfuse
    runs = {}
    for mode in ("blocking", "default"):
        probe = Probe(nan_batch=3)
        cb = GradfuseCallback(max_norm=MAX_NORM, **({"blocking": True} if mode == "blocking" else {}))
        guard = SyncGuard(allowed=None, host_copies=True)
        with pytest.warns(RuntimeWarning, match=r"step 3: optimizer step skipped: .*net\.2\.weight"), guard:
            trainer, model, logger = fit([probe, cb], model=SteppedOnTheDevice(kind), log_every_n_steps=2)
        runs[mode] = trainer, model, logger, cb, guard, probe
    (tb, mb, lb, cbb, gb, pb), (td, md, ld, cbd, gd, pd) = runs["blocking"], runs["default"]
    assert cbd.monitor._defers and not cbb.monitor._defers
    assert gd.reads_from(gradfuse) == [] and len(gb.reads_from(gradfuse)) >= 8  # one decision per step at least
    assert cbd.monitor.counters() == cbb.monitor.counters() and cbd.monitor.skipped_steps == 1
    assert cbd.last_report.settled and cbd.last_report.step == 7
    assert pd.params_changed == pb.params_changed == [True, True, True, False, True, True, True, True]
    assert all(torch.equal(a, b) for a, b in zip(mb.parameters(), md.parameters(), strict=True))
    sb, sd = tb.optimizers[0].state_dict()["state"], td.optimizers[0].state_dict()["state"]
    assert len(sd) == 4 and all(torch.equal(torch.as_tensor(sb[k][n]), torch.as_tensor(sd[k][n]))
                                for k in sb for n in sb[k])
    sched_b, sched_d = (t.lr_scheduler_configs[0].scheduler for t in (tb, td))
    assert (sched_d.last_epoch, sched_d.get_last_lr()) == (sched_b.last_epoch, sched_b.get_last_lr())
    assert (sched_d.last_epoch, sched_d.get_last_lr()) == (8, [0.01 / 16])
    assert any(m.get("grad/skipped") == 1.0 for _, m in ld.rows) and _same_rows(ld.rows, lb.rows)
