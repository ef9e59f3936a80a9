"""gradfuse.stats / clip_ / clip_grad_norm_ on a list, served from a cached plan in C++
(gradfuse.walk_cache), give bitwise the functional path's results, and the plan is dropped for
every change the functional path would see."""
import gc
import math
import weakref

import pytest
import torch
from helpers import assert_same_stats, clone_named
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradfuse
from gradfuse.core import params as api
from gradfuse.core import walk_cache

pytestmark = pytest.mark.skipif(walk_cache._walk_class() is None,
                                reason="gradfuse._C not built (or built without ListWalk)")


def make_named(sizes, dtype=torch.float32, seed=0, prefix="p"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        p = nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = (torch.randn(n, generator=g) * 0.01).to(dtype)
        out.append((f"{prefix}{i}", p))
    return out


def uncached(fn, *args, **kwargs):
    """``fn`` on the functional path only (no plan is used or made)."""
    key = walk_cache._key
    walk_cache._key = lambda source: None
    try:
        return fn(*args, **kwargs)
    finally:
        walk_cache._key = key


def assert_same_grads(n1, n2):
    for (_, p), (_, q) in zip(n1, n2):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert p.grad.dtype == q.grad.dtype
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True)


def served(fn, *args, **kwargs):
    """(result, whether a plan served the call)."""
    before = walk_cache.hits
    out = fn(*args, **kwargs)
    return out, walk_cache.hits > before


@pytest.fixture(autouse=True)
def fresh_plans():
    walk_cache.clear()
    yield
    walk_cache.clear()


