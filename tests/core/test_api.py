"""gradfuse.stats / tensor_stats / GradStats: fields, host transfer, names, bad input, compile."""
import math

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse.ops import library


def test_stats_fields_follow_vector_norm(device, dtype):
    torch.manual_seed(0)
    grads = [torch.randn(n, device=device).to(dtype) for n in (10, 0, 70000, 3)]
    grads[2][[5, 6, 7]] = 0.0
    params = []
    for g in grads:
        p = nn.Parameter(torch.empty_like(g))
        p.grad = g
        params.append(p)
    s = gradfuse.stats(params)
    assert s.names == ["[0]", "[1]", "[2]", "[3]"]
    rtol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
    for i, g in enumerate(grads):
        gd = g.double()
        torch.testing.assert_close(s.l2[i], torch.linalg.vector_norm(gd), rtol=rtol, atol=1e-12)
        expect_linf = gd.abs().max() if g.numel() else torch.tensor(0.0, dtype=torch.float64, device=device)
        torch.testing.assert_close(s.linf[i], expect_linf, rtol=0, atol=0)
        expect_mean = gd.mean() if g.numel() else torch.tensor(0.0, dtype=torch.float64, device=device)
        torch.testing.assert_close(s.mean[i], expect_mean, rtol=rtol, atol=1e-6)
        assert s.numel[i].item() == g.numel()
        assert s.zero_count[i].item() == (g == 0).sum().item()
        assert s.zero_fraction[i].item() == pytest.approx((g == 0).sum().item() / max(g.numel(), 1))
    assert s.l2[1].item() == 0 and s.zero_fraction[1].item() == 0
    for column in (s.l2, s.linf, s.mean, s.zero_fraction):
        assert column.dtype == torch.float64
    assert not bool(s.nonfinite)
    assert s.total_norm.dtype == dtype and s.total_norm.device == grads[0].device


def test_zero_fraction_is_the_float64_quotient():
    p = nn.Parameter(torch.empty(31))
    p.grad = torch.cat([torch.zeros(15), torch.ones(16)])
    fraction = gradfuse.stats([p]).zero_fraction
    assert fraction.dtype == torch.float64 and fraction.item() == 15 / 31  # float32 would give 0.4838709533


def test_module_source_skips_none_grads():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].weight.grad = torch.ones(2, 4)
    s = gradfuse.stats(model)
    assert s.names == ["1.weight"]
    assert float(s.total_norm) == pytest.approx(math.sqrt(8))


def test_nan_and_inf_propagate_like_torch():
    g = torch.tensor([1.0, math.nan, 2.0, -math.inf])
    s = gradfuse.tensor_stats({"x": g, "y": torch.tensor([math.inf, 1.0])})
    assert math.isnan(s.l2[0]) and math.isnan(s.linf[0])
    assert s.l2[1].item() == math.inf and s.linf[1].item() == math.inf
    assert s.nan_count.tolist() == [1, 0] and s.inf_count.tolist() == [1, 1]
    assert s.nonfinite_names() == ["x", "y"]
    assert math.isnan(float(s.total_norm))


def test_norm_types_for_total_norm(device):
    gs = [torch.randn(100, device=device), torch.randn(7, device=device)]
    for p in (1.0, 2.0, 3.0, 0.5, math.inf, 0.0):
        s = gradfuse.tensor_stats(gs, norm_type=p)
        expect = torch.linalg.vector_norm(torch.cat(gs).double(), p)
        torch.testing.assert_close(s.total_norm.double(), expect, rtol=1e-5, atol=0)
        if p not in (0.0,):
            torch.testing.assert_close(s.norm(p), torch.stack(
                [torch.linalg.vector_norm(g.double(), p) for g in gs]), rtol=1e-5, atol=0)


