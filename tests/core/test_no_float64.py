"""Where no compiled kernel runs and the device has no float64 (Apple's MPS), the pure-PyTorch
path computes in float32: simulated on the CPU (no kernels, no float64) under a dispatch mode
that refuses every float64 tensor, and compared with the float64 path as the oracle."""
import math

import pytest
import torch
from helpers import ListSink, NoFloat64

import gradfuse
from gradfuse.ops import library


def _model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(32, 40) * 3 + 100  # values far from zero: sums of squares are large
    m(x).pow(2).mean().backward()
    return m


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


def test_the_mode_refuses_float64():
    with NoFloat64(), pytest.raises(AssertionError, match="float64"):
        torch.ones(3).double()


def test_stats_in_float32_match_the_float64_oracle(cpu_without_float64, monkeypatch):
    m = _model()
    with NoFloat64():
        s = gradfuse.stats(m)
        d = s.to_dict()
        table = s.table()
    assert s.l2.dtype == torch.float32 and s.floats.dtype == torch.float32
    monkeypatch.setattr(library, "NO_FLOAT64", {"mps"})
    ref = gradfuse.stats(m).to_dict()
    assert ref["total_norm"] > 1
    assert d["total_norm"] == pytest.approx(ref["total_norm"], rel=1e-5)
    for name, row in ref["params"].items():
        ours = d["params"][name]
        assert ours["numel"] == row["numel"] and ours["zero_count"] == row["zero_count"]
        for key in ("l2", "linf", "mean"):
            assert ours[key] == pytest.approx(row[key], rel=1e-5, abs=1e-6), (name, key)
    assert "total norm (2)" in table


def test_counts_stay_exact_beyond_float32_integers(cpu_without_float64):
    g = torch.zeros(2**24 + 3)
    g[:5] = 1.0
    p = torch.nn.Parameter(torch.zeros_like(g))
    p.grad = g
    with NoFloat64():
        row = gradfuse.stats([("p", p)]).to_dict()["params"]["p"]
    assert row["numel"] == 2**24 + 3 and row["zero_count"] == 2**24 - 2  # not representable in float32


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 0.0])
def test_clip_grad_norm_in_float32(cpu_without_float64, monkeypatch, norm_type):
    m, m_ref = _model(), _model()
    before = _grads(m)
    with NoFloat64():
        total = gradfuse.clip_grad_norm_(m.parameters(), max_norm=0.5, norm_type=norm_type)
    assert total.dtype == torch.float32
    ref = torch.nn.utils.clip_grad_norm_(m_ref.parameters(), max_norm=0.5, norm_type=norm_type)
    assert total.item() == pytest.approx(ref.item(), rel=1e-5)
    for p, q, b in zip(m.parameters(), m_ref.parameters(), before):
        assert not torch.equal(p.grad, b)  # clipping happened
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_clip_modes_and_monitor_in_float32(cpu_without_float64):
    m = _model()
    sink = ListSink()
    records = sink.records
    with NoFloat64():
        per = gradfuse.clip_(m, max_norm=0.5, per="layer")
        value = gradfuse.clip_(m, max_norm=None, value=1e-3)
        mon = gradfuse.GradMonitor(m, max_norm=0.1, every=1, sinks=[sink],
                                   explode_threshold=1e9)
        report = mon.step()
        zc = gradfuse.ZClip(warmup_steps=1, max_grad_norm=1.0)
        zc.step(m)
        zc.step(m)
    assert per.clip_coef.dtype == torch.float32 and bool(per.clipped.any())
    assert value.to_dict()["clamped"] > 0
    assert report.stats.clip_coef is not None and records and records[0]["total_norm"] > 0
    assert zc.mean.dtype == torch.float32
