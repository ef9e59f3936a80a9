"""gradfuse.clip_grad_norm_, get_total_norm, clip_grads_with_norm_ and clip_ against
torch.nn.utils, run live side by side. (PyTorch's own clip test cases: test_clip_torch_cases.py)."""
import inspect
import math

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse.core import slow_paths

inf = math.inf
POSITIVE_ORDERS = [2.0, 1.0, inf, 3.0, 0.5]
NEGATIVE_ORDERS = [-1.0, -0.5, -2.0, -inf]
NORM_TYPES = POSITIVE_ORDERS + [0.0] + NEGATIVE_ORDERS
SIZES = (300, 1, 0, 65537, 70)


def no_identity(norm_type) -> bool:
    """Orders for which torch raises on an empty gradient (no identity): inf, -inf, p < 0."""
    return math.isinf(norm_type) or norm_type < 0


def sizes_for(norm_type, dtype):
    sizes = SIZES
    if no_identity(norm_type):  # gradfuse leaves empty gradients out: see test_empty_gradient...
        sizes = tuple(n for n in sizes if n)
    if dtype == torch.float16 and 0 < norm_type < 1:
        # (sum |x|^p)^(1/p) of 66 000 elements overflows fp16 on both sides: nothing to compare
        sizes = tuple(min(n, 500) for n in sizes)
    if dtype == torch.float16 and norm_type < 0:
        # ... and underflows for negative orders, where torch's max_norm / (total + 1e-6) is then
        # inf in fp16: a few elements of magnitude ~1 (make_params(scale=1))
        sizes = tuple(min(n, 20) for n in sizes)
    return sizes


