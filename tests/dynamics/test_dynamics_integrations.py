"""Noise scale and update ratios through gradfuse.attach, the Lightning callback and the Hugging
Face Trainer integration (micro-batch boundaries seen by each; update ratios against copies of
the parameters taken around the real optimizer step)."""
import math

import pytest
import torch
from helpers import ListSink
from torch import nn

import gradfuse
from gradfuse.core.grad_stats import layer_of
from gradfuse.sinks import metrics


def ratios_from_copies(before, after, names):
    u2, w2 = {}, {}
    for name, b, a in zip(names, before, after):
        key = layer_of(name)
        u2[key] = u2.get(key, 0.0) + float((a.double() - b.double()).square().sum())
        w2[key] = w2.get(key, 0.0) + float(b.double().square().sum())
    return {k: math.sqrt(u2[k] / w2[k]) for k in u2}


def test_attach_sees_micro_batches_and_logs_both():
    # The quadratic problem of test_noise_scale: B_simple = d s^2 / |w - mu|^2 = 64 / 4 = 16.
    torch.manual_seed(0)
    d, batch, k = 64, 4, 4
    mu = torch.randn(d)
    w = nn.Parameter(mu + 2.0 * nn.functional.normalize(torch.randn(d), dim=0))
    opt = torch.optim.SGD([w], lr=0.0, momentum=0.9)  # lr 0: w stays where the truth is known
    sink = ListSink()
    handle = gradfuse.attach(opt, every=100, sinks=[sink], update_ratios=True,
                             noise_scale=gradfuse.NoiseScale(batch_size=batch, beta=0.998))
    gen = torch.Generator().manual_seed(5)
    for _ in range(301):
        for _ in range(k):  # no call in the loop: attach counts the backward passes
            x = mu + torch.randn(batch, d, generator=gen)
            (0.5 * (w - x).square().sum(1).mean() / k).backward()
        opt.step()
        opt.zero_grad()
    handle.detach()
    ns = handle.monitor.noise_scale
    assert ns.updates == 300  # the first step taught it that the loop accumulates
    assert ns.host_values()["noise_scale"] == pytest.approx(16.0, rel=0.10)
    last = metrics(sink.records[-1])
    assert last["grad/noise_scale"] == pytest.approx(ns.host_values()["noise_scale"])
    assert last["update_ratio/group0"] == 0.0
    assert last["weight_norm/group0"] == pytest.approx(float(w.detach().norm()), rel=1e-6)
    # detach took the backward hooks off
    w.sum().backward()
    assert ns._micro == 0


def test_attach_update_ratios_adamw_equal_copies():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sink = ListSink()
    handle = gradfuse.attach(opt, model, every=2, max_norm=1.0, sinks=[sink], update_ratios=True)
    names = [n for n, _ in model.named_parameters()]
    compared = 0
    for step in range(5):
        model(torch.randn(16, 8)).square().mean().backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            want = ratios_from_copies(before, [p.detach() for p in model.parameters()], names)
            got = sink.records[-1]["update_ratio"]
            assert sink.records[-1]["step"] == step and set(got) == set(want) == {"0", "2"}
            for layer in want:
                assert want[layer] > 1e-3
                assert got[layer] == pytest.approx(want[layer], rel=2e-5)
                compared += 1
    handle.detach()
    assert compared == 6


# --- Lightning -----------------------------------------------------------------------------------
def test_lightning_accumulation_noise_scale_and_update_ratios():
    L = pytest.importorskip("lightning.pytorch")
    import lightning_harness as tl

    from gradfuse.integrations.lightning import GradfuseCallback

    class Copies(L.Callback):
        def __init__(self):
            self.steps = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # after gradfuse's
            self.before = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if getattr(self, "before", None) is not None:
                self.steps.append((self.before, [p.detach().clone() for p in pl_module.parameters()]))
                self.before = None

    cb = GradfuseCallback(noise_scale=True, update_ratios=True)
    copies = Copies()
    trainer, model, logger = tl.fit([cb, copies], accumulate=2, batches=16, log_every_n_steps=1)
    mon = cb.monitor
    ns = mon.noise_scale
    assert ns.batch_size == 2 and ns.accumulation_steps == 2  # from the batch and the Trainer
    assert ns.updates == 8 and ns.extra_passes == 8  # every optimizer step, one pass each
    rows = [m for _, m in logger.rows if "grad/total_norm" in m]
    assert len(rows) == 8
    assert all(math.isfinite(m["grad/noise_scale_trSigma"]) for m in rows)
    names = [n for n, _ in model.named_parameters()]
    compared = 0
    for m, (before, after) in zip(rows, copies.steps):
        want = ratios_from_copies(before, after, names)
        for layer, value in want.items():
            assert value > 1e-4
            assert m[f"update_ratio/{layer}"] == pytest.approx(value, rel=2e-5)
            assert m[f"weight_norm/{layer}"] > 0
            compared += 1
    assert compared == 8 * 2  # layers net.0 and net.2 (module path; no block index)


