"""The fused step's extras, each against what it replaces: a gradient scale against scaling the
gradients first, the skip flag against not stepping, update coefficients and the statistics rows
against the reference (torch's own operations); both CPU kernel builds; the op's argument checks
against the reference's messages."""
import pytest
import torch
from test_optim_exact import same_bits

import gradfuse.optim
from gradfuse import ops
from gradfuse.ops import step_reference
from gradfuse.ops.layout import UPDATE_COUNT_NAMES, UPDATE_FLOAT_NAMES
from gradfuse.optim.table import adam_row, sgd_row

SIZES = [(3,), (40, 33), (70001,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _model(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SIZES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    return params


def _pair(name, dtype, **kwargs):
    a, b = _model(dtype), _model(dtype)
    return a, b, getattr(torch.optim, name)(a, **kwargs), getattr(gradfuse.optim, name)(b, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, kwargs", [("SGD", dict(lr=0.1, momentum=0.9)), ("AdamW", dict(lr=1e-2))])
def test_grad_scale_is_a_scaling_pass_before_the_step(name, kwargs, dtype):
    a, b, torch_opt, fused_opt = _pair(name, dtype, **kwargs)
    coef = torch.tensor(0.37)
    grads_before = [p.grad.clone() for p in b]
    ops.multi_tensor_scale_([p.grad for p in a], coef, conditional=False)
    assert not torch.equal(a[1].grad, grads_before[1])  # the scale changed the gradients
    torch_opt.step()
    fused_opt.step(grad_scale=coef)
    for x, y, g in zip(a, b, grads_before):
        assert same_bits(x.detach(), y.detach())
        assert torch.equal(y.grad, g)  # p.grad keeps its value


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, kwargs", [("SGD", dict(lr=0.1, momentum=0.9)), ("AdamW", dict(lr=1e-2))])
def test_a_scale_per_parameter_is_a_per_tensor_scaling_pass_before_the_step(name, kwargs, dtype):
    a, b = _model(dtype), _model(dtype)
    # two groups, so that a group's scales are picked out of the whole list in param_groups order
    torch_opt = getattr(torch.optim, name)([{"params": a[1:]}, {"params": a[:1], "lr": 0.03}], **kwargs)
    fused_opt = getattr(gradfuse.optim, name)([{"params": b[1:]}, {"params": b[:1], "lr": 0.03}], **kwargs)
    scales = torch.tensor([0.37, 1.0, 0.011], dtype=torch.float64)  # b[1], b[2], b[0]
    grads_before = [p.grad.clone() for p in b]
    ops.multi_tensor_scale_per_tensor_([p.grad for p in (a[1], a[2], a[0])], scales, conditional=False)
    assert not torch.equal(a[0].grad, grads_before[0]) and torch.equal(a[2].grad, grads_before[2])
    torch_opt.step()
    fused_opt.step(grad_scale=scales)
    for x, y, g in zip(a, b, grads_before):
        assert same_bits(x.detach(), y.detach())
        assert torch.equal(y.grad, g)
    with pytest.raises(ValueError, match=r"grad_scale must be one element or float64 \[3\]"):
        fused_opt.step(grad_scale=scales[:2])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_the_op_takes_a_scale_per_tensor_as_the_reference(name, dtype):
    kw = dict(grad_scale=torch.tensor([0.5, 1.0, 3e-3], dtype=torch.float64),
              update_coefs=torch.tensor([1.0, 0.5, 1.0], dtype=torch.float64), stats=True)
    got = _call(ops.multi_tensor_optim_step_, name, dtype, threads=torch.get_num_threads(), **kw)
    want = _call(step_reference.multi_tensor_optim_step_, name, dtype, **kw)
    unscaled = _call(step_reference.multi_tensor_optim_step_, name, dtype, stats=True)
    assert not torch.equal(want[0][2], unscaled[0][2])  # the third tensor's scale changed its step
    for k in (0, 1, 2, 3):
        assert all(same_bits(x, y) for x, y in zip(got[k], want[k]))
    torch.testing.assert_close(got[4][0], want[4][0], rtol=1e-5 if dtype in (torch.float32, torch.float64) else 1e-2,
                               atol=0)


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_skip_leaves_everything_as_it_was(name):
    _, b, _, opt = _pair(name, torch.float32, lr=0.1, **({"momentum": 0.9} if name == "SGD" else {}))
    before = [p.detach().clone() for p in b]
    opt.step(skip=torch.tensor(True))
    assert all(torch.equal(p, q) for p, q in zip(b, before))
    opt.settle_skip()  # the host hears of the flag
    assert len(opt.state) == 0
    opt.step(skip=torch.tensor(0.0))
    assert not torch.equal(b[1].detach(), before[1]) and len(opt.state) == len(b)
    steps = [s.get("step") for s in opt.state.values()]
    weights = [p.detach().clone() for p in b]
    opt.step(skip=torch.tensor(1))
    assert all(torch.equal(p, q) for p, q in zip(b, weights))
    opt.settle_skip()
    assert [s.get("step") for s in opt.state.values()] == steps


def _rows(name, dtype, params, m, v, x, step=1.0):
    if name == "SGD":
        group = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False)
        return 0, torch.tensor([sgd_row(group, False)] * len(params), dtype=torch.float64)
    group = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, maximize=False, amsgrad=True)
    return 1, torch.tensor([adam_row(group, step, True)] * len(params), dtype=torch.float64)


def _state(params, dtype):
    g = torch.Generator().manual_seed(7)
    m = [(torch.randn(p.shape, generator=g) * 0.1).to(dtype) for p in params]
    v = [(torch.rand(p.shape, generator=g) * 0.01).to(dtype) for p in params]
    x = [vi * 1.5 for vi in v]
    return m, v, x


def _call(fn, name, dtype, threads=0, **kw):
    params = [p.detach().clone() for p in _model(dtype)]
    grads = [p.grad.clone() for p in _model(dtype)]
    m, v, x = _state(params, dtype)
    rule, coefs = _rows(name, dtype, params, m, v, x, step=3.0)
    out = fn(params, grads, m, v, x, coefs, rule, threads, **kw)
    return params, m, v, x, out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_rows_and_update_coefficients_against_the_reference(name, dtype, cpu_capability):
    coefs = torch.tensor([0.5, 1.0, 0.25], dtype=torch.float64)
    kw = dict(update_coefs=coefs, stats=True)
    got = _call(ops.multi_tensor_optim_step_, name, dtype, threads=torch.get_num_threads(), **kw)
    want = _call(step_reference.multi_tensor_optim_step_, name, dtype, **kw)
    # weights (clipped or not) and state bit for bit: w_before + c * u is formed alike
    for k in (0, 1, 2, 3):
        assert all(same_bits(a, b) for a, b in zip(got[k], want[k]))
    (f, c), (rf, rc) = got[4], want[4]
    assert f.shape == (3, len(UPDATE_FLOAT_NAMES)) and c.shape == (3, len(UPDATE_COUNT_NAMES))
    assert f[:, 0].min() > 0 and f[:, 1].min() > 0  # update and weight sums of squares non-trivial
    torch.testing.assert_close(f, rf, rtol=1e-5 if dtype in (torch.float32, torch.float64) else 1e-2, atol=0)
    assert torch.equal(c, rc)


def test_write_false_changes_nothing_and_gives_the_same_rows():
    params, m, v, x, (f, c) = _call(ops.multi_tensor_optim_step_, "Adam", torch.float32, stats=True, write=False)
    fresh = [p.detach() for p in _model(torch.float32)]
    assert all(torch.equal(p, q) for p, q in zip(params, fresh))
    assert all(torch.equal(a, b) for a, b in zip(m, _state(params, torch.float32)[0]))
    _, _, _, _, (f2, c2) = _call(ops.multi_tensor_optim_step_, "Adam", torch.float32, stats=True)
    assert torch.equal(f, f2) and torch.equal(c, c2)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.__setitem__(5, torch.zeros(2, 12, dtype=torch.float64)),
     r"coefs must be a contiguous float64 \[3, 12\]"),
    (lambda a: a.__setitem__(6, 2), "rule must be 0"),
    (lambda a: a.__setitem__(2, [torch.empty(0)] * 3), r"Adam's step needs moment1\[0\]"),
    (lambda a: a.append(torch.ones(2, dtype=torch.float64)),
     r"grad_scale must be a one-element tensor or a float64 \[3\] tensor"),
])
def test_bad_arguments_give_the_references_messages(mutate, message):
    for fn in (ops.multi_tensor_optim_step_, step_reference.multi_tensor_optim_step_):
        params = [p.detach().clone() for p in _model(torch.float32)]
        grads = [torch.ones_like(p) for p in params]
        m, v, x = _state(params, torch.float32)
        rule, coefs = _rows("Adam", torch.float32, params, m, v, x)
        args = [params, grads, m, v, x, coefs, rule, 0]
        mutate(args)
        with pytest.raises(RuntimeError, match=message):
            fn(*args)


