"""The clipping ops of issue 17 (gradfuse.ops: per-tensor / per-unit scale, unit statistics, clamp
by value): the pure-PyTorch reference against plain torch, and the compiled CPU ops (both CPU
builds) against the reference, bit for bit where the arithmetic is the same."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfuse import _ext, ops, reference
from helpers import assert_stats_close

CHUNK = 65536
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
HAVE_CLIP_OPS = _ext._C is not None and hasattr(torch.ops.gradfuse, "multi_tensor_clamp_")


def randn(shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def unit_rows_expected(t, u):
    """Float64 statistics per unit, from plain torch ops on each block."""
    x = t.detach().reshape(u, -1).double()
    return x.sum(1), (x * x).sum(1), torch.linalg.vector_norm(x, math.inf, dim=1) if x.shape[1] else x.new_zeros(u)


# ---------------------------------------------------------------- the reference vs plain torch

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_unit_stats_match_torch_norms(dtype):
    w = randn((37, 5, 3), dtype, seed=1)
    b = randn((11,), dtype, seed=2)
    e = torch.empty((0, 4), dtype=dtype)
    f, c = reference.multi_tensor_unit_stats([w, b, e, w], [37, 1, 0, 1], 3.0)
    assert f.shape == (37 + 1 + 0 + 1, 4) and c.shape == f.shape
    # timm's AGC norm: over dims 1.. per output unit
    expect = w.double().norm(2, dim=(1, 2))
    torch.testing.assert_close(f[:37, 1].sqrt(), expect, rtol=1e-12, atol=0)
    torch.testing.assert_close(f[:37, 3], w.double().abs().pow(3).sum((1, 2)), rtol=1e-12, atol=0)
    torch.testing.assert_close(f[:37, 2], w.double().abs().amax((1, 2)))
    torch.testing.assert_close(f[37, 1], b.double().square().sum())
    torch.testing.assert_close(f[38:], reference.multi_tensor_stats([w], 3.0)[0])
    assert c[:37, 3].tolist() == [15] * 37 and c[37, 3] == 11
    assert f[:, 1].gt(0).all()  # something was compared


def test_reference_unit_stats_special_values_and_bad_units():
    x = torch.zeros(4, 3)
    x[0, 1] = math.nan
    x[2, 2] = -math.inf
    x[3] = torch.tensor([1.0, -2.0, 0.0])
    f, c = reference.multi_tensor_unit_stats([x], [4])
    assert c.tolist() == [[1, 0, 2, 3], [0, 0, 3, 3], [0, 1, 2, 3], [0, 0, 1, 3]]
    assert math.isnan(f[0, 2]) and f[2, 2] == math.inf and f[3].tolist() == [-1.0, 5.0, 2.0, 0.0]
    with pytest.raises(RuntimeError, match=r"units\[0\] = 5 does not divide"):
        reference.multi_tensor_unit_stats([x], [5])
    with pytest.raises(RuntimeError, match="2 unit counts"):
        reference.multi_tensor_unit_stats([x], [4, 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("conditional", [True, False])
def test_reference_per_tensor_scale_matches_foreach_mul(dtype, conditional):
    tensors = [randn((n,), dtype, seed=n) for n in (5, 0, 130, CHUNK + 3)]
    coefs = torch.tensor([0.3, 0.7, 2.0, math.nan], dtype=torch.float64)
    expect = [t.clone() for t in tensors]
    acc = reference.acc_dtype(dtype)
    used = coefs.clamp(max=1.0) if conditional else coefs
    for t, c in zip(expect, used.to(acc)):
        t.copy_(t.to(acc) * c)
    reference.multi_tensor_scale_per_tensor_(tensors, coefs, conditional)
    for got, exp in zip(tensors, expect):
        torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
    # the coefficients did something: the first tensor shrank, the last is NaN
    assert tensors[3].isnan().all() and not torch.equal(tensors[0], randn((5,), dtype, seed=5))
    if dtype == torch.float32:  # a float32 coefficient: the same as torch._foreach_mul_
        ref = [randn((n,), dtype, seed=n) for n in (5, 130)]
        mine = [t.clone() for t in ref]
        c32 = torch.tensor([0.3, 0.7])
        torch._foreach_mul_(ref, list(c32.unbind()))
        reference.multi_tensor_scale_per_tensor_(mine, c32, conditional)
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reference_unit_scale_non_contiguous():
    base = randn((6, 8), torch.float32, seed=3)
    view = base.t()  # [8, 6], non-contiguous: units are its logical rows
    expect = view.clone() * torch.arange(8, dtype=torch.float32)[:, None] / 10
    coefs = torch.arange(8, dtype=torch.float32) / 10
    reference.multi_tensor_unit_scale_([view], [8], coefs, conditional=True)
    torch.testing.assert_close(view, expect, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="1-D tensor of 8 coefficients"):
        reference.multi_tensor_unit_scale_([view], [8], coefs[:3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("clip_value", [0.0, 0.1, 0.5, 1e6, math.inf])
def test_reference_clamp_matches_clip_grad_value(dtype, clip_value):
    tensors = [randn((n,), dtype, seed=n) for n in (1, 7, 1000, 0)]
    tensors[2][:6] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, -5.0])
    params = [torch.nn.Parameter(torch.zeros(t.shape, dtype=dtype)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    before = [t.clone() for t in tensors]
    if clip_value > torch.finfo(dtype).max and not math.isinf(clip_value):
        with pytest.raises(RuntimeError, match="overflow"):  # torch refuses; gradfuse clamps nothing
            torch.nn.utils.clip_grad_value_(params, clip_value, foreach=True)
    else:
        torch.nn.utils.clip_grad_value_(params, clip_value, foreach=True)
    f, c, clamped = reference.multi_tensor_clamp_(tensors, clip_value)
    for t, p, b in zip(tensors, params, before):
        torch.testing.assert_close(t, p.grad, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(torch.signbit(t), torch.signbit(p.grad))
    expect_changed = [int(((t != b) & ~b.isnan()).sum()) for t, b in zip(tensors, before)]
    assert clamped.tolist() == expect_changed
    if clip_value == 0.5:
        assert clamped.sum() > 100  # clipping really happened
    assert_stats_close(before, (f, c))  # the statistics are of the values before clamping


def test_clip_value_checked():
    x = torch.ones(3)
    for bad in (-1.0, math.nan):
        with pytest.raises(RuntimeError, match="clip_value must be >= 0"):
            ops.multi_tensor_clamp_([x], bad)
    assert x.eq(1).all()


def test_ops_wrappers_answer_empty_lists_and_route():
    f, c = ops.multi_tensor_unit_stats([], [])
    assert f.shape == (0, 4) and c.shape == (0, 4)
    ops.multi_tensor_unit_scale_([], [], torch.empty(0))
    ops.multi_tensor_scale_per_tensor_([], torch.empty(0))
    f, c, clamped = ops.multi_tensor_clamp_([], 1.0)
    assert f.shape == (0, 4) and clamped.shape == (0,)
    w = randn((9, 4), torch.float32, seed=7)
    expect = w.clone() * torch.linspace(0.1, 0.9, 9)[:, None]
    ops.multi_tensor_unit_scale_([w], [9], torch.linspace(0.1, 0.9, 9))
    torch.testing.assert_close(w, expect, rtol=0, atol=0)
