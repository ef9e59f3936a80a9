"""Per-parameter / per-layer norm clipping, clipping by value, adaptive gradient
clipping. References: torch.nn.utils itself, timm.utils.adaptive_clip_grad, float64 per-layer
arithmetic. Every test also shows there was something to compare: non-zero gradients, some
parameters (or units, or elements) clipped and others not."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradfuse
from gradfuse.core.grad_stats import layer_of

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-7), torch.float64: dict(rtol=1e-12, atol=1e-14),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-3), torch.float16: dict(rtol=2e-3, atol=1e-4)}


class Net(nn.Module):
    """Blocks whose gradients differ in size by orders of magnitude: a threshold between them
    clips some and leaves others alone."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)])
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        x = self.bn(self.conv(x)).mean((2, 3))
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.norm(x)


def _net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = Net().to(dtype)
    m(torch.randn(6, 3, 7, 7, dtype=dtype)).pow(3).sum().backward()
    # spread the gradients' sizes: block 0 large, block 2 tiny
    with torch.no_grad():
        m.blocks[0].weight.grad.mul_(50)
        m.blocks[2].weight.grad.mul_(1e-3)
    return m


def _grads(m):
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def _norm64(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.linalg.vector_norm(x.double(), p)


# --------------------------------------------------------------------------------------------
# per="param"

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_per_param_matches_torch_per_parameter(dtype, norm_type):
    m = _net(dtype)
    before = _grads(m)
    norms = sorted(_norm64(g, norm_type).item() for g in before.values())
    # half clipped, half not; between two norms, so that no row sits on the threshold, where the
    # kernels' float32 accumulation and the float64 reference may round to either side
    k = len(norms) // 2
    max_norm = (norms[k - 1] + norms[k]) / 2
    s = gradfuse.clip_(m, max_norm, norm_type=norm_type, per="param")
    clipped = dict(zip(s.names, s.clipped.tolist()))
    assert 0 < sum(clipped.values()) < len(clipped)
    for name, p in m.named_parameters():
        g = before[name].clone().requires_grad_(False)
        holder = torch.zeros_like(g, requires_grad=True)
        holder.grad = g
        torch.nn.utils.clip_grad_norm_([holder], max_norm, norm_type=norm_type)  # the reference
        assert g.abs().sum() > 0
        torch.testing.assert_close(p.grad, holder.grad, **TOL[dtype])
        # float64 reference of the coefficient
        coef = min(max_norm / (_norm64(before[name], norm_type).item() + 1e-6), 1.0)
        row = s.names.index(name)
        assert s.clip_coef[row].item() == pytest.approx(coef, rel=1e-2 if dtype == torch.bfloat16 else 1e-6)
        assert clipped[name] == (coef < 1)
        if not clipped[name]:
            assert torch.equal(p.grad, before[name])  # untouched, bit for bit


def test_per_param_from_one_stats_pass_same_stats_as_stats():
    m = _net()
    expected = gradfuse.stats(m).to_dict()
    s = gradfuse.clip_(m, 1.0, per="param")
    d = s.to_dict()
    assert d["clip_per"] == "param" and d["max_norm"] == 1.0
    for name, row in expected["params"].items():
        assert d["params"][name]["l2"] == pytest.approx(row["l2"])  # stats from before clipping
        assert d["params"][name]["clipped"] == (row["l2"] > 1.0)
    assert d["clipped"] and 0 < d["clipped_params"] < len(d["params"])
    assert d["clip_coef"] == pytest.approx(min(1.0 / (r["l2"] + 1e-6) for r in expected["params"].values()))
    assert "per param" in s.table()


# --------------------------------------------------------------------------------------------
# per="layer"

@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
@pytest.mark.parametrize("depth", [None, 1])
def test_per_layer_matches_float64_reference(norm_type, depth):
    m = _net()
    before = _grads(m)
    layers: dict[str, list[str]] = {}
    for name in before:
        layers.setdefault(layer_of(name, depth), []).append(name)
    layer_norm = {k: _norm64(torch.cat([before[n].reshape(-1) for n in v]), norm_type).item()
                  for k, v in layers.items()}
    vals = sorted(layer_norm.values())
    max_norm = (vals[0] + vals[-1]) / 2 if depth is None else vals[0] * 0.5
    s = gradfuse.clip_(m, max_norm, norm_type=norm_type, per="layer", layer_depth=depth)
    assert set(gradfuse.stats(m).layers(depth)) == set(layers)  # the monitor's grouping
    n_clipped = 0
    for layer, names in layers.items():
        coef = min(max_norm / (layer_norm[layer] + 1e-6), 1.0)
        n_clipped += coef < 1
        for n in names:
            assert before[n].abs().sum() > 0
            expected = (before[n].double() * coef).float() if coef < 1 else before[n]
            torch.testing.assert_close(dict(m.named_parameters())[n].grad, expected,
                                       rtol=1e-6, atol=1e-7)
            assert s.clip_coef[s.names.index(n)].item() == pytest.approx(coef, rel=1e-6)
    if depth is None:
        assert 0 < n_clipped < len(layers)
    else:
        assert n_clipped == len(layers)
    # after clipping, every clipped layer's norm is max_norm
    after = _grads(m)
    for layer, names in layers.items():
        if layer_norm[layer] > max_norm:
            got = _norm64(torch.cat([after[n].reshape(-1) for n in names]), norm_type).item()
            assert got == pytest.approx(max_norm, rel=1e-5)


def test_per_and_value_bad_input():
    m = _net()
    with pytest.raises(ValueError, match="per"):
        gradfuse.clip_(m, 1.0, per="block")
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="clip_value"):
            gradfuse.clip_(m, None, value=bad)
        with pytest.raises(ValueError, match="clip_value"):
            gradfuse.clip_grad_value_(m.parameters(), bad)
    with pytest.raises(ValueError, match="max_norm"):
        gradfuse.clip_(m, 1.0, value=0.5)
    with pytest.raises(ValueError, match="max_norm"):
        gradfuse.clip_(m, -1.0, per="param")


