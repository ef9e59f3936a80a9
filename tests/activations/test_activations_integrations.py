"""activations=True / trace_nonfinite=True through the Lightning callback and the HF Trainer
integration: hooks armed for the steps the framework logs, act/ metrics in its logs, no hook left."""
import math

import pytest


def forward_hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def test_lightning_callback_logs_activations_on_its_logged_steps():
    pytest.importorskip("lightning.pytorch")
    from lightning_harness import Tiny, fit

    from gradfuse.integrations.lightning import GradfuseCallback

    class Watch(Tiny):
        hooks_during = []

        def training_step(self, batch, batch_idx):
            self.hooks_during.append(forward_hooks(self))
            return super().training_step(batch, batch_idx)

    cb = GradfuseCallback(max_norm=1.0, activations=True)
    trainer, model, logger = fit([cb], log_every_n_steps=3, model=Watch())
    act_rows = [(step, m) for step, m in logger.rows if "act/net.0/rms" in m]
    assert [step for step, _ in act_rows] == [2, 5]  # Lightning's cadence: (step + 1) % 3 == 0
    m = act_rows[0][1]
    assert m["act/net.0/rms"] > 0 and m["act_grad/net.2/rms"] > 0 and 0 <= m["act/net.1/dead_fraction"] <= 1
    # hooks only while a logged batch ran (training_step runs inside the forward: hooks armed then)
    assert [n > 0 for n in Watch.hooks_during] == [(b + 1) % 3 == 0 for b in range(8)]
    assert forward_hooks(model) == 0


def test_lightning_trace_nonfinite_names_the_module():
    pytest.importorskip("lightning.pytorch")
    from lightning_harness import Tiny, fit

    from gradfuse.integrations.lightning import GradfuseCallback

    class Poisoned(Tiny):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 4:
                x = x.clone()
                x[0, 0] = math.inf
            return (self.net(x) - y).square().mean()

    cb = GradfuseCallback(max_norm=1.0, trace_nonfinite=True)
    with pytest.warns(RuntimeWarning, match=r"step 4: optimizer step skipped: first non-finite value in "
                                            r"the forward output of net.0 \(.*Inf"):
        fit([cb], log_every_n_steps=50, model=Poisoned())
    assert cb.last_report.first_nonfinite is None and cb.monitor.nonfinite_steps == 1


def test_hf_trainer_logs_activations_on_its_logging_steps(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments
    from transformers_harness import Tokens, tiny_gpt2, train

    from gradfuse.integrations.transformers import attach

    model = tiny_gpt2()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, logging_steps=3, report_to=[], use_cpu=True,
                             disable_tqdm=True, max_grad_norm=1.0, dataloader_num_workers=0, seed=0,
                             save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(32))
    during = []
    model.transformer.wte.register_forward_pre_hook(lambda m, a: during.append(forward_hooks(model)))
    cb = attach(trainer, activations=True)
    train(trainer)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [3, 6]
    for h in logs:
        assert h["act/transformer.h.0/rms"] > 0 and h["act_grad/lm_head/rms"] > 0
        assert "act/transformer.h.1/dead_fraction" in h
    # 2 micro-batches per update: hooks (beyond the probe's own pre-hook) only for updates 3 and 6
    assert [n > 0 for n in during] == [u in (3, 6) for u in range(1, 7) for _ in range(2)]
    assert forward_hooks(model) == 0 and cb.monitor.nonfinite_steps == 0