def make_params(dtype, device, sizes=SIZES, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = nn.Parameter(torch.zeros(n, dtype=dtype, device=device))
        p.grad = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
        params.append(p)
    return params


def tol(dtype, norm_type=2.0):
    # fp16: two ulps (the coefficient and each product are rounded to fp16)
    rtol = {torch.float16: 4e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5,
            torch.float64: 1e-10, torch.complex64: 1e-5, torch.complex128: 1e-10}[dtype]
    # torch sums |x|^p per tensor in the gradients' dtype, then raises its norms to p again;
    # gradfuse sums in float64: for p < 0 torch's float32 result is off by a few 1e-5.
    return rtol * 10 if norm_type < 0 and dtype == torch.float32 else rtol


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


def compare(params, max_norm, norm_type, dtype, **kw):
    """run_both, then assert_same; returns torch's clipped parameters."""
    ours, theirs, t_ours, t_theirs = run_both(params, max_norm, norm_type, **kw)
    assert_same(ours, theirs, t_ours, t_theirs, dtype, norm_type=float(norm_type))
    return theirs


def assert_same(ours, theirs, t_ours, t_theirs, dtype, nonzero_total=True, norm_type=2.0):
    """Same total norm (value, dtype, device, shape) and same gradients (layout too); fails if
    nothing non-trivial was compared."""
    assert t_ours.dtype == t_theirs.dtype and t_ours.shape == t_theirs.shape
    assert t_ours.device == t_theirs.device
    torch.testing.assert_close(t_ours, t_theirs, rtol=tol(dtype, norm_type), atol=0, equal_nan=True)
    assert len(ours) == len(theirs)
    compared = 0
    for a, b in zip(ours, theirs):
        if a.grad is None:
            assert b.grad is None
            continue
        assert a.grad.layout == b.grad.layout and a.grad.dtype == b.grad.dtype
        ga, gb = (a.grad.to_dense(), b.grad.to_dense()) if a.grad.is_sparse else (a.grad, b.grad)
        rtol = tol(dtype, norm_type)
        torch.testing.assert_close(ga, gb, rtol=rtol, atol=rtol * 1e-3, equal_nan=True)
        compared += int(bool((gb != 0).any()))
    # Something was compared: gradients with non-zero elements, a non-zero total norm.
    assert compared > 0, "no non-zero gradient was compared"
    if nonzero_total:
        assert bool(t_theirs != 0), "the total norm compared is 0"


def torch_total(params, norm_type):
    return nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("clipping", [True, False], ids=["clip", "noclip"])
def test_matches_torch(device, dtype, norm_type, clipping):
    scale = 1.0 if dtype == torch.float16 and norm_type < 0 else 0.1
    params = make_params(dtype, device, sizes_for(norm_type, dtype), scale=scale)
    total = float(torch_total(params, norm_type))
    assert 0 < total < inf
    max_norm = total / 2 if clipping else 2 * (total + 1e-6)  # torch divides by total + 1e-6
    theirs = compare(params, max_norm, norm_type, dtype)
    changed = any(not torch.equal(p.grad, q.grad) for p, q in zip(params, theirs))
    assert changed == clipping


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


# torch 2.6's clip_grad_norm_ does not warn on an empty generator (newer torch does); gradfuse
# warns on every version.
TORCH_WARNS_EMPTY_GENERATOR = "empty generator" in inspect.getsource(torch.nn.utils.clip_grad)


def test_empty_list_and_empty_generator():
    for fn in (gradfuse.clip_grad_norm_, nn.utils.clip_grad_norm_):
        assert torch.equal(fn([], 1.0), torch.tensor(0.0))
        if fn is gradfuse.clip_grad_norm_ or TORCH_WARNS_EMPTY_GENERATOR:
            with pytest.warns(UserWarning, match="empty generator"):
                assert torch.equal(fn((p for p in []), 1.0), torch.tensor(0.0))
        else:
            assert torch.equal(fn((p for p in []), 1.0), torch.tensor(0.0))
        no_grads = [nn.Parameter(torch.ones(3))]
        assert torch.equal(fn(no_grads, 1.0), torch.tensor(0.0))
    for fn in (gradfuse.get_total_norm, nn.utils.get_total_norm):
        assert torch.equal(fn([]), torch.tensor(0.0))


@pytest.mark.parametrize("norm_type", [2.0, inf, 1.0, 0.0, -1.0, -inf])
def test_mixed_dtypes(device, norm_type):
    sizes = sizes_for(norm_type, torch.float32)
    params = (make_params(torch.float32, device, sizes, seed=1, scale=0.1)
              + make_params(torch.bfloat16, device, sizes, seed=2, scale=0.1)
              + make_params(torch.float64, device, sizes, seed=3, scale=0.1))
    ours, theirs, t_ours, t_theirs = run_both(params, float(torch_total(params, norm_type)) / 2,
                                              norm_type)
    assert t_ours.dtype == torch.float64
    assert_same(ours, theirs, t_ours, t_theirs, torch.bfloat16, norm_type=norm_type)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_devices():
    params = make_params(torch.float32, "cuda", seed=1) + make_params(torch.float32, "cpu", seed=2)
    assert_same(*run_both(params, 0.3, 2.0), torch.float32)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_nonfinite(device, bad, norm_type):
    dtype = torch.float32
    params = make_params(dtype, device, sizes_for(norm_type, dtype))
    next(p for p in params if p.numel() == 65537).grad[100] = bad
    t_theirs = torch_total(params, norm_type)
    # a finite total here (p=0, a negative order and an Inf, ...) must be non-zero
    assert_same(*run_both(params, 1.0, norm_type), dtype,
                nonzero_total=bool(t_theirs.isfinite()), norm_type=norm_type)
    ours, theirs = clone_params(params), clone_params(params)
    raised = []
    for fn, ps in ((gradfuse.clip_grad_norm_, ours), (nn.utils.clip_grad_norm_, theirs)):
        try:
            fn(ps, 1.0, norm_type, error_if_nonfinite=True)
            raised.append(False)
        except RuntimeError as e:
            assert str(e).startswith(f"The total norm of order {float(norm_type)} for gradients")
            raised.append(True)
    assert raised[0] == raised[1] == (not bool(t_theirs.isfinite()))
    if raised[0]:  # left untouched
        for p, q in zip(params, ours):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True)


