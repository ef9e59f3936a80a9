"""gradfuse.clip_grad_norm_ and gradfuse.clip_ against torch.nn.utils.clip_grad_norm_, run live."""
import math
import warnings

import pytest
import torch
from torch import nn

import gradfuse

NORM_TYPES = [2.0, 1.0, math.inf, 3.0, 0.5, 0.0]


def make_params(dtype, device, sizes=(300, 1, 0, 65537, 70), seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = nn.Parameter(torch.zeros(n, dtype=dtype, device=device))
        p.grad = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
        params.append(p)
    return params


def tol(dtype):
    return {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]


def clone_params(params):
    """Independent copies of ``params`` with their gradients (copy.deepcopy of an nn.Parameter
    drops .grad)."""
    out = []
    for p in params:
        q = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        if p.grad is not None:
            q.grad = p.grad.clone()
        out.append(q)
    return out


def run_both(params, max_norm, norm_type, **kw):
    ours = clone_params(params)
    theirs = clone_params(params)
    t_ours = gradfuse.clip_grad_norm_(ours, max_norm, norm_type, **kw)
    t_theirs = nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, **kw)
    return ours, theirs, t_ours, t_theirs


def assert_same(ours, theirs, t_ours, t_theirs, dtype):
    assert t_ours.dtype == t_theirs.dtype and t_ours.shape == t_theirs.shape
    assert t_ours.device == t_theirs.device
    torch.testing.assert_close(t_ours, t_theirs, rtol=tol(dtype), atol=0, equal_nan=True)
    assert len(ours) == len(theirs)
    compared = 0
    for a, b in zip(ours, theirs):
        if a.grad is None:
            assert b.grad is None
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=tol(dtype), atol=tol(dtype) * 1e-3,
                                   equal_nan=True)
        compared += int(bool((b.grad != 0).any()))
    # Something was compared: gradients with non-zero elements, a non-zero total norm.
    assert compared > 0, "no non-zero gradient was compared"
    assert bool(t_theirs != 0), "the total norm compared is 0"


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e9])  # clipping needed / not needed
def test_matches_torch(device, dtype, norm_type, max_norm):
    params = make_params(dtype, device, scale=0.1)
    assert_same(*run_both(params, max_norm, norm_type), dtype)


def test_not_clipping_leaves_grads_bitwise(device, dtype):
    params = make_params(dtype, device)
    before = [p.grad.clone() for p in params]
    gradfuse.clip_grad_norm_(params, 1e30)
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)


def test_single_tensor_and_none_grads(device):
    params = make_params(torch.float32, device)
    params[1].grad = None
    assert_same(*run_both(params, 0.1, 2.0), torch.float32)
    ours, theirs = clone_params(params[:1]) + clone_params(params[:1])
    t_ours = gradfuse.clip_grad_norm_(ours, 0.1)
    t_theirs = nn.utils.clip_grad_norm_(theirs, 0.1)
    assert_same([ours], [theirs], t_ours, t_theirs, torch.float32)


def test_empty_list_and_empty_generator():
    assert torch.equal(gradfuse.clip_grad_norm_([], 1.0), torch.tensor(0.0))
    with pytest.warns(UserWarning, match="empty generator"):
        gradfuse.clip_grad_norm_((p for p in []), 1.0)
    no_grads = [nn.Parameter(torch.ones(3))]
    assert torch.equal(gradfuse.clip_grad_norm_(no_grads, 1.0), torch.tensor(0.0))


def test_mixed_dtypes(device):
    params = (make_params(torch.float32, device, seed=1, scale=0.1)
              + make_params(torch.bfloat16, device, seed=2, scale=0.1)
              + make_params(torch.float64, device, seed=3, scale=0.1))
    for norm_type in (2.0, math.inf, 1.0):
        assert_same(*run_both(params, 0.3, norm_type), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_devices():
    params = make_params(torch.float32, "cuda", seed=1) + make_params(torch.float32, "cpu", seed=2)
    assert_same(*run_both(params, 0.3, 2.0), torch.float32)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite(device, dtype, bad):
    params = make_params(dtype, device)
    params[3].grad[100] = bad
    assert_same(*run_both(params, 1.0, 2.0), dtype)
    with pytest.raises(RuntimeError, match=r"non-finite.*\[3\] \(nan=\d, inf=\d\)"):
        gradfuse.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_overflowing_norm_error_says_so(device):
    params = make_params(torch.float16, device)
    params[0].grad.fill_(60000.0)  # finite values whose fp16 total norm overflows
    with pytest.raises(RuntimeError, match="overflowed"):
        gradfuse.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_bad_max_norm(bad):
    with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
        gradfuse.clip_grad_norm_(make_params(torch.float32, "cpu"), bad)


@pytest.mark.parametrize("bad", [-1.0, math.nan, -math.inf])
def test_bad_norm_type(bad):
    with pytest.raises(ValueError, match="norm_type"):
        gradfuse.clip_grad_norm_(make_params(torch.float32, "cpu"), 1.0, bad)


def test_clip_returns_stats_before_clipping(device, dtype):
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5)).to(device, dtype)
    model(torch.randn(8, 20, device=device, dtype=dtype)).square().sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected_total = nn.utils.get_total_norm([g for g in before.values()])
    s = gradfuse.clip_(model, max_norm=1e-3)
    assert s.names == [n for n, _ in model.named_parameters()]
    torch.testing.assert_close(s.total_norm, expected_total, rtol=tol(dtype), atol=0)
    for i, name in enumerate(s.names):
        ref = torch.linalg.vector_norm(before[name].double())
        torch.testing.assert_close(s.l2[i], ref, rtol=tol(dtype) * 10, atol=1e-12)
    assert bool(s.clipped) and float(s.clip_coef) < 1
    after = gradfuse.stats(model).total_norm
    assert float(after) == pytest.approx(1e-3, rel=max(tol(dtype) * 10, 1e-5))
    s2 = gradfuse.clip_(model, max_norm=10.0)
    assert not bool(s2.clipped) and float(s2.clip_coef) == 1.0


def test_clip_accepts_named_parameters_and_reports_names():
    model = nn.Linear(4, 3)
    model.weight.grad = torch.full((3, 4), math.nan)
    model.bias.grad = torch.ones(3)
    s = gradfuse.clip_(model.named_parameters(), max_norm=1.0)
    assert s.names == ["weight", "bias"]
    assert s.nonfinite_names() == ["weight"]
    assert bool(s.nonfinite)