def test_per_param_nonfinite():
    m = _net()
    m.blocks[1].bias.grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        gradfuse.clip_(m, 1.0, per="param", error_if_nonfinite=True)
    s = gradfuse.clip_(m, 1.0, per="param")
    row = s.names.index("blocks.1.bias")
    assert math.isnan(s.clip_coef[row].item()) and s.clipped[row]
    assert m.blocks[1].bias.grad.isnan().all()  # as torch: scaled by a NaN coefficient
    assert m.blocks[1].weight.grad.isfinite().all()  # the others by their own


# --------------------------------------------------------------------------------------------
# clip_grad_value_

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_value_matches_torch(dtype, foreach):
    def make():
        m = _net(dtype)
        m.blocks[1].bias.grad[0] = float("nan")
        m.blocks[1].bias.grad[1] = float("-inf")
        m.conv.bias.grad = None
        return m

    ours, theirs = make(), make()
    clip = 0.05
    before = _grads(ours)
    assert sum(int((g.abs() > clip).sum()) for g in before.values()) > 0
    assert sum(int((g.abs() <= clip).sum()) for g in before.values()) > 0
    gradfuse.clip_grad_value_((p for p in ours.parameters()), clip, foreach=foreach)  # a generator
    torch.nn.utils.clip_grad_value_(theirs.parameters(), clip, foreach=foreach)
    for (_, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if p.grad is None:
            assert q.grad is None
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("clip", [0, 0.0, 1e30, math.inf, 3])
def test_clip_grad_value_edge_values(clip):
    g = torch.tensor([-5.0, -0.5, -0.0, 0.0, 0.5, 5.0, math.inf, -math.inf, math.nan])
    a = torch.zeros(9, requires_grad=True)
    b = torch.zeros(9, requires_grad=True)
    a.grad, b.grad = g.clone(), g.clone()
    gradfuse.clip_grad_value_(a, clip)  # a single tensor, as torch takes it
    torch.nn.utils.clip_grad_value_(b, clip)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(a.grad.signbit(), b.grad.signbit())


def test_clip_grad_value_no_grads_and_empty():
    a = torch.zeros(3, requires_grad=True)
    gradfuse.clip_grad_value_([a], 1.0)  # no gradient: nothing to do, as torch
    gradfuse.clip_grad_value_([], 1.0)
    e = torch.zeros(0, requires_grad=True)
    e.grad = torch.zeros(0)
    gradfuse.clip_grad_value_([e], 1.0)
    torch.nn.utils.clip_grad_value_([e], 1.0)


def test_clip_value_stats_before_clamping_and_counts():
    m = _net()
    before = _grads(m)
    expected = gradfuse.stats(m).to_dict()["params"]
    s = gradfuse.clip_(m, None, value=0.05)
    d = s.to_dict()
    assert s.clip_value == 0.05
    for name, g in before.items():
        row = s.names.index(name)
        n = int((g.abs() > 0.05).sum())
        assert s.clamped[row].item() == n
        assert d["params"][name]["clamped"] == n
        assert d["params"][name]["l2"] == pytest.approx(expected[name]["l2"])  # before clamping
        torch.testing.assert_close(dict(m.named_parameters())[name].grad, g.clamp(-0.05, 0.05))
    assert 0 < d["clipped_params"] < len(before) or d["clamped"] > 0
    assert 0 < d["clamped"] < sum(g.numel() for g in before.values())
    assert "clamped" in s.table()


# --------------------------------------------------------------------------------------------
# AGC against timm

timm_agc = pytest.importorskip("timm.utils").adaptive_clip_grad


def _agc_net(dtype, seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.Flatten(), nn.Linear(16 * 25, 32),
                      nn.LayerNorm(32), nn.Linear(32, 10)).to(dtype)
    m(torch.randn(4, 3, 7, 7, dtype=dtype)).pow(2).sum().backward()
    with torch.no_grad():  # a zero weight row: eps decides its max norm
        m[3].weight[0].zero_()
        m[3].weight.grad[1:8].mul_(1e-4)  # small units: left alone at clip_factor 0.01
        m[5].weight.grad.mul_(1e-4)
        m[5].bias.grad.mul_(1e-4)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("clip_factor,eps", [(0.01, 1e-3), (0.1, 1e-2), (1.0, 1e-3)])
def test_agc_matches_timm(dtype, norm_type, clip_factor, eps):
    m = _agc_net(dtype)
    ref = _agc_net(dtype)
    before = _grads(m)
    timm_agc(ref.parameters(), clip_factor=clip_factor, eps=eps, norm_type=norm_type)
    gradfuse.adaptive_clip_grad_(m.parameters(), clip_factor=clip_factor, eps=eps, norm_type=norm_type)
    changed_units = kept_units = 0
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert before[name].abs().sum() > 0
        tol = dict(rtol=2e-2, atol=1e-5) if dtype == torch.bfloat16 else TOL[dtype]
        torch.testing.assert_close(p.grad, q.grad, **tol)
        units = before[name].reshape(before[name].shape[0], -1) if p.ndim > 1 else before[name].reshape(1, -1)
        after = p.grad.reshape(units.shape)
        same = (after == units).all(1)
        kept_units += int(same.sum())
        changed_units += int((~same).sum())
    if clip_factor < 1.0:
        assert changed_units > 0 and kept_units > 0, (changed_units, kept_units)


def test_agc_bad_input_and_edge_cases():
    m = _agc_net(torch.float32)
    for kw, word in (({"clip_factor": 0}, "clip_factor"), ({"clip_factor": -1}, "clip_factor"),
                     ({"eps": -1e-3}, "eps"), ({"clip_factor": float("nan")}, "clip_factor"),
                     ({"norm_type": float("nan")}, "norm_type"), ({"norm_type": -1}, "norm_type")):
        with pytest.raises(ValueError, match=word):
            gradfuse.adaptive_clip_grad_(m.parameters(), **kw)
    w = torch.randn(4, 3, requires_grad=True)
    gradfuse.adaptive_clip_grad_([w])  # no gradient: nothing to do
    w.grad = torch.full((4, 3), 10.0)
    w.grad[1] = float("nan")
    ref = w.detach().clone().requires_grad_()
    ref.grad = w.grad.clone()
    gradfuse.adaptive_clip_grad_(w, 0.1)  # a single tensor, NaN units as timm
    timm_agc(ref, 0.1)
    torch.testing.assert_close(w.grad, ref.grad, equal_nan=True)


DTENSOR_SCRIPT = """
import torch, torch.distributed as dist, gradfuse
from torch.distributed.tensor import distribute_tensor, Shard
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    mesh = init_device_mesh("cpu", (1,))
    w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    w.grad = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    try:
        gradfuse.adaptive_clip_grad_([w])
    except TypeError as e:
        print("REFUSED", e)
finally:
    dist.destroy_process_group()
"""


def test_agc_refuses_dtensor():
    # a one-rank mesh in a child process: the process group stays out of this one
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", DTENSOR_SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert "REFUSED gradfuse.adaptive_clip_grad_: DTensor" in out.stdout, out.stdout + out.stderr


def test_per_layer_zero_norm_as_torch_composes_it():
    m = _net()
    with torch.no_grad():
        m.blocks[1].bias.grad.zero_()
    before = _grads(m)
    layer = [n for n in before if n.startswith("blocks.1.")]
    ref = {n: before[n].clone().requires_grad_(False) for n in layer}
    holders = []
    for n in layer:
        h = torch.zeros_like(ref[n], requires_grad=True)
        h.grad = ref[n]
        holders.append(h)
    total = torch.nn.utils.clip_grad_norm_(holders, 0.5, norm_type=0)  # torch on the layer alone
    assert total.item() == 1.0  # one of its two tensors has a non-zero element
    gradfuse.clip_(m, 0.5, norm_type=0, per="layer")
    for n, h in zip(layer, holders):
        torch.testing.assert_close(dict(m.named_parameters())[n].grad, h.grad)
    assert m.blocks[1].weight.grad.abs().sum() > 0
    assert not torch.equal(m.blocks[1].weight.grad, before["blocks.1.weight"])


def test_clip_grad_value_foreach_error_as_torch():
    p = torch.zeros(3, device="meta", requires_grad=True)
    p.grad = torch.zeros(3, device="meta")
    for fn in (torch.nn.utils.clip_grad_value_, gradfuse.clip_grad_value_):
        with pytest.raises(RuntimeError, match="foreach=True was passed, but can't use the foreach API on meta"):
            fn([p], 1.0, foreach=True)
        fn([p], 1.0, foreach=False)  # the per-tensor path takes it


def test_per_param_mixed_dtypes():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(5, 4)), nn.Parameter(torch.zeros(7, dtype=torch.bfloat16)),
              nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(6, dtype=torch.float64))]
    scales = [10.0, 0.01, 0.02, 10.0]
    for p, k in zip(params, scales):
        p.grad = (torch.randn(p.shape) * k).to(p.dtype)
    before = [p.grad.clone() for p in params]
    s = gradfuse.clip_(params, 0.5, per="param")
    for i, (p, b) in enumerate(zip(params, before)):
        coef = min(0.5 / (_norm64(b, 2).item() + 1e-6), 1.0)
        row = s.names.index(f"[{i}]")
        assert s.clip_coef[row].item() == pytest.approx(coef, rel=1e-3)
        expected = (b.double() * coef).to(b.dtype) if coef < 1 else b
        torch.testing.assert_close(p.grad, expected, **TOL[p.dtype])
    assert s.clipped.tolist().count(True) == 2


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.floats(1e-3, 1e3)),
                      min_size=1, max_size=12),
       per=st.sampled_from(["param", "layer"]), frac=st.floats(0.05, 2.0),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_per_clip_property_float64_reference(sizes, per, frac, dtype):
    """Random layers, sizes (empty ones too), scales and dtypes against float64 arithmetic."""
    g = torch.Generator().manual_seed(len(sizes))
    named = []
    for i, (layer, n, scale) in enumerate(sizes):
        p = nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
        named.append((f"blocks.{layer}.p{i}", p))
    before = {n: p.grad.double().clone() for n, p in named}  # .double() of float64 is no copy
    groups: dict[str, list[str]] = {}
    for n, _ in named:
        groups.setdefault(n if per == "param" else layer_of(n), []).append(n)
    norms = {k: torch.cat([before[n] for n in v]).norm().item() for k, v in groups.items()}
    max_norm = frac * max(norms.values()) if max(norms.values()) > 0 else 1.0
    s = gradfuse.clip_(named, max_norm, per=per)
    for k, names in groups.items():
        coef = min(max_norm / (norms[k] + 1e-6), 1.0)
        for n in names:
            got = dict(named)[n].grad
            assert s.clip_coef[s.names.index(n)].item() == pytest.approx(coef, rel=1e-5)
            if coef >= 1:
                assert torch.equal(got.double(), before[n])
            else:
                torch.testing.assert_close(got, (before[n] * coef).to(dtype), **TOL[dtype])


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=4), min_size=1, max_size=8),
       clip_factor=st.floats(1e-3, 2.0), eps=st.floats(0.0, 1e-1),
       norm_type=st.sampled_from([1.0, 2.0, 3.0, math.inf]))
def test_agc_property_against_timm(shapes, clip_factor, eps, norm_type):
    """Random shapes (0-d, empty, conv-like), zero weights, factors and orders against timm."""
    if norm_type == math.inf:  # timm raises there (no inf norm of nothing); gradfuse skips it
        shapes = [[max(d, 1) for d in shape] for shape in shapes]
    g = torch.Generator().manual_seed(len(shapes))
    ours, ref = [], []
    for k, shape in enumerate(shapes):
        w = torch.randn(shape, generator=g) * (0.0 if k == 0 else 0.5)
        grad = torch.randn(shape, generator=g) * 10 ** (k % 3 - 1)
        for out in (ours, ref):
            p = nn.Parameter(w.clone())
            p.grad = grad.clone()
            out.append(p)
    timm_agc(ref, clip_factor=clip_factor, eps=eps, norm_type=norm_type)
    gradfuse.adaptive_clip_grad_(ours, clip_factor=clip_factor, eps=eps, norm_type=norm_type)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