def test_nonfinite_error_names_the_gradients(device):
    params = make_params(torch.float32, device)
    params[3].grad[100] = math.nan
    with pytest.raises(RuntimeError, match=r"non-finite.*\[3\] \(nan=1, inf=0\)"):
        gradfuse.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_overflowing_norm_error_says_so(device):
    params = make_params(torch.float16, device)
    params[0].grad.fill_(60000.0)  # finite values whose fp16 total norm overflows
    with pytest.raises(RuntimeError, match="overflowed"):
        gradfuse.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_zero_norm_counts_gradients_as_torch():
    """PyTorch composes norms: the total 0-norm is the number of gradients with a non-zero
    element, and clipping scales by that."""
    grads = [torch.zeros(3), torch.tensor([0.0, 2.0, 0.0]), torch.tensor([1.0, math.nan]),
             torch.tensor([0.5, -0.5, 0.25])]
    params = []
    for g in grads:
        params.append(nn.Parameter(torch.zeros_like(g)))
        params[-1].grad = g
    ours, theirs, t_ours, t_theirs = run_both(params, 1.5, 0.0)
    assert float(t_theirs) == 3.0  # NaN is not zero
    assert_same(ours, theirs, t_ours, t_theirs, torch.float32)
    for s in (gradfuse.stats(params, norm_type=0), gradfuse.clip_(clone_params(params), 1.5, 0)):
        assert float(s.total_norm) == 3.0
        assert s.norm(0).tolist() == [0.0, 1.0, 2.0, 3.0]  # per gradient: its non-zero elements


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_get_total_norm_and_clip_grads_with_norm_match_torch(device, norm_type):
    params = make_params(torch.float32, device, sizes_for(norm_type, torch.float32), scale=0.1)
    grads = [p.grad for p in params]
    total = gradfuse.get_total_norm(grads, norm_type)
    expected = nn.utils.get_total_norm(grads, norm_type)
    assert total.dtype == expected.dtype and total.device == expected.device
    torch.testing.assert_close(total, expected, rtol=tol(torch.float32, norm_type), atol=0)
    ours, theirs = clone_params(params), clone_params(params)
    assert gradfuse.clip_grads_with_norm_(ours, float(expected) / 3, total) is None
    nn.utils.clip_grads_with_norm_(theirs, float(expected) / 3, expected)
    assert_same(ours, theirs, total, expected, torch.float32, norm_type=norm_type)
    # a single tensor, as torch takes it
    torch.testing.assert_close(gradfuse.get_total_norm(grads[0], norm_type),
                               nn.utils.get_total_norm(grads[0], norm_type),
                               rtol=tol(torch.float32, norm_type), atol=0)


def test_split_functions_have_torch_signatures():
    for ours, theirs in ((gradfuse.get_total_norm, nn.utils.get_total_norm),
                         (gradfuse.clip_grads_with_norm_, nn.utils.clip_grads_with_norm_),
                         (gradfuse.clip_grad_norm_, nn.utils.clip_grad_norm_)):
        a, b = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
        assert [(n, p.default, p.kind) for n, p in a.items()] == \
               [(n, p.default, p.kind) for n, p in b.items()]


def test_get_total_norm_error_if_nonfinite():
    g = [torch.ones(3), torch.tensor([1.0, math.inf])]
    for fn in (gradfuse.get_total_norm, nn.utils.get_total_norm):
        assert float(fn(g)) == inf
        with pytest.raises(RuntimeError, match="The total norm of order 2.0 for gradients"):
            fn(g, error_if_nonfinite=True)


def test_clip_grads_with_norm_takes_a_tensor_and_skips_none():
    p, q, r = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(2))
    p.grad, q.grad = torch.full((4,), 3.0), torch.full((4,), 3.0)
    gradfuse.clip_grads_with_norm_(p, 1.0, torch.tensor(6.0))
    nn.utils.clip_grads_with_norm_([q, r], 1.0, torch.tensor(6.0))
    gradfuse.clip_grads_with_norm_([r], 1.0, torch.tensor(6.0))  # no gradient: nothing to do
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    assert float(p.grad[0]) == pytest.approx(0.5, rel=1e-5)


# Sparse and complex gradients: the per-tensor path, against torch.

def embedding_model(seed=0):
    torch.manual_seed(seed)
    emb = nn.Embedding(50, 8, sparse=True)
    lin = nn.Linear(8, 3)
    emb2 = nn.Embedding(20, 4, sparse=True)  # a second sparse gradient, with duplicate indices
    out = lin(emb(torch.tensor([[1, 2, 2, 7], [3, 3, 49, 0]]))).sum()
    out = out + emb2(torch.tensor([5, 5, 5, 19])).square().sum()
    out.backward()
    assert emb.weight.grad.is_sparse and not emb2.weight.grad.is_coalesced()
    return [emb.weight, lin.weight, lin.bias, emb2.weight]


def _torch_takes_sparse_gradients() -> bool:
    try:
        nn.utils.get_total_norm([torch.ones(2).to_sparse()])
        return True
    except NotImplementedError:  # torch 2.6: no linalg_vector_norm / _foreach_norm for SparseCPU
        return False


TORCH_TAKES_SPARSE = _torch_takes_sparse_gradients()


def densified(params):
    """Copies of ``params`` with dense gradients of the same values (duplicates summed)."""
    out = clone_params(params)
    for q in out:
        if q.grad is not None and q.grad.is_sparse:
            q.grad = q.grad.to_dense()
    return out


