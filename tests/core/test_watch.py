"""gradfuse.watch: bitwise the functional stats/clip_ on every path (fast C++ path, functional
fallback), regrouping when gradients change, models that change, monitor, compile, distributed."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_same_stats
from torch import nn

import gradfuse
from gradfuse.core import params as api
from gradfuse.core import watch as watch_mod
from gradfuse.ops import library

needs_ext = pytest.mark.skipif(watch_mod._param_watch_class() is None,
                               reason="gradfuse._C not built (or built without ParamWatch)")
NORM_TYPES = [2.0, 1.0, math.inf, 0.0, 3.5]


class Net(nn.Module):
    """Nested modules, a parameter list, a parameter shared by two modules, one never used."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6))
                                     for _ in range(3)])
        self.extra = nn.ParameterList([nn.Parameter(torch.randn(4)) for _ in range(3)])
        self.head = nn.Linear(6, 2)
        self.tied = nn.Linear(6, 2)
        self.tied.weight = self.head.weight
        self.unused = nn.Parameter(torch.randn(3))
        self.to(dtype)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return (self.head(x) + self.tied(x)).sum() + sum(p.sum() for p in self.extra) * x.sum()


def twins(dtype=torch.float32, seed=0, scale=1.0):
    """Two identical models with identical, non-trivial gradients."""
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        m = Net(dtype)
        x = torch.randn(8, 6, dtype=dtype)
        (m(x) * scale).backward()
        models.append(m)
    return models


def assert_same_grads(m1, m2):
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True)


def set_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)


@needs_ext
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_stats_and_clip_bitwise_equal_to_functional(dtype, norm_type):
    m1, m2 = twins(dtype)
    assert m1.unused.grad is None and m1.head.weight.grad.abs().sum() > 0
    g = gradfuse.watch(m1, norm_type=norm_type)
    for step in range(3):
        s = g.stats()
        assert g.last_path == ("python" if step == 0 else "fast")
        ref = gradfuse.stats(m2, norm_type=norm_type)
        assert_same_stats(s, ref)
        assert len(s) == len(list(m1.parameters())) - 1 and float(s.total_norm) > 0
    s_ref = gradfuse.stats(m2, norm_type=norm_type)
    for max_norm in (float(s_ref.total_norm.double()) * 0.5, 1e9):  # clips, then does not
        c = g.clip_(max_norm)
        assert g.last_path == "fast"
        c_ref = gradfuse.clip_(m2, max_norm, norm_type=norm_type)
        assert_same_stats(c, c_ref)
        assert_same_grads(m1, m2)
    assert bool(c_ref.clipped) is False and float(s_ref.total_norm) > 0