SIZES = [5, 0, 1, 17, 4096, 65537, 300, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 0.0, 3.0])
def test_stats_bitwise_equal_to_the_functional_path(dtype, norm_type):
    n1 = make_named(SIZES, dtype)
    n2 = clone_named(n1)
    ref = uncached(gradfuse.stats, n2, norm_type=norm_type)
    assert float(ref.total_norm.double()) > 0 and int(ref.counts[:, 3].sum()) == sum(SIZES)
    for step in range(3):
        s, hit = served(gradfuse.stats, n1, norm_type=norm_type)
        assert hit == (step > 0)  # the first call plans, the next ones are served
        assert_same_stats(s, ref)
    for source in (tuple(n1), [p for _, p in n1], [n1[0][1]] + n1[1:]):  # tuple, tensors, mixed
        ref = uncached(gradfuse.stats, source, norm_type=norm_type)
        gradfuse.stats(source, norm_type=norm_type)
        s, hit = served(gradfuse.stats, source, norm_type=norm_type)
        assert hit
        assert_same_stats(s, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_clip_bitwise_equal_and_clips(dtype, norm_type):
    n1 = make_named(SIZES, dtype)
    n2 = clone_named(n1)
    total = float(uncached(gradfuse.stats, n2, norm_type=norm_type).total_norm.double())
    gradfuse.stats(n1, norm_type=norm_type)  # plans
    for max_norm in (total * 0.5, 1e30):  # clips, then does not
        for error_if_nonfinite in (False, True):
            ref = uncached(gradfuse.clip_, n2, max_norm, norm_type, error_if_nonfinite)
            s, hit = served(gradfuse.clip_, n1, max_norm, norm_type, error_if_nonfinite)
            assert hit
            assert_same_stats(s, ref)
            assert_same_grads(n1, n2)
    assert float(s.clip_coef) == 1.0 and float(ref.clip_coef) == 1.0
    clipped = float(uncached(gradfuse.stats, n2, norm_type=norm_type).total_norm.double())
    assert clipped < total * 0.51  # clipping really happened (to half the first total)


def test_clip_grad_norm_on_a_new_list_each_step_is_served():
    n1 = make_named(SIZES)
    n2 = clone_named(n1)
    for step, max_norm in enumerate((1e30, 0.01, 0.001)):
        n3 = clone_named(n2)
        ref = uncached(gradfuse.clip_grad_norm_, [p for _, p in n2], max_norm)
        t, hit = served(gradfuse.clip_grad_norm_, [p for _, p in n1], max_norm)
        assert hit == (step > 0)
        assert t.dtype == ref.dtype and torch.equal(t, ref)
        assert_same_grads(n1, n2)
        torch_t = torch.nn.utils.clip_grad_norm_([p for _, p in n3], max_norm)  # the real torch
        assert float(t) == pytest.approx(float(torch_t), rel=1e-5)
    assert float(t) < 0.011  # the second step clipped to 0.01
    ref = gradfuse.clip_grad_norm_([p for _, p in n2], 0.0005, error_if_nonfinite=True)
    t, hit = served(gradfuse.clip_grad_norm_, [p for _, p in n1], 0.0005, error_if_nonfinite=True)
    assert hit and torch.equal(t, ref)
    assert_same_grads(n1, n2)


def test_nonfinite_error_names_the_parameter_on_the_served_path():
    n1 = make_named(SIZES)
    gradfuse.stats(n1)
    n1[3][1].grad[2] = float("nan")
    with pytest.raises(RuntimeError, match=r"p3 \(nan=1, inf=0\)"):
        gradfuse.clip_(n1, 1.0, error_if_nonfinite=True)
    s, hit = served(gradfuse.stats, n1)
    assert hit and s.nonfinite_names() == ["p3"]


def changes():
    """(description, change(named) -> named) pairs: each must drop the plan for that call."""
    def dtype(named):  # the same name, a parameter and gradient of another dtype
        name, p = named[3]
        q = nn.Parameter(p.detach().double())
        q.grad = p.grad.double()
        named[3] = (name, q)
        return named

    def grad_dtype(named):  # the same parameter, a gradient of another dtype
        p = named[3][1]
        if not hasattr(p, "grad_dtype"):
            pytest.skip("this torch ties a gradient's dtype to its tensor's")
        p.grad_dtype = None
        p.grad = p.grad.to(torch.bfloat16)
        return named

    def shape(named):  # the same name, a parameter and gradient of another shape
        q = nn.Parameter(torch.zeros(3, 7))
        q.grad = torch.linspace(-1, 1, 21).reshape(3, 7)
        named[3] = (named[3][0], q)
        return named

    def none(named):
        named[4][1].grad = None
        return named

    def appears(named):
        p = nn.Parameter(torch.zeros(4))
        named.insert(2, ("new", p))  # no gradient: the row set is unchanged but not the items
        return named

    def added(named):
        p = nn.Parameter(torch.zeros(3))
        p.grad = torch.full((3,), 0.5)
        return named + [("added", p)]

    def renamed(named):
        return [(("q" + n) if i == 5 else n, p) for i, (n, p) in enumerate(named)]

    def swapped(named):
        named[2], named[3] = named[3], named[2]
        return named

    def not_dense(named):
        named[4][1].grad = torch.randn(8192, generator=torch.Generator().manual_seed(1))[::2]
        return named

    def subclass_item(named):
        class Sub(torch.Tensor):
            pass
        p = named[1][1].detach().as_subclass(Sub).requires_grad_()
        p.grad = torch.ones(p.shape)
        named[1] = (named[1][0], p)
        return named

    # (the walk reads each gradient's size and strides every call: a new shape or a gradient
    # that is not dense needs no new plan)
    return [("dtype", dtype, False), ("grad_dtype", grad_dtype, False), ("shape", shape, True), ("none", none, False),
            ("appears", appears, False), ("added", added, False), ("renamed", renamed, False),
            ("swapped", swapped, False), ("not_dense", not_dense, True),
            ("subclass_item", subclass_item, False)]


@pytest.mark.parametrize("change,still_served", [c[1:] for c in changes()],
                         ids=[c[0] for c in changes()])
def test_a_changed_list_is_seen_and_replanned(change, still_served):
    n1 = make_named(SIZES)
    gradfuse.stats(n1)
    assert served(gradfuse.stats, n1)[1]
    n1 = change(n1)
    n2 = clone_named(n1)
    ref = uncached(gradfuse.stats, n2)
    s, hit = served(gradfuse.stats, n1)
    assert_same_stats(s, ref)
    assert hit == still_served
    if type(n1[1][1]) in (torch.Tensor, nn.Parameter):
        # the functional path served the changed list, and made a new plan
        s, hit = served(gradfuse.stats, n1)
        assert hit
        assert_same_stats(s, ref)
    ref = uncached(gradfuse.clip_, n2, 0.001)
    assert_same_stats(gradfuse.clip_(n1, 0.001), ref)
    assert_same_grads(n1, n2)


def test_bad_gradient_after_a_plan_raises_naming_the_parameter():
    n1 = make_named(SIZES)
    gradfuse.stats(n1)
    p6 = n1[6][1]
    if hasattr(p6, "grad_dtype"):
        p6.grad_dtype = None
        p6.grad = torch.ones(300, dtype=torch.int32)
    else:  # a torch without grad_dtype refuses a gradient of another dtype; `.data` swaps it in
        p6.grad.data = torch.ones(300, dtype=torch.int32)
    assert p6.grad.dtype == torch.int32
    with pytest.raises(api.GradientTypeError, match="'p6'.*torch.int32"):
        gradfuse.stats(n1)
    with pytest.raises(api.GradientTypeError, match="'p6'"):
        gradfuse.clip_(n1, 1.0)
    n1[6] = ("p6", None)
    with pytest.raises(AttributeError):
        gradfuse.stats(n1)


def test_new_models_with_recycled_ids():
    """Lists made, planned and freed in turn (ids and addresses come back): each call equals
    the functional path's on its own list."""
    for k in range(12):
        sizes = [3 + (k % 4)] * (5 + k % 3)  # some lists share a length and names, not shapes
        dtype = (torch.float32, torch.bfloat16)[k % 2]
        named = make_named(sizes, dtype, seed=k, prefix="p" if k % 3 else "w")
        ref = uncached(gradfuse.stats, clone_named(named))
        for _ in range(2):
            assert_same_stats(gradfuse.stats(named), ref)
        del named
        gc.collect()


def test_plans_keep_no_model_alive():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model(torch.randn(2, 4)).sum().backward()
    named = list(model.named_parameters())
    for _ in range(3):
        gradfuse.stats(named)
        gradfuse.clip_(named, 0.5)
        gradfuse.clip_grad_norm_(model.parameters(), 0.5)
    assert walk_cache.hits >= 6 and any(p.walk is not None for p in walk_cache._plans.values())
    refs = [weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()]
    refs += [weakref.ref(p.grad) for p in model.parameters()]
    del model, named
    gc.collect()
    assert all(r() is None for r in refs)


def test_dispatch_and_function_modes_take_the_functional_path():
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    n1 = make_named(SIZES)
    n2 = clone_named(n1)
    gradfuse.stats(n1)
    with Record():
        s, hit = served(gradfuse.stats, n1)
    n_ops = len(seen)
    seen.clear()
    with Record():
        ref = uncached(gradfuse.stats, n2)
    assert not hit and len(seen) == n_ops and any("multi_tensor_stats" in f for f in seen)
    assert_same_stats(s, ref)

    class Passthrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        s, hit = served(gradfuse.stats, n1)
    assert not hit
    assert_same_stats(s, ref)


def test_what_the_walk_does_not_serve_is_unchanged():
    n1 = make_named(SIZES)
    for kwargs in ({"norm_type": -1.0}, {"norm_type": -math.inf}, {"histogram": True}):
        ref = uncached(gradfuse.stats, clone_named(n1), **kwargs)
        for _ in range(2):
            s, hit = served(gradfuse.stats, n1, **kwargs)
            assert not hit
            assert_same_stats(s, ref)
    n1[2][1].grad = n1[2][1].grad.to_sparse()
    for _ in range(2):
        n2 = clone_named(n1)
        ref = uncached(gradfuse.clip_grad_norm_, [p for _, p in n2], 1e-4)
        t, hit = served(gradfuse.clip_grad_norm_, [p for _, p in n1], 1e-4)
        assert not hit and torch.equal(t, ref)
        assert_same_grads(n1, n2)


def test_gradient_free_and_empty_lists():
    named = [("a", nn.Parameter(torch.zeros(3)))]
    for _ in range(2):
        s = gradfuse.stats(named)
        assert len(s) == 0 and float(s.total_norm) == 0.0
    assert len(gradfuse.stats([])) == 0
    named[0][1].grad = torch.ones(3)
    s, hit = served(gradfuse.stats, named)
    assert not hit and s.names == ["a"] and float(s.total_norm) == pytest.approx(math.sqrt(3))


def module_twins(seed=0):
    """Two equal models with equal gradients: nested modules, a parameter registered as None,
    a tied parameter."""
    def make():
        torch.manual_seed(seed)
        m = nn.Module()
        m.a, m.b, m.c = nn.Linear(4, 3, bias=False), nn.Sequential(nn.Linear(3, 3), nn.Tanh()), nn.Linear(3, 2)
        m.tied = nn.Linear(3, 2)
        m.tied.weight = m.c.weight
        h = m.b(m.a(torch.randn(5, 4)))
        (m.c(h).pow(2).sum() + m.tied(h).sum()).backward()
        return m
    return make(), make()


@pytest.mark.parametrize("error_if_nonfinite", [False, True])
def test_module_parameters_served_bitwise_and_walked_every_call(error_if_nonfinite):
    m1, m2 = module_twins()
    for step in range(3):  # the first call plans, the next ones are served
        s, hit = served(gradfuse.clip_, m1, 0.05, error_if_nonfinite=error_if_nonfinite)
        ref = uncached(gradfuse.clip_, m2, 0.05, error_if_nonfinite=error_if_nonfinite)
        assert hit == (step > 0)
        assert_same_stats(s, ref)
        assert s.names == [n for n, _ in m1.named_parameters()]
        assert_same_grads(list(m1.named_parameters()), list(m2.named_parameters()))
        s, hit = served(gradfuse.stats, m1, norm_type=3.0)
        assert hit  # the plan (made by the first clip_) serves any order the kernels take
        assert_same_stats(s, uncached(gradfuse.stats, m2, norm_type=3.0))
    # A change the registration hooks do not see is seen by the walk: the functional path, a new plan.
    for m in (m1, m2):
        del m.b
    s, hit = served(gradfuse.clip_, m1, 0.05)
    assert not hit and s.names == [n for n, _ in m1.named_parameters()]
    assert_same_stats(s, uncached(gradfuse.clip_, m2, 0.05))
    assert served(gradfuse.clip_, m1, 0.05)[1]
    # A gradient gone: the functional path, which leaves it out.
    m1.a.weight.grad = m2.a.weight.grad = None
    s, hit = served(gradfuse.stats, m1)
    assert not hit and "a.weight" not in s.names
    assert_same_stats(s, uncached(gradfuse.stats, m2))
    # A parameter replaced under the same name: the one registered at the call is read.
    for m in (m1, m2):
        m.tied.bias = nn.Parameter(torch.full((2,), 3.0))
        m.tied.bias.grad = torch.full((2,), 2.0)
    assert served(gradfuse.stats, m1)[1]  # planned on the call before
    assert_same_stats(gradfuse.stats(m1), uncached(gradfuse.stats, m2))