@pytest.mark.parametrize("norm_type", [2.0, 1.0, inf, 3.0, 0.0, -1.0, -inf])
def test_sparse_gradients(norm_type):
    params = embedding_model()
    if TORCH_TAKES_SPARSE:
        total = float(torch_total(params, norm_type))
        ours, theirs, t_ours, t_theirs = run_both(params, total / 2, norm_type)
    elif norm_type < 0:
        pytest.skip(f"torch {torch.__version__} has no norm of sparse gradients (NotImplementedError), and "
                    "for negative orders the dense form is no reference: torch takes a sparse gradient's "
                    "norm over its stored values, where the dense one has zeros (compared on newer torch)")
    else:
        # torch 2.6's clip_grad_norm_ / get_total_norm raise NotImplementedError on sparse
        # gradients (both the foreach and the per-tensor path); gradfuse takes them there too.
        # The reference is then torch on the same gradients made dense, its clipped gradients
        # put back in the sparse layout for the comparison (which compares values densely).
        total = float(torch_total(densified(params), norm_type))
        ours = clone_params(params)
        t_ours = gradfuse.clip_grad_norm_(ours, total / 2, norm_type)
        theirs = densified(params)
        t_theirs = nn.utils.clip_grad_norm_(theirs, total / 2, norm_type)
        for p, q in zip(params, theirs):
            if p.grad is not None and p.grad.is_sparse:
                q.grad = q.grad.to_sparse()
    assert_same(ours, theirs, t_ours, t_theirs, torch.float32)
    assert not torch.equal(ours[0].grad.to_dense(), params[0].grad.to_dense())  # clipping happened
    assert not ours[3].grad.is_coalesced()  # scaled in place, as torch leaves it


def test_sparse_gradients_warn_once(monkeypatch):
    monkeypatch.setattr(slow_paths, "_warned", set())
    with pytest.warns(UserWarning, match="sparse gradients take a slower per-tensor PyTorch path"):
        gradfuse.clip_grad_norm_(embedding_model(), 1.0)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradfuse.clip_grad_norm_(embedding_model(), 1.0)


def complex_params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for n, dtype in ((40, torch.complex64), (7, torch.complex64), (70000, torch.complex64),
                     (5, torch.float32)):
        p = nn.Parameter(torch.zeros(n, dtype=dtype, device=device))
        p.grad = torch.randn(n, generator=g, dtype=dtype).to(device)
        params.append(p)
    params[0].grad[3] = 0  # a zero: negative orders go to 0 there
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, inf, 3.0, 0.0, -1.0, -inf])
def test_complex_gradients(device, norm_type, monkeypatch):
    monkeypatch.setattr(slow_paths, "_warned", set())
    params = complex_params(device)
    total = float(torch_total(params, norm_type))
    max_norm = total / 2 if total > 0 else 1.0
    with pytest.warns(UserWarning, match="complex gradients take a slower"):
        ours, theirs, t_ours, t_theirs = run_both(params, max_norm, norm_type)
    assert t_ours.dtype == torch.float32
    assert_same(ours, theirs, t_ours, t_theirs, torch.complex64, nonzero_total=norm_type >= 0)


# Errors: torch's types (or subclasses of them), with the parameter named.

def test_integer_and_bool_gradients_raise_runtime_error():
    for dtype in (torch.int64, torch.bool):
        if hasattr(torch.Tensor, "grad_dtype"):
            p = nn.Parameter(torch.ones(3))
            p.grad_dtype = None  # allow a gradient of another dtype
        else:  # torch < 2.9 (no grad_dtype) refuses a float tensor's int grad: a tensor of its own dtype
            p = torch.ones(3, dtype=dtype)
        p.grad = torch.ones(3, dtype=dtype)
        with pytest.raises(RuntimeError):
            nn.utils.clip_grad_norm_([p], 1.0)
        with pytest.raises(RuntimeError, match=rf"\[0\]' has dtype {dtype}"):
            gradfuse.clip_grad_norm_([p], 1.0)
        with pytest.raises(TypeError):  # and still a TypeError, as gradfuse raised before
            gradfuse.clip_grad_norm_([p], 1.0)


@pytest.mark.parametrize("make", [
    lambda: [None], lambda: [nn.Parameter(torch.ones(2)), 1.0],
    lambda: nn.Sequential(nn.Linear(2, 2)), lambda: nn.Linear(2, 2)], ids=["None", "float", "Sequential", "Linear"])
def test_bad_parameters_raise_torchs_error_types(make):
    with pytest.raises((AttributeError, TypeError)) as theirs:
        nn.utils.clip_grad_norm_(make(), 1.0)
    with pytest.raises(type(theirs.value)) as ours:
        gradfuse.clip_grad_norm_(make(), 1.0)
    assert isinstance(ours.value, AttributeError) and isinstance(ours.value, TypeError)
    assert "gradfuse.clip_grad_norm_" in str(ours.value)


