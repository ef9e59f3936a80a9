"""gradfuse.watch on CPU gradients: the direct path (csrc/watch.cpp reads each gradient straight
into the stats kernels' spans, one pass, no dispatcher call) gives bitwise the results of the
functional path, and hands over to the op whenever the op's caller would see a difference:
gradients that are not dense, an active TorchDispatchMode, the profiler's record."""
import math

import pytest
import torch
from helpers import clone_named
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradfuse
from gradfuse.core import watch as watch_mod

pytestmark = pytest.mark.skipif(watch_mod._param_watch_class() is None,
                                reason="gradfuse._C not built (or built without ParamWatch)")


def params_with_grads(sizes, dtype, seed=0, transpose_at=()):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        if i in transpose_at:  # a gradient that is not non-overlapping and dense
            p = nn.Parameter(torch.zeros(n, 3, dtype=dtype))
            p.grad = (torch.randn(6, n, generator=g) * 0.01).to(dtype)[::2].t()
            assert not p.grad.is_contiguous()
        else:
            p = nn.Parameter(torch.zeros(n, dtype=dtype))
            p.grad = (torch.randn(n, generator=g) * 0.01).to(dtype)  # fp16 totals stay finite
        out.append((f"p{i}", p))
    return out


def assert_same(a, b):
    assert a.names == b.names
    assert torch.equal(a.floats, b.floats) and torch.equal(a.counts, b.counts)
    torch.testing.assert_close(a.total_norm, b.total_norm, rtol=0, atol=0, equal_nan=True)
    assert (a.clip_coef is None) == (b.clip_coef is None)
    if a.clip_coef is not None:
        torch.testing.assert_close(a.clip_coef, b.clip_coef, rtol=0, atol=0, equal_nan=True)


def assert_same_grads(n1, n2):
    for (_, p), (_, q) in zip(n1, n2):
        assert torch.equal(p.grad, q.grad)


SIZES = [5, 0, 1, 17, 65536, 65537, 300, 3 * 65536 + 7, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 0.0, 3.0])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("transpose_at", [(), (3,)])
def test_direct_path_bitwise_equal_to_functional(dtype, norm_type, threads, transpose_at):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n1 = params_with_grads(SIZES, dtype, transpose_at=transpose_at)
        n2 = clone_named(n1)
        g = gradfuse.watch(n1, norm_type=norm_type)
        for step in range(3):
            s = g.stats()
            assert g.last_path == ("python" if step == 0 else "fast")
            assert_same(s, gradfuse.stats(n2, norm_type=norm_type))
            assert float(s.total_norm) > 0 and int(s.counts[:, 3].sum()) == sum(
                p.grad.numel() for _, p in n1)
        ref = gradfuse.stats(n2, norm_type=norm_type)
        for max_norm in (float(ref.total_norm.double()) * 0.5, 1e30):  # clips, then does not
            c = g.clip_(max_norm)
            assert g.last_path == "fast"
            c_ref = gradfuse.clip_(n2, max_norm, norm_type=norm_type)
            assert_same(c, c_ref)
            assert_same_grads(n1, n2)
        assert bool(c_ref.clipped) is False and math.isfinite(float(ref.total_norm))
        # clipping happened: the gradients were scaled by 0.5 (to the dtype's rounding)
        assert float(gradfuse.stats(n2).total_norm) < 0.51 * float(gradfuse.stats(clone_named(
            params_with_grads(SIZES, dtype, transpose_at=transpose_at))).total_norm)
    finally:
        torch.set_num_threads(before)


def test_unclipped_step_touches_nothing_and_clipped_step_scales():
    n1 = params_with_grads([7, 9, 11], torch.float32)
    g = gradfuse.watch(n1)
    g.stats()  # makes the plan
    versions = [p.grad._version for _, p in n1]
    before = [p.grad.clone() for _, p in n1]
    c = g.clip_(1e30)
    assert g.last_path == "fast" and not bool(c.clipped)
    assert [p.grad._version for _, p in n1] == versions
    assert all(torch.equal(p.grad, b) for (_, p), b in zip(n1, before))
    c = g.clip_(0.5 * float(c.total_norm))
    assert bool(c.clipped)
    assert all(torch.allclose(p.grad, b * float(c.clip_coef)) for (_, p), b in zip(n1, before))


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_sees_the_op_and_profiler_sees_the_record():
    n1 = params_with_grads([7, 9, 11], torch.float32)
    n2 = clone_named(n1)
    g = gradfuse.watch(n1)
    g.stats()
    with OpLog() as log:
        s = g.stats()
    assert g.last_path == "fast"
    assert any("gradfuse.multi_tensor_stats" in op for op in log.ops), log.ops
    assert_same(s, gradfuse.stats(n2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        s = g.stats()
    assert g.last_path == "fast"
    assert any(e.name == "gradfuse::multi_tensor_stats" for e in prof.events())
    assert_same(s, gradfuse.stats(n2))


def test_gradient_changes_are_still_seen_on_the_direct_path():
    n1 = params_with_grads([7, 9, 11], torch.float32)
    n2 = clone_named(n1)
    g = gradfuse.watch(n1)
    g.stats()
    for named in (n1, n2):  # a new gradient tensor (zero_grad(set_to_none) and backward)
        named[1][1].grad = named[1][1].grad * 3
    s = g.stats()
    assert g.last_path == "fast"
    assert_same(s, gradfuse.stats(n2))
    assert float(s.linf[1]) > 0
    for named in (n1, n2):
        named[0][1].grad = None  # gone
    assert_same(g.clip_(0.1), gradfuse.clip_(n2, 0.1))
    assert g.last_path == "python"
    assert_same_grads(n1[1:], n2[1:])
    assert_same(g.clip_(0.1), gradfuse.clip_(n2, 0.1))
    assert g.last_path == "fast"


def test_monitor_stats_then_clip_matches_functional():
    # a policy needs the flag before clipping: stats, then clip_to on the plan
    n1 = params_with_grads([7, 9, 11, 70000], torch.bfloat16)
    n2 = clone_named(n1)
    mon = gradfuse.GradMonitor(n1, max_norm=1.0, every=0, on_nonfinite="skip")
    for _ in range(3):
        r = mon.step()
        assert_same(r.stats, gradfuse.clip_(n2, 1.0))
        assert_same_grads(n1, n2)
    assert mon._watch.last_path == "fast" and mon.clipped_steps >= 1
