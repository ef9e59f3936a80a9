"""GradfuseCallback against the real Lightning Trainer (CPU, a tiny module, synthetic data)."""
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