def test_to_dict_table_and_single_transfer(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model(torch.randn(5, 8)).sum().backward()
    model[0].bias.grad[3] = math.nan
    s = gradfuse.clip_(model, max_norm=0.01)
    calls = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *a, **k):
        calls.append(self.shape)
        return real_cpu(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    d = s.to_dict()
    text = s.table(top=2)
    s.nonfinite_names()
    assert len(calls) == 1  # everything moved in one transfer, then cached
    assert set(d["params"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert d["params"]["0.bias"]["nan_count"] == 1 and d["nonfinite"]
    assert d["params"]["0.weight"]["numel"] == 128
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["parameter", "numel", "l2"]
    assert lines[2].startswith("0.bias")  # NaN sorts first
    assert "2 more parameters" in text and "NON-FINITE: 0.bias" in text
    assert "clipped" in text


def test_table_sort_by_validation():
    s = gradfuse.tensor_stats([torch.ones(3)])
    with pytest.raises(ValueError, match="sort_by"):
        s.table(sort_by="bogus")


@pytest.mark.parametrize("make, match", [
    (lambda: torch.ones(3, dtype=torch.int64), r"'w'.*int64.*not floating point"),
    (lambda: torch.ones(3, dtype=torch.complex64), r"'w'.*complex"),
    (lambda: torch.ones(3, dtype=torch.bool), r"'w'.*bool"),
    (lambda: torch.ones(3).to_sparse(), r"'w'.*sparse"),
])
def test_bad_gradients_name_the_parameter(make, match):
    p = nn.Parameter(torch.ones(3))
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None  # allow a gradient of another dtype, as some frameworks produce
    elif make().dtype != p.dtype:
        p = make()  # torch < 2.9 ties .grad's dtype to the tensor's: a tensor of that dtype
    p.grad = make()
    for fn in (lambda: gradfuse.stats([("w", p)]),
               lambda: gradfuse.clip_([("w", p)], 1.0)):
        with pytest.raises(TypeError, match=match):
            fn()


def test_tensor_stats_names_the_bad_tensor():
    with pytest.raises(TypeError, match=r"the tensor of 'acts' has dtype torch.int32"):
        gradfuse.tensor_stats({"ok": torch.ones(2), "acts": torch.ones(2, dtype=torch.int32)})


def test_bad_source_item():
    with pytest.raises(TypeError, match="item 1 is int"):
        gradfuse.stats([nn.Parameter(torch.ones(1)), 3])


def test_build_info_and_backend():
    info = gradfuse.build_info()
    assert info["torch_version"] == torch.__version__
    if library.extension is not None:
        assert info["extension_loaded"] and info["chunk_elems"] == 65536
        assert gradfuse.backend("cpu") in ("cpu-avx2", "cpu-default")
        assert isinstance(info["with_cuda"], bool)
        if info["with_cuda"]:
            assert "9.0" in info["cuda_archs"] or "TORCH_CUDA_ARCH_LIST" in __import__("os").environ
    assert gradfuse.backend("meta") == "meta"


def test_reference_fallback_warns_once(monkeypatch):
    monkeypatch.setattr(library, "has_kernel", lambda device_type: False)
    monkeypatch.setattr(library, "_warned", set())
    g = [torch.randn(50), torch.randn(3)]
    with pytest.warns(RuntimeWarning, match="pure-PyTorch reference"):
        s = gradfuse.tensor_stats(g)
    with warnings_as_errors():
        gradfuse.tensor_stats(g)  # second call: silent
    assert gradfuse.backend("cpu") == "reference"
    torch.testing.assert_close(s.total_norm.double(), torch.linalg.vector_norm(torch.cat(g).double()),
                               rtol=1e-6, atol=0)


class warnings_as_errors:
    def __enter__(self):
        import warnings
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


@pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")
def test_torch_compile_clip_and_stats():
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    model(torch.randn(4, 6)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    ref = [g.clone() for g in grads]

    def step(gs):
        before = gradfuse.stats(gs)
        s = gradfuse.clip_(gs, max_norm=0.01)
        return s.total_norm, before.l2, s.nonfinite

    eager_params = [nn.Parameter(torch.zeros_like(g)) for g in ref]
    for p, g in zip(eager_params, ref):
        p.grad = g.clone()
    e_total, e_l2, _ = step(eager_params)

    probe = nn.Parameter(torch.zeros(2))
    probe.grad = torch.ones(2)
    explained = torch._dynamo.explain(step)([probe])
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    # aot_eager functionalises the in-place scale op, as inductor does, without a C++ build.
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    c_total, c_l2, c_nonfinite = compiled(list(model.parameters()))
    torch.testing.assert_close(c_total, e_total)
    torch.testing.assert_close(c_l2, e_l2)
    assert not bool(c_nonfinite)
    for p, e in zip(model.parameters(), eager_params):
        torch.testing.assert_close(p.grad, e.grad)