# --- Hugging Face Trainer -------------------------------------------------------------------------
def test_transformers_accumulation_noise_scale_and_update_ratios(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import transformers_harness as tt
    from transformers import TrainerCallback

    from gradfuse.integrations.transformers import attach

    class Copies(TrainerCallback):
        def __init__(self):
            self.steps = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.before = [p.detach().clone() for p in model.parameters()]

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.steps[state.global_step + 1] = (self.before, [p.detach().clone() for p in model.parameters()])

    trainer, opt = tt.make_trainer(tmp_path, max_grad_norm=1.0, accumulate=2, max_steps=4)
    cb = attach(trainer, noise_scale=True, update_ratios=True)
    copies = Copies()
    trainer.add_callback(copies)
    tt.train(trainer)
    ns = cb.monitor.noise_scale
    assert ns.batch_size == 2 and ns.accumulation_steps == 2
    assert ns.updates == 4 and ns.extra_passes == 4
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2, 3, 4]
    names = [n for n, _ in trainer.model.named_parameters()]
    for h in logs:
        assert math.isfinite(h["grad/noise_scale_G2"])
        before, after = copies.steps[h["step"]]
        # GPT-2 ties lm_head to wte: named_parameters lists it once, as transformer.wte.
        want = ratios_from_copies(before, after, names)
        assert set(want) == {k.split("/", 1)[1] for k in h if k.startswith("update_ratio/")}
        for layer, value in want.items():
            assert value > 1e-4
            assert h[f"update_ratio/{layer}"] == pytest.approx(value, rel=1e-4)


def test_attach_with_grad_scaler_takes_the_loss_scale_out():
    # Micro-batch norms are taken on scaled gradients (2^12 x), the step's norm after the
    # monitor's fused unscale: without taking the scale out, the estimate would be off by 2^24.
    torch.manual_seed(0)
    d, batch, k = 64, 4, 4
    mu = torch.randn(d)
    w = nn.Parameter(mu + 2.0 * nn.functional.normalize(torch.randn(d), dim=0))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=10 ** 6)
    handle = gradfuse.attach(opt, scaler=scaler, every=0,
                             noise_scale=gradfuse.NoiseScale(batch_size=batch, beta=0.998,
                                                             accumulation_steps=k))
    gen = torch.Generator().manual_seed(7)
    for _ in range(300):
        for _ in range(k):
            x = mu + torch.randn(batch, d, generator=gen)
            scaler.scale(0.5 * (w - x).square().sum(1).mean() / k).backward()
        assert float(w.grad.norm()) > 100  # really scaled
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    handle.detach()
    ns = handle.monitor.noise_scale
    assert ns.updates == 300
    assert ns.host_values()["noise_scale"] == pytest.approx(16.0, rel=0.10)
    assert ns.host_values()["G2"] == pytest.approx(4.0, rel=0.10)


def test_dynamics_benchmark_runs_and_counts_passes():
    # A tiny untimed-in-spirit run of benchmarks/dynamics_cost.py, so it cannot rot.
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "benchmarks/dynamics_cost.py", "--layers", "1", "--d", "32",
                           "--vocab", "64", "--ctx", "16", "--rounds", "2"], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert rows["monitor"] == "1" and rows["monitor+noise_scale"] == "2"
    # update ratios: one pass of the optimizer-update op beside the monitor's statistics pass
    assert rows["monitor, logging step"] == "1" and rows["monitor+update_ratios, logging step"] == "2"
