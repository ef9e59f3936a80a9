"""Activation std (per row and per layer) keeps its precision when the values sit far from zero
compared with their spread: a Linear with a large bias, a residual stream, logits."""
import math

import pytest
import torch
from helpers import NoFloat64
from torch import nn

import gradfuse
from gradfuse.core.grad_stats import layer_of


class Block(nn.Module):
    def __init__(self, offset):
        super().__init__()
        self.a = nn.Linear(24, 24)
        self.b = nn.Linear(24, 24)
        with torch.no_grad():
            for lin, shift in ((self.a, offset), (self.b, 3 * offset + 1)):
                lin.bias.fill_(shift)

    def forward(self, x):
        return self.b(self.a(x) - self.a.bias)


class Model(nn.Module):
    def __init__(self, offset):
        super().__init__()
        self.blocks = nn.ModuleList([Block(offset), Block(-offset)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x) - block.b.bias
        return x


def outputs_by_row(model, x):
    """Every module output, as the capture names its rows, in float64."""
    seen, handles = {}, []

    def keep(name):
        def hook(module, args, out):
            seen[name] = out.detach().double()  # returns None: the output stays as it is
        return hook
    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(keep(name or "(root)")))
    model(x)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("offset", [0.0, 100.0, 1e3, 1e4, 1e6])
def test_row_and_layer_std_match_float64(offset):
    torch.manual_seed(0)
    model = Model(offset)
    x = torch.randn(64, 24)
    with gradfuse.capture_activations(model) as cap:
        model(x)
    want = outputs_by_row(model, x)
    got = cap.forward.to_dict()["params"]
    assert set(got) == set(want)
    for name, out in want.items():
        std = out.std().item()
        assert std > 0.01, "a spread to measure"
        assert got[name]["std"] == pytest.approx(std, rel=1e-5), (name, out.mean().item())
    # per layer: the rows of the layer's modules merged, against the std of all their values
    for layer, row in cap.forward.layers().items():
        values = torch.cat([out.reshape(-1) for name, out in want.items()
                            if layer_of(name + ".out", None) == layer])
        assert row["numel"] == values.numel() > 0
        assert row["std"] == pytest.approx(values.std().item(), rel=1e-5), layer
        assert row["mean"] == pytest.approx(values.mean().item(), rel=1e-6, abs=1e-6 * (abs(offset) + 1))


def test_the_measured_case_of_a_far_offset():
    """float32 values of spread 0.25 around 1e4: the unshifted formula gave 0 here."""
    g = torch.Generator().manual_seed(3)
    values = 1e4 + 0.25 * torch.randn(64, 24, generator=g)
    model = nn.Sequential(nn.Identity())
    with gradfuse.capture_activations(model, modules=["0"]) as cap:
        model(values)
    want = values.double().std().item()
    assert cap.forward.std[0].item() == pytest.approx(want, rel=1e-5)
    assert "0.24" in cap.forward.table() or f"{want:.3g}" in cap.forward.table()


def test_the_float32_path_without_float64(cpu_without_float64):
    """Where no kernel runs and float64 is missing (MPS): the reference's corrected two-pass in
    float32, documented as within 1e-4 relative."""
    torch.manual_seed(1)
    model = Model(1e4)
    x = torch.randn(64, 24)
    want = outputs_by_row(model, x)
    with NoFloat64(), gradfuse.capture_activations(model) as cap:
        model(x)
    with NoFloat64():
        std, rms = cap.forward.std, cap.forward.rms
    assert std.dtype == rms.dtype == cap.forward.floats.dtype == torch.float32
    got = cap.forward.to_dict()["params"]
    for name, out in want.items():
        assert got[name]["std"] == pytest.approx(out.std().item(), rel=1e-4), name


def test_nonfinite_rows_have_nan_std():
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.ones(3, 4)
    x[0, 0] = math.inf
    with gradfuse.capture_activations(model) as cap:
        model(x)
    assert math.isnan(cap.forward.std[0].item())
    assert math.isnan(cap.forward.layers()["0"]["std"])
