"""Clipping in the Lightning and Hugging Face integrations: gradient_clip_algorithm="value" taken
over, per=, AGC, ZClip and schedules through the callbacks (real Trainers, CPU, tiny models)."""
import pytest
import torch

import gradfuse

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lightning_harness import Probe, fit  # noqa: E402
from transformers_harness import make_trainer, train  # noqa: E402

from gradfuse.integrations.lightning import GradfuseCallback  # noqa: E402
from gradfuse.integrations.transformers import attach  # noqa: E402

CLIP_VALUE = 1.0


def _assert_same_steps(ours, ref):
    assert len(ours) == len(ref) > 0
    for a_step, b_step in zip(ours, ref):
        for a, b in zip(a_step, b_step):
            assert b.abs().sum() > 0
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lightning_value_clipping_taken_over():
    ref_probe, probe = Probe(), Probe()
    fit([ref_probe], gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value")
    cb = GradfuseCallback()
    trainer, _, logger = fit([probe, cb], gradient_clip_val=CLIP_VALUE,
                             gradient_clip_algorithm="value", log_every_n_steps=2)
    assert trainer.gradient_clip_val == CLIP_VALUE and "clip_value" not in cb.monitor_kwargs  # handed back
    _assert_same_steps(probe.stepped_grads, ref_probe.stepped_grads)
    assert cb.monitor.clip_value == CLIP_VALUE
    assert cb.monitor.clipped_steps == 8  # every step clamped some elements ...
    for grads in probe.stepped_grads:
        assert max(g.abs().max() for g in grads) <= CLIP_VALUE
        assert any((g.abs() < CLIP_VALUE).any() for g in grads)  # ... and left others alone


def test_lightning_per_layer_agc_and_zclip():
    # per="layer": the same as gradfuse.clip_ per layer on the gradients Lightning computed
    class PerLayerRef(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            gradfuse.clip_(pl_module, 0.05, per="layer")

    ref_probe, probe = Probe(), Probe()
    fit([ref_probe, PerLayerRef()])
    cb = GradfuseCallback(per="layer", on_nonfinite="ignore")
    fit([probe, cb], gradient_clip_val=0.05)  # max_norm from the Trainer, clipped per layer
    _assert_same_steps(probe.stepped_grads, ref_probe.stepped_grads)
    assert cb.monitor.per == "layer" and cb.monitor.clipped_steps == 8

    class AGCRef(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            gradfuse.adaptive_clip_grad_(pl_module.parameters(), 0.01)

    ref_probe, probe = Probe(), Probe()
    fit([ref_probe, AGCRef()])
    fit([probe, GradfuseCallback(agc=0.01)])
    _assert_same_steps(probe.stepped_grads, ref_probe.stepped_grads)

    z = gradfuse.ZClip(warmup_steps=3, max_grad_norm=1.0)
    cb = GradfuseCallback(max_norm=z, on_nonfinite="ignore")
    fit([Probe(), cb])
    assert z.steps == 8 and cb.monitor.state_dict()["zclip"]["steps"] == 8


def test_hf_per_layer_and_zclip_and_schedule(tmp_path):
    ref, ref_opt = make_trainer(tmp_path / "ref", 0.0)

    class PerLayerRef(transformers_callback()):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            gradfuse.clip_(model, 0.05, per="layer")

    ref.add_callback(PerLayerRef())
    train(ref)
    trainer, opt = make_trainer(tmp_path / "ours", 0.05)
    cb = attach(trainer, per="layer", on_nonfinite="ignore")
    train(trainer)
    _assert_same_steps(opt.stepped_grads, ref_opt.stepped_grads)
    assert cb.monitor.clipped_steps == 4

    seen = []

    def schedule(step):
        seen.append(step)
        return 0.05 if step < 3 else 0.02

    trainer, opt = make_trainer(tmp_path / "sched", 1.0)
    cb = attach(trainer, max_norm=schedule, on_nonfinite="ignore")  # replaces max_grad_norm=1.0
    train(trainer)
    assert trainer.args.max_grad_norm == 1.0 and cb.monitor.clipped_steps == 4
    assert seen == [1, 2, 3, 4]  # the Trainer's step numbers
    norms = [torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
             for grads in opt.stepped_grads]
    assert norms[:2] == pytest.approx([0.05, 0.05], rel=1e-4)
    assert norms[2:] == pytest.approx([0.02, 0.02], rel=1e-4)

    z = gradfuse.ZClip(warmup_steps=2)
    trainer, opt = make_trainer(tmp_path / "z", 0.0)
    cb = attach(trainer, max_norm=z, on_nonfinite="ignore")
    train(trainer)
    assert z.steps == 4 and z.initialized


def transformers_callback():
    from transformers import TrainerCallback
    return TrainerCallback
