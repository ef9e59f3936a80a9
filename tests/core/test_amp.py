"""The fused AMP path: unscale + statistics + clip in one read and one write, against
GradScaler.unscale_ followed by clip_grad_norm_."""
import copy
import math

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse import GradMonitor


def setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    return model, opt, scaler


def scaled_backward(model, scaler, x, plant_inf=False):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    if plant_inf:
        model[0].weight.grad[1, 1] = math.inf


@pytest.mark.parametrize("max_norm", [None, 1e-3, 1e6])
@pytest.mark.parametrize("plant_inf", [False, True])
def test_fused_matches_unscale_then_clip(max_norm, plant_inf):
    a = setup()
    b = copy.deepcopy(a)
    x = torch.randn(8, 16)
    for model, _opt, scaler in (a, b):
        scaled_backward(model, scaler, x, plant_inf)
    # Reference: the documented two-pass order.
    model, opt, scaler = a
    scaler.unscale_(opt)
    ref_total = (nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm is not None
                 else nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    # Fused.
    model_b, opt_b, scaler_b = b
    names = {id(p): n for n, p in model_b.named_parameters()}
    s = gradfuse.unscale_clip_(opt_b, scaler_b, max_norm=max_norm, names_by_param=names)
    assert s.names == [n for n, _ in model_b.named_parameters()]
    torch.testing.assert_close(s.total_norm, ref_total, rtol=1e-5, atol=0, equal_nan=True)
    for pa, pb in zip(model.parameters(), model_b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-9, equal_nan=True)
    for _model, opt, scaler in (a, b):
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == scaler_b.get_scale()
    assert (scaler_b.get_scale() < 2.0**12) == plant_inf  # the scaler saw the overflow
    for pa, pb in zip(a[0].parameters(), b[0].parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-7)


def test_unscaled_statistics_are_those_of_the_unscaled_gradients():
    model, opt, scaler = setup()
    scaled_backward(model, scaler, torch.randn(8, 16))
    s = gradfuse.unscale_clip_(opt, scaler, norm_type=3.0)
    after = gradfuse.stats(model, norm_type=3.0)  # the gradients are now unscaled
    torch.testing.assert_close(s.l2, after.l2, rtol=1e-5, atol=0)
    torch.testing.assert_close(s.linf, after.linf, rtol=1e-5, atol=0)
    torch.testing.assert_close(s.mean, after.mean, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(s.norm(3.0), after.norm(3.0), rtol=1e-5, atol=0)
    torch.testing.assert_close(s.total_norm, after.total_norm, rtol=1e-5, atol=0)


def test_scale_below_one_still_unscales():
    model, opt, _ = setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=0.25)  # inv_scale 4: must multiply up
    scaled_backward(model, scaler, torch.randn(8, 16))
    scaled = [p.grad.clone() for p in model.parameters()]
    gradfuse.unscale_clip_(opt, scaler)
    for p, g in zip(model.parameters(), scaled):
        torch.testing.assert_close(p.grad, g * 4, rtol=0, atol=0)


def test_twice_is_an_error():
    model, opt, scaler = setup()
    scaled_backward(model, scaler, torch.randn(8, 16))
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        gradfuse.unscale_clip_(opt, scaler)


def test_monitor_fused_unscale_and_overflow():
    model, opt, scaler = setup()
    mon = GradMonitor(model, max_norm=1e-3, scaler=scaler, optimizer=opt, on_nonfinite="raise", every=0)
    for step in range(3):
        opt.zero_grad()
        scaled_backward(model, scaler, torch.randn(8, 16), plant_inf=(step == 1))
        r = mon.step()  # no scaler.unscale_: the monitor does it, fused
        scaler.step(opt)
        scaler.update()
        assert (r.anomalies == ["amp_overflow"]) == (step == 1)
        if step != 1:
            assert float(gradfuse.stats(model).total_norm) == pytest.approx(1e-3, rel=1e-3)
    assert mon.amp_overflow_steps == 1 and mon.anomaly_steps == 0 and mon.clipped_steps == 2
    with pytest.raises(ValueError, match="pass scaler= too"):
        GradMonitor(model, optimizer=opt)


def test_fp16_gradients_whose_scaled_norm_overflows_fp16():
    p = nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(torch.ones(()))  # the scale is created lazily, by the first scale()
    p.grad = torch.full((1000,), 0.5 * 2.0**16 / 2**8, dtype=torch.float16)  # scaled: norm > 65504
    s = gradfuse.unscale_clip_(opt, scaler)
    assert float(s.total_norm) == pytest.approx(0.5 / 2**8 * math.sqrt(1000), rel=1e-3)
    assert not bool(s.nonfinite)