def test_named_parameters_accepted_and_named_in_errors():
    model = nn.Linear(4, 3)
    model.weight.grad = torch.ones(3, 4)
    model.bias.grad = torch.tensor([1.0, math.inf, 0.0])
    with pytest.raises(RuntimeError, match=r"bias \(nan=0, inf=1\)"):
        gradfuse.clip_grad_norm_(model.named_parameters(), 1.0, error_if_nonfinite=True)
    model.bias.grad = torch.ones(3)
    total = gradfuse.clip_grad_norm_(model.named_parameters(), 1.0)
    assert float(total) == pytest.approx(math.sqrt(15), rel=1e-6)


def test_bad_items_for_the_split_functions():
    with pytest.raises(AttributeError, match=r"tensors\[1\] is NoneType"):
        gradfuse.get_total_norm([torch.ones(2), None])
    with pytest.raises(AttributeError, match="NoneType"):
        gradfuse.clip_grads_with_norm_([None], 1.0, torch.tensor(1.0))


# Deliberate differences from torch (README, "Differences from torch.nn.utils").

@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_bad_max_norm_is_refused(bad):
    params = make_params(torch.float32, "cpu")
    nn.utils.clip_grad_norm_(clone_params(params), bad)  # torch scales by it
    with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
        gradfuse.clip_grad_norm_(params, bad)


def test_nan_norm_type_is_refused():
    params = make_params(torch.float32, "cpu")
    assert math.isnan(float(nn.utils.clip_grad_norm_(clone_params(params), 1.0, math.nan)))
    with pytest.raises(ValueError, match="norm_type"):
        gradfuse.clip_grad_norm_(params, 1.0, math.nan)


@pytest.mark.parametrize("norm_type", ["inf", "-inf", torch.tensor(2.0), 3, -2])
def test_norm_type_spellings(norm_type):
    params = make_params(torch.float32, "cpu", sizes_for(float(norm_type), torch.float32))
    compare(params, 0.1, norm_type, torch.float32)


@pytest.mark.parametrize("norm_type", [inf, -inf, -1.0])
def test_empty_gradient_left_out_where_torch_has_no_identity(norm_type):
    params = make_params(torch.float32, "cpu", (30, 0, 7))
    with pytest.raises(RuntimeError, match="empty tensor"):
        nn.utils.clip_grad_norm_(clone_params(params), 0.1, norm_type)
    ours, theirs = clone_params(params), clone_params([params[0], params[2]])
    t_ours = gradfuse.clip_grad_norm_(ours, 0.1, norm_type)
    t_theirs = nn.utils.clip_grad_norm_(theirs, 0.1, norm_type)
    assert_same([ours[0], ours[2]], theirs, t_ours, t_theirs, torch.float32)


def test_fp16_gradient_whose_norm_overflows_fp16():
    p16, p32 = nn.Parameter(torch.zeros(1000, dtype=torch.float16)), nn.Parameter(torch.zeros(10))
    p16.grad = torch.full((1000,), 3000.0, dtype=torch.float16)  # norm 94 868 > fp16 max
    p32.grad = torch.ones(10)
    theirs = clone_params([p16, p32])
    assert float(nn.utils.clip_grad_norm_(theirs, 1.0)) == inf
    assert all(bool((q.grad == 0).all()) for q in theirs)  # torch zeroes every gradient
    total = gradfuse.clip_grad_norm_([p16, p32], 1.0)
    expected = math.sqrt(1000 * 3000.0**2 + 10)
    assert total.dtype == torch.float32 and float(total) == pytest.approx(expected, rel=1e-6)
    assert float(gradfuse.stats([p16, p32]).total_norm) == pytest.approx(1.0, rel=2e-3)


# clip_ and stats

@pytest.mark.parametrize("norm_type", [2.0, -1.0, -inf, 0.0])
def test_stats_orders_against_torch(norm_type):
    params = make_params(torch.float64, "cpu", sizes_for(norm_type, torch.float64))
    grads = [p.grad for p in params]
    s = gradfuse.stats(params, norm_type=norm_type)
    torch.testing.assert_close(s.total_norm, nn.utils.get_total_norm(grads, norm_type),
                               rtol=1e-10, atol=0)
    torch.testing.assert_close(s.norm(), torch.stack(
        [torch.linalg.vector_norm(g, norm_type) for g in grads]), rtol=1e-10, atol=0)
    c = gradfuse.clip_(clone_params(params), 0.01, norm_type)
    torch.testing.assert_close(c.total_norm, s.total_norm, rtol=0, atol=0)


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