def test_from_torch_keeps_a_scheduler_attached_before_and_the_hooks():
    p = torch.nn.Parameter(torch.randn(10))
    q = torch.nn.Parameter(p.detach().clone())
    plain = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    adopted = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (plain, adopted)]
    assert gradfuse.optim.from_torch(adopted) is adopted
    calls = []
    adopted.register_step_post_hook(lambda *args: calls.append(1))
    for _ in range(5):
        g = torch.randn(10)
        p.grad, q.grad = g.clone(), g.clone()
        plain.step()
        adopted.step(stats=True)  # a fused step: its rows
        for s in schedulers:
            s.step()  # no "lr_scheduler.step() before optimizer.step()" warning (warnings are errors here)
    assert len(adopted.last_rows) == 1 and len(calls) == 5
    assert torch.equal(p, q) and schedulers[0].get_last_lr() == schedulers[1].get_last_lr() == [0.025]


def test_from_torch_refuses_what_it_cannot_adopt():
    with pytest.raises(TypeError, match="takes a torch.optim.SGD, Adam or AdamW, got torch.optim.rmsprop.RMSprop"):
        gradfuse.optim.from_torch(torch.optim.RMSprop([torch.nn.Parameter(torch.ones(2))]))
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], differentiable=True)
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        gradfuse.optim.from_torch(opt)
