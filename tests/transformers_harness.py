"""The Hugging Face harness the integration tests share: a 2-layer GPT-2 built from a config
(no downloads), synthetic tokens, an optimizer that records the gradients it steps with, a
callback that plants a NaN, and a CPU Trainer."""
import math
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402


def tiny_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RecordingAdamW(torch.optim.AdamW):
    """Records the gradients each real step uses, and the steps it took."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stepped_grads = []

    def step(self, closure=None):
        self.stepped_grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def optimizer_state(opt):
    return {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}


class PlantNaN(TrainerCallback):
    """Plants a NaN in a gradient during the backward of the update made at ``at_step`` (so that
    it is there before the Trainer computes its grad norm), and checks after that update that
    nothing moved: parameters, AdamW moments and step counts."""

    def __init__(self, at_step, opt):
        self.at_step, self.opt = at_step, opt
        self.armed = False
        self.unchanged = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        weight = model.transformer.h[1].mlp.c_fc.weight

        def plant(param):
            if self.armed:
                param.grad[2, 3] = math.nan
        weight.register_post_accumulate_grad_hook(plant)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.armed = state.global_step == self.at_step
        if self.armed:
            self.before = ([p.detach().clone() for p in model.parameters()], optimizer_state(self.opt))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at_step + 1:
            params, opt_state = self.before
            after = optimizer_state(self.opt)
            self.unchanged = (all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
                              and after.keys() == opt_state.keys()
                              and all(torch.equal(after[k][n], opt_state[k][n]) for k in after for n in after[k]))


def make_trainer(tmp_path, max_grad_norm, accumulate=2, max_steps=4, report_to=(), own_optimizer=True, **kw):
    """A Trainer of the tiny GPT-2, and its RecordingAdamW (with a constant LambdaLR built on it);
    ``own_optimizer=False``: the Trainer makes its optimizer and scheduler itself (returns None)."""
    model = tiny_gpt2()
    opt = RecordingAdamW(model.parameters(), lr=1e-2, weight_decay=0.1) if own_optimizer else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0) if own_optimizer else None
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulate, logging_steps=1, report_to=list(report_to),
        use_cpu=True, disable_tqdm=True, max_grad_norm=max_grad_norm,
        dataloader_num_workers=0, seed=0, **{"save_strategy": "no", **kw})
    return Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched)), opt


def train(trainer, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(**kw)