@needs_ext
def test_first_call_clip_and_error_if_nonfinite_match_functional():
    m1, m2 = twins()
    g = gradfuse.watch(m1)
    c = g.clip_(0.1)  # no plan yet: functional stats, then the scale through the new plan
    assert_same_stats(c, gradfuse.clip_(m2, 0.1))
    assert_same_grads(m1, m2)
    assert bool(c.clipped)
    c = g.clip_(0.05, error_if_nonfinite=True)
    assert g.last_path == "fast"
    assert_same_stats(c, gradfuse.clip_(m2, 0.05, error_if_nonfinite=True))
    assert_same_grads(m1, m2)
    for m in (m1, m2):
        m.blocks[1][2].bias.grad[1] = math.inf
    with pytest.raises(RuntimeError, match=r"non-finite.*blocks\.1\.2\.bias \(nan=0, inf=1\)") as e:
        g.clip_(1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as e_ref:
        gradfuse.clip_(m2, 1.0, error_if_nonfinite=True)
    assert str(e.value) == str(e_ref.value)
    assert_same_grads(m1, m2)  # nothing scaled
    assert_same_stats(g.clip_(1.0), gradfuse.clip_(m2, 1.0))  # scaled by NaN, as torch does
    assert_same_grads(m1, m2)


@needs_ext
def test_sources_list_pairs_tensor_and_generator():
    m1, m2 = twins()
    for make in (lambda m: list(m.parameters()), lambda m: list(m.named_parameters()),
                 lambda m: m.head.weight):
        g = gradfuse.watch(make(m1))
        for _ in range(2):
            assert_same_stats(g.stats(), gradfuse.stats(make(m2)))
        assert g.last_path == "fast"
    g = gradfuse.watch(m1.parameters())  # a generator is listed once
    g.stats()
    assert_same_stats(g.stats(), gradfuse.stats(list(m2.parameters())))
    assert len(g) == len(list(m1.parameters()))


@needs_ext
def test_gradients_that_change_between_steps_are_regrouped():
    m1, m2 = twins()
    g = gradfuse.watch(m1)
    g.stats()

    def check(path):
        s = g.stats()
        assert g.last_path == path
        ref = gradfuse.stats(m2)
        assert_same_stats(s, ref)
        # every row belongs to the parameter it names
        grads = dict(m1.named_parameters())
        for name, l2 in zip(s.names, s.l2.tolist()):
            assert l2 == pytest.approx(grads[name].grad.double().norm().item(), rel=1e-6)
        return s

    for m in (m1, m2):  # a gradient became None
        m.blocks[0][0].weight.grad = None
    s = check("python")
    assert "blocks.0.0.weight" not in s.names
    check("fast")
    back = torch.randn(5, 6)
    for m in (m1, m2):  # ... and came back; and others changed dtype (with their parameters)
        m.blocks[0][0].weight.grad = back.clone()
        m.extra.double()
    assert m1.extra[1].grad.dtype == torch.float64
    s = check("python")
    assert s.total_norm.dtype == torch.float64 and "blocks.0.0.weight" in s.names
    check("fast")
    assert_same_stats(g.clip_(0.5), gradfuse.clip_(m2, 0.5))  # two groups, fast
    assert g.last_path == "fast"
    assert_same_grads(m1, m2)
    for m in (m1, m2):  # the unused parameter got one
        m.unused.grad = torch.full((3,), 2.0)
    check("python")
    set_grads(m1, 7)  # zero_grad(set_to_none=True) + backward: all new tensors, same layout
    set_grads(m2, 7)
    check("fast")
    view = torch.randn(6, 2)
    for m in (m1, m2):  # a non-contiguous view as a gradient
        m.head.weight.grad = view.clone().t()
    check("fast")


@needs_ext
def test_mixed_dtypes_rows_follow_the_functional_order():
    m1, m2 = twins()
    for m in (m1, m2):
        m.blocks[1].to(torch.float64)
        m.extra.to(torch.bfloat16)
        m.head.to(torch.float16)
        set_grads(m, 3)
    g = gradfuse.watch(m1)
    g.stats()
    s = g.stats()
    assert g.last_path == "fast"
    assert_same_stats(s, gradfuse.stats(m2))
    assert s.total_norm.dtype == torch.float64
    for norm_type in NORM_TYPES:
        assert_same_stats(gradfuse.watch(m1, norm_type=norm_type).clip_(0.3),
                          gradfuse.clip_(m2, 0.3, norm_type=norm_type))
    assert_same_grads(m1, m2)


@needs_ext
def test_new_or_replaced_parameters_are_seen_deleted_ones_after_refresh():
    m1, m2 = twins()
    g = gradfuse.watch(m1)
    g.stats()
    g.stats()
    for m in (m1, m2):  # a new layer
        m.new = nn.Linear(2, 3)
        set_grads(m, 1)
    s = g.stats()
    assert "new.weight" in s.names
    assert_same_stats(s, gradfuse.stats(m2))
    for m in (m1, m2):  # a parameter replaced
        m.head.bias = nn.Parameter(torch.full((2,), 5.0))
        m.head.bias.grad = torch.tensor([3.0, 4.0])
        m.blocks.append(nn.Linear(6, 6))
        m.blocks[-1].weight.grad = torch.ones(6, 6)
    s = g.stats()
    assert_same_stats(s, gradfuse.stats(m2))
    assert s.l2[s.names.index("head.bias")].item() == 5.0
    assert "blocks.3.weight" in s.names and g.params[g.names.index("head.bias")] is m1.head.bias
    g.stats()
    assert g.last_path == "fast"
    # Deleting bypasses registration: the watch keeps the old parameter until refresh().
    for m in (m1, m2):
        del m.new
    assert "new.weight" in g.stats().names
    g.refresh()
    assert_same_stats(g.stats(), gradfuse.stats(m2))
    assert "new.weight" not in g.names


def test_module_walk_matches_named_parameters():
    m = Net()
    m.shared_list = nn.ModuleList([m.head, m.blocks[0]])  # modules reachable twice
    m.register_parameter("none", None)
    m.blocks[2][0].bias = None
    m.tied_late = nn.Linear(2, 2)
    m.tied_late.weight = m.blocks[0][0].weight  # a parameter under two names: the first one stays
    m.blocks[1].register_parameter("again", m.head.bias)
    names, params = api.named_params(m)
    ref = list(m.named_parameters())
    assert names == [n for n, _ in ref] and all(p is q for p, (_, q) in zip(params, ref))

    class Renamed(nn.Module):  # an override of named_parameters is honoured
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def named_parameters(self, *args, **kwargs):
            for n, p in super().named_parameters(*args, **kwargs):
                yield n.replace("inner.", ""), p

    assert api.named_params(Renamed())[0] == ["weight", "bias"]


@needs_ext
@pytest.mark.parametrize("policy", ["ignore", "warn"])  # one call; stats, flag, then clip
def test_monitor_holds_a_watch_and_matches_functional_clip(policy):
    m1, m2 = twins()
    mon = gradfuse.GradMonitor(m1, max_norm=0.2, every=0, on_nonfinite=policy)
    for step in range(3):
        set_grads(m1, step)
        set_grads(m2, step)
        report = mon.step()
        assert_same_stats(report.stats, gradfuse.clip_(m2, 0.2))
        assert_same_grads(m1, m2)
    assert mon._watch.last_path == "fast" and mon.clipped_steps == 3
    mon = gradfuse.GradMonitor(m1, max_norm=0.2, on_nonfinite="raise", every=0)
    m1.blocks[0][0].bias.grad[0] = math.nan
    with pytest.raises(gradfuse.GradientAnomaly, match=r"blocks\.0\.0\.bias \(nan=1"):
        mon.step()


@needs_ext
def test_functional_path_serves_what_the_fast_path_does_not(monkeypatch):
    m1, m2 = twins()
    names = [("w", m1.head.weight), ("w", m1.head.bias)]  # duplicated names
    g = gradfuse.watch(names)
    for _ in range(2):
        assert_same_stats(g.stats(), gradfuse.stats([("w", m2.head.weight), ("w", m2.head.bias)]))
        assert g.last_path == "python"
    # a device without compiled kernels (here: CPU, as if gradfuse._C had none) runs the reference
    monkeypatch.setitem(library.KERNELS, "cpu", False)
    monkeypatch.setattr(library, "_warned", {"cpu"})
    g = gradfuse.watch(m1)
    for _ in range(2):
        assert_same_stats(g.stats(), gradfuse.stats(m2))
        assert g.last_path == "python"
    monkeypatch.undo()
    # no ParamWatch class at all (an old build): everything through the functional path
    monkeypatch.setattr(watch_mod, "_param_watch_class", lambda: None)
    g = gradfuse.watch(m1)
    for _ in range(2):
        assert_same_stats(g.clip_(0.3), gradfuse.clip_(m2, 0.3))
        assert g.last_path == "python"
    assert_same_grads(m1, m2)


@needs_ext
@pytest.mark.parametrize("norm_type", [-1.0, -math.inf])
def test_negative_orders_take_the_functional_path(norm_type):
    """The kernels keep no min |x| and no sign-free pow: as gradfuse.stats / clip_, every step."""
    lin1, lin2 = nn.Linear(4, 3), nn.Linear(4, 3)
    for m in (lin1, lin2):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    g = gradfuse.watch(lin1, norm_type=norm_type)
    for _ in range(2):
        s, ref = g.stats(), gradfuse.stats(lin2, norm_type=norm_type)
        assert g.last_path == "python" and float(s.total_norm) > 0
        torch.testing.assert_close(s.total_norm, ref.total_norm, rtol=0, atol=0)
    s, ref = g.clip_(1e-3), gradfuse.clip_(lin2, 1e-3, norm_type=norm_type)
    assert bool(s.clipped)
    for a, b in zip(lin1.parameters(), lin2.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@needs_ext
def test_bad_gradients_raise_naming_the_parameter():
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    g = gradfuse.watch(emb)
    with pytest.raises(TypeError, match=r"'weight'.*sparse"):
        g.stats()
    lin = nn.Linear(2, 2)
    lin(torch.ones(1, 2)).sum().backward()
    g = gradfuse.watch(lin)
    g.stats()
    g.stats()
    lin.weight.grad = lin.weight.grad.to_sparse()  # was fine, became sparse
    with pytest.raises(TypeError, match=r"'weight'.*sparse"):
        g.stats()
    with pytest.raises(ValueError, match="norm_type"):
        gradfuse.watch(lin, norm_type=float("nan"))
    with pytest.raises(ValueError, match="max_norm"):
        gradfuse.watch(lin).clip_(float("nan"))


@needs_ext
def test_empty_and_gradient_free_models():
    m = nn.Linear(2, 2)
    g = gradfuse.watch(m)
    for _ in range(2):
        s = g.clip_(1.0)
        assert len(s) == 0 and float(s.total_norm) == 0.0
    assert len(gradfuse.watch([])) == 0 and len(gradfuse.watch([]).stats()) == 0


@pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")
def test_watch_under_torch_compile_takes_the_traceable_path():
    m1, m2 = twins()
    g = gradfuse.watch(m1)
    g.stats()

    def step():
        s = g.clip_(0.1)
        return s.total_norm, s.l2

    explained = torch._dynamo.explain(step)()
    assert explained.graph_break_count == 0
    set_grads(m1, 5)
    set_grads(m2, 5)
    total, l2 = torch.compile(step, backend="aot_eager", fullgraph=True)()
    ref = gradfuse.clip_(m2, 0.1)
    torch.testing.assert_close(total, ref.total_norm)
    torch.testing.assert_close(l2, ref.l2)
    torch.testing.assert_close(m1.head.weight.grad, m2.head.weight.grad)


@pytest.mark.skipif(not torch.cuda.is_available() or not library.has_kernel("cuda"),
                    reason="needs a CUDA GPU and gradfuse's CUDA kernels")
def test_cuda_fast_path_without_host_sync_and_bitwise_equal():
    m1, m2 = (m.cuda() for m in twins())
    for m in (m1, m2):
        m.blocks[1].to(torch.bfloat16)  # two (device, dtype) groups
        set_grads(m, 0)
    g = gradfuse.watch(m1)
    mon = gradfuse.GradMonitor(m1, max_norm=0.1, every=0, on_nonfinite="ignore")
    g.stats()
    mon.step()  # both plans made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = g.stats()
        c = g.clip_(0.05)
        _ = c.clipped, c.l2  # reading the results needs no sync
        mon.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert g.last_path == "fast" and mon._watch.last_path == "fast"
    gradfuse.clip_(m2, 0.1)  # the same calls on the twin, through the functional path
    assert_same_stats(s, gradfuse.stats(m2))
    assert_same_stats(c, gradfuse.clip_(m2, 0.05))
    gradfuse.clip_(m2, 0.1)
    assert_same_grads(m1, m2)


def _distributed_worker(rank, world, init_file, out_dir):
    import datetime
    try:
        # A check failing on one rank leaves the other in a collective: time out, do not hang.
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (world,))
        gen = torch.Generator().manual_seed(0)
        full = [torch.randn(7, 3, generator=gen), torch.randn(4, generator=gen)]
        models = []
        for _ in range(2):
            ps = [nn.Parameter(distribute_tensor(torch.zeros_like(full[0]), mesh, [Shard(0)])),
                  nn.Parameter(torch.zeros(4))]
            ps[0].grad = distribute_tensor(full[0].clone(), mesh, [Shard(0)])
            ps[1].grad = full[1].clone()
            models.append(ps)
        g = gradfuse.watch(models[0])
        for _ in range(2):  # DTensor gradients: the functional path, every step
            assert_same_stats(g.stats(), gradfuse.stats(models[1]))
            assert g.last_path == "python"
        assert_same_stats(g.clip_(0.5), gradfuse.clip_(models[1], 0.5))
        torch.testing.assert_close(models[0][0].grad.full_tensor(), models[1][0].grad.full_tensor(),
                                   rtol=0, atol=0)
        own = [nn.Parameter(torch.zeros(3)) for _ in range(2)]  # pipeline stage: group=
        for p in own:
            p.grad = torch.full((3,), float(rank + 1))
        g = gradfuse.watch(own, group=dist.group.WORLD)
        s, ref = g.stats(), gradfuse.stats(own, group=dist.group.WORLD)
        assert g.last_path == "python" and s.scope == "rank"
        assert_same_stats(s, ref)
        expected = math.sqrt(sum(6 * (r + 1) ** 2 for r in range(world)))
        assert float(s.total_norm) == pytest.approx(expected)
        status = "ok"
    except Exception as e:  # reported to the test in the parent
        import traceback
        status = f"{e!r}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(status)
    if dist.is_initialized():
        # Tearing down while the other rank still waits on this one's last collective aborts
        # that rank (gloo): meet first.
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_dtensor_gradients_and_group_take_the_functional_path(tmp_path):
    world = 2
    mp.spawn(_distributed_worker, args=(world, str(tmp_path / "init"), str(tmp_path)),
             nprocs=world, join=True)
    for rank in range(world):
        assert (tmp_path / f"rank{rank}").read_text() == "ok"
