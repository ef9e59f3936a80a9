"""Gradient noise scale (gradfuse.noise_scale): the estimator's arithmetic, and the estimate on a
problem with a known answer from both sources, gradient accumulation and 2 gloo DDP ranks.

Per-example loss 0.5 |w - x_i|^2 with x_i ~ N(mu, s^2 I) in d dimensions: the gradient of the
mean loss is w - mean(x), so G = w - mu, tr(Sigma) = d s^2 and B_simple = d s^2 / |w - mu|^2.
w is held fixed, so every step samples the same point's gradient noise."""
import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradfuse
from gradfuse.sinks import metrics, read_jsonl


class CountStatsPasses(TorchDispatchMode):
    """Counts the fused stats op, however it is reached (Python or gradfuse.watch's C++)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.gradfuse.multi_tensor_stats.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def quadratic_problem(d, s, g_norm, seed=0):
    torch.manual_seed(seed)
    mu = torch.randn(d)
    w = nn.Parameter(mu + g_norm * nn.functional.normalize(torch.randn(d), dim=0))
    return mu, w, d * s * s / g_norm ** 2


def run_accumulation(d, s, g_norm, batch, k, steps, accumulation="mean", seed=0, sinks=()):
    mu, w, truth = quadratic_problem(d, s, g_norm, seed)
    ns = gradfuse.NoiseScale(batch_size=batch, beta=0.998, accumulation=accumulation,
                             accumulation_steps=k)
    mon = gradfuse.GradMonitor([("w", w)], every=50, on_nonfinite="ignore", noise_scale=ns, sinks=sinks)
    gen = torch.Generator().manual_seed(100 + seed)
    grad_norms = []
    for _ in range(steps):
        w.grad = None
        for _m in range(k):
            x = mu + s * torch.randn(batch, d, generator=gen)
            loss = 0.5 * (w - x).square().sum(1).mean()
            (loss / k if accumulation == "mean" else loss).backward()
            mon.micro_step()
        grad_norms.append(float(w.grad.norm()))
        mon.step()
    return mon, ns, truth, grad_norms


def test_estimator_recovers_g2_and_trace_exactly_from_noise_free_norms():
    # |G_B|^2 has expectation |G|^2 + tr(Sigma) / B: fed the expectations, the estimators are exact.
    ns = gradfuse.NoiseScale(beta=0.9)
    g2, tr = 3.0, 48.0
    for _ in range(5):
        ns.update(torch.tensor(g2 + tr / 4), torch.tensor(g2 + tr / 32), 4, 32)
    v = ns.host_values()
    assert v["G2"] == pytest.approx(g2, rel=1e-12)
    assert v["trSigma"] == pytest.approx(tr, rel=1e-12)
    assert v["noise_scale"] == pytest.approx(16.0, rel=1e-12)


def test_ema_is_debiased_skips_nonfinite_pairs_and_round_trips_state():
    ns = gradfuse.NoiseScale(beta=0.5)
    ns.update(torch.tensor(10.0), torch.tensor(6.0), 1, 2)  # G2 = 2, tr = 8
    ns.update(torch.tensor(math.nan), torch.tensor(6.0), 1, 2)  # ignored, on the device
    ns.update(torch.tensor(6.0), torch.tensor(5.0), 1, 2)  # G2 = 4, tr = 2
    v = ns.host_values()
    # debiased EMA of (2, 4) with beta 0.5: (0.25*2 + 0.5*4) / 0.75
    assert v["G2"] == pytest.approx((0.25 * 2 + 0.5 * 4) / 0.75)
    assert v["trSigma"] == pytest.approx((0.25 * 8 + 0.5 * 2) / 0.75)
    other = gradfuse.NoiseScale(beta=0.5)
    other.load_state_dict(json.loads(json.dumps(ns.state_dict())))
    assert other.host_values() == v
    with pytest.raises(ValueError, match="b_small < b_big"):
        ns.update(torch.tensor(1.0), torch.tensor(1.0), 4, 4)
    with pytest.raises(ValueError, match="accumulation"):
        gradfuse.NoiseScale(accumulation="avg")


@pytest.mark.parametrize("g_norm", [2.0, 1.0], ids=["B16", "B64"])
@pytest.mark.parametrize("accumulation", ["mean", "sum"])
def test_accumulation_estimate_within_10_percent(g_norm, accumulation):
    mon, ns, truth, grad_norms = run_accumulation(64, 1.0, g_norm, batch=4, k=8, steps=400,
                                                  accumulation=accumulation)
    # There was something to measure: the gradients are non-zero and vary from step to step.
    assert min(grad_norms) > 0.1 and max(grad_norms) > 1.2 * min(grad_norms)
    v = ns.host_values()
    assert ns.updates == 400
    assert v["noise_scale"] == pytest.approx(truth, rel=0.10)
    assert v["trSigma"] == pytest.approx(64.0, rel=0.10)
    assert v["G2"] == pytest.approx(g_norm ** 2, rel=0.10)


def test_one_extra_pass_per_step_under_accumulation_none_without():
    with CountStatsPasses() as passes:
        run_accumulation(8, 1.0, 1.0, batch=2, k=4, steps=10)
    assert passes.calls == 20  # the monitor's pass + the first micro-batch's, per step
    # Not told the accumulation: the first accumulating step teaches it, no pass before.
    mu, w, _ = quadratic_problem(8, 1.0, 1.0)
    mon = gradfuse.GradMonitor([("w", w)], every=0, noise_scale=True)
    passes = CountStatsPasses()
    for k in [1, 1, 3, 3, 3]:
        w.grad = None
        for _ in range(k):
            (0.5 * (w - mu - torch.randn(2, 8)).square().sum(1).mean() / k).backward()
            with passes:
                mon.micro_step()
        with passes:
            mon.step()
    # steps with k = 1: one pass each; the first k = 3 step: none extra; then one extra each.
    assert passes.calls == 5 + 2
    assert mon.noise_scale.updates == 2


def test_monitor_logs_noise_scale_keys_and_keeps_state(tmp_path):
    sink = gradfuse.JsonlSink(tmp_path / "run.jsonl")
    mon, ns, truth, _ = run_accumulation(16, 1.0, 1.0, batch=4, k=4, steps=101, sinks=[sink])
    mon.close()
    records = read_jsonl(tmp_path / "run.jsonl")
    assert [r["step"] for r in records] == [0, 50, 100]
    m = metrics(records[-1])
    assert set(m) >= {"grad/noise_scale", "grad/noise_scale_G2", "grad/noise_scale_trSigma"}
    assert m["grad/noise_scale"] == pytest.approx(ns.host_values()["noise_scale"])
    assert math.isfinite(m["grad/noise_scale"]) and m["grad/noise_scale"] > 0
    state = mon.state_dict()
    fresh = gradfuse.GradMonitor([("w", nn.Parameter(torch.zeros(16)))], noise_scale=True)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.noise_scale.host_values() == ns.host_values()


def test_skipped_steps_are_not_averaged_in():
    mu, w, _ = quadratic_problem(8, 1.0, 1.0)
    mon = gradfuse.GradMonitor([("w", w)], every=0, noise_scale=gradfuse.NoiseScale(accumulation_steps=2),
                               on_nonfinite="skip")
    for poison in (False, True):
        w.grad = None
        for _ in range(2):
            (0.5 * (w - mu - torch.randn(2, 8)).square().sum(1).mean() / 2).backward()
            mon.micro_step()
        if poison:
            w.grad[0] = math.nan
        with pytest.warns(RuntimeWarning) if poison else _nothing():
            report = mon.step()
        assert report.skip == poison
    assert mon.noise_scale.updates == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_ddp_two_gloo_ranks_estimate_within_10_percent(tmp_path):
    import noise_scale_workers
    cases = {"B16": dict(d=64, s=1.0, g_norm=2.0, batch=4, steps=400),
             "B32": dict(d=64, s=1.0, g_norm=math.sqrt(2.0), batch=4, steps=400),
             "attach_accumulate": dict(d=64, s=1.0, g_norm=2.0, batch=4, steps=300, accumulate=2,
                                       via_attach=True)}
    mp.spawn(noise_scale_workers.worker, args=(2, str(tmp_path / "init"), str(tmp_path), cases),
             nprocs=2, join=True)
    for name, case in cases.items():
        for rank in range(2):
            text = (tmp_path / f"{name}.{rank}").read_text()
            assert not text.startswith("ERROR"), f"{name}, rank {rank}:\n{text}"
            out = eval(text)  # a dict repr written by the worker
            assert out["ratio"] == pytest.approx(1.0, rel=0.10), (name, out)
            assert out["trSigma"] == pytest.approx(1.0, rel=0.10), (name, out)
            # One scalar collective per step, no extra pass of the monitor's own; one fused pass
            # per bucket (one bucket here) in the hook, only on the backward that syncs.
            assert out["all_reduce_calls"] == case["steps"], (name, out)
            assert out["extra_passes"] == 0 and out["bucket_passes"] == case["steps"], (name, out)


def test_plot_draws_the_noise_scale_curve(tmp_path):
    pytest.importorskip("matplotlib")
    from gradfuse.__main__ import main
    from gradfuse.viz.gradflow import noise_scale_path
    sink = gradfuse.JsonlSink(tmp_path / "run.jsonl")
    mon, *_ = run_accumulation(8, 1.0, 1.0, batch=2, k=2, steps=120, sinks=[sink])
    mon.close()
    out = tmp_path / "flow.png"
    assert main(["plot", str(tmp_path / "run.jsonl"), "-o", str(out)]) == 0
    picture = noise_scale_path(out)
    assert picture.endswith("flow_noise_scale.png")
    with open(picture, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
