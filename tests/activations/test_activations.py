"""gradfuse.capture_activations and the monitor's activations= / trace_nonfinite=: rows against
plain-PyTorch hooks computing the same numbers in float64, dead units, NaN traced to its module,
bad input, hooks removed, memory flat, hooks armed only on logged steps."""
import dataclasses
import gc
import math
import os
import warnings
import weakref
from collections.abc import Mapping

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse.activations.capture import ROOT_NAME, capture_activations
from gradfuse.activations.dead_units import dead_counts

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# -- the reference: the hooks people write, in float64 ---------------------------------------------
def ref_flatten(output, prefix=""):
    if isinstance(output, torch.Tensor):
        return [(prefix, output)] if output.is_floating_point() else []
    if isinstance(output, Mapping):
        return [kv for k, v in output.items() for kv in ref_flatten(v, f"{prefix}.{k}")]
    if isinstance(output, (tuple, list)):
        return [kv for i, v in enumerate(output) for kv in ref_flatten(v, f"{prefix}[{i}]")]
    if dataclasses.is_dataclass(output):
        return [kv for f in dataclasses.fields(output)
                for kv in ref_flatten(getattr(output, f.name), f"{prefix}.{f.name}")]
    return []


CHANNEL_FIRST = (nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.MaxPool2d, nn.AdaptiveAvgPool2d)


def ref_row(module, t):
    x = t.detach().double()
    finite = x[x.isfinite()]
    dim = 1 if (x.dim() >= 4 or (x.dim() >= 2 and isinstance(module, CHANNEL_FIRST))) else x.dim() - 1
    if x.dim() == 0:
        units, dead = 0, 0
    else:
        units = x.shape[dim]
        per_unit = x.movedim(dim, 0).reshape(units, -1)
        dead = int((per_unit == 0).all(dim=1).sum()) if x.numel() else 0
    n = x.numel()
    return {"numel": n, "l2": x.norm().item(), "linf": x.abs().max().item() if n else 0.0,
            "mean": x.mean().item() if n else 0.0, "std": x.std().item() if n > 1 else math.nan,
            "nan_count": int(x.isnan().sum()), "inf_count": int(x.isinf().sum()),
            "zero_count": int((x == 0).sum()), "zero_fraction": (x == 0).double().mean().item() if n else 0.0,
            "dead_units": dead, "units": units, "_scale": finite.abs().max().item() if finite.numel() else 1.0}


class ReferenceHooks:
    """Forward hooks and output tensor hooks on every module, float64, named as gradfuse names."""

    def __init__(self, model):
        self.forward, self.backward, self.handles, self.calls = {}, {}, [], {}
        self.values = {"forward": {}, "backward": {}}  # row name -> a copy of the tensor
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_hook(self._hook(name or ROOT_NAME, module)))

    def _hook(self, name, module):
        def hook(_m, _a, output):
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            base = name if call == 0 else f"{name}#{call}"
            for suffix, t in ref_flatten(output):
                row = base + suffix
                self.forward[row] = ref_row(module, t)
                self.values["forward"][row] = t.detach().clone()
                if t.requires_grad:
                    t.register_hook(lambda g, row=row: self._backward(row, module, g))
        return hook

    def _backward(self, row, module, g):
        self.backward[row] = ref_row(module, g)
        self.values["backward"][row] = g.detach().clone()

    def remove(self):
        for h in self.handles:
            h.remove()


def assert_rows_match(got: dict, ref: dict):
    assert list(got) and set(got) == set(ref), (sorted(set(got) ^ set(ref)))
    for name, r in ref.items():
        g = got[name]
        for key in ("numel", "nan_count", "inf_count", "zero_count", "dead_units", "units"):
            assert g[key] == r[key], (name, key, g[key], r[key])
        scale = r["_scale"]
        for key in ("l2", "linf", "mean", "std", "zero_fraction"):
            a, b = g[key], r[key]
            if math.isnan(b):
                assert math.isnan(a), (name, key, a)
            else:
                assert abs(a - b) <= 2e-5 * (abs(b) + scale) + 1e-12, (name, key, a, b)
        if r["numel"] > 1:
            assert abs(g["rms"] - r["l2"] / math.sqrt(r["numel"])) <= 1e-5 * (g["rms"] + 1e-30)


def capture_against_reference(model, run):
    ref = ReferenceHooks(model)
    try:
        with capture_activations(model) as cap:
            run()
    finally:
        ref.remove()
    fwd, bwd = cap.forward.to_dict()["params"], cap.backward.to_dict()["params"]
    assert_rows_match(fwd, ref.forward)
    assert_rows_match(bwd, ref.backward)
    # something to compare: non-trivial activations and gradients reached the rows
    assert sum(r["l2"] > 0 for r in fwd.values()) >= len(fwd) // 2
    assert sum(r["l2"] > 0 for r in bwd.values()) >= len(bwd) // 2
    return cap


# -- models ------------------------------------------------------------------------------------------
def tiny_gpt2(layers=2):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)  # the same in-place ReLU, called twice per forward


class TinyResNet(nn.Module):
    """torchvision's ResNet layout, small (torchvision is not a dependency)."""

    def __init__(self, width=8, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


# -- rows equal the reference ------------------------------------------------------------------------
def test_sequential_rows_equal_float64_hooks():
    model = mlp()
    x = torch.randn(7, 6)
    cap = capture_against_reference(model, lambda: model(x).square().sum().backward())
    assert cap.forward.names == ["0", "1", "2", "3", "4", ROOT_NAME]
    assert cap.backward.names[:2] == ["4", ROOT_NAME]  # backward order: hooks on one tensor by registration
    assert cap.hook_count == 0 and cap.first_nonfinite is None


class TwoDtypes(nn.Module):
    """One output of two dtypes (float32, float64): one hook, two tensors, two op calls."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.relu = nn.ReLU()

    def forward(self, x):
        h = self.relu(self.lin(x))
        return h, h.double().tanh()


@pytest.mark.parametrize("make", [mlp, TwoDtypes], ids=["mlp", "two_dtypes"])
def test_exponent_histogram_rows_equal_the_reference_op_and_are_off_by_default(make, monkeypatch):
    from gradfuse.ops import BIN_ABOVE, BIN_ZERO, NUM_BINS, reference
    calls = []
    op = gradfuse.ops.multi_tensor_exponent_histogram
    monkeypatch.setattr(gradfuse.ops, "multi_tensor_exponent_histogram",
                        lambda tensors: calls.append(len(tensors)) or op(tensors))
    model = make()
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))

    def run():
        out = model(x)
        (out[0].sum() + out[1].square().sum() if isinstance(out, tuple) else out.square().sum()).backward()

    ref = ReferenceHooks(model)
    try:
        with capture_activations(model, histogram=True) as cap:
            run()
    finally:
        ref.remove()
    assert calls  # the hooks ran the op (a hook seeing the previous hook's value reuses its rows)
    for side in ("forward", "backward"):
        s = getattr(cap, side)
        h = s.exponent_histogram
        assert h.dtype == torch.int64 and h.shape == (len(s.names), NUM_BINS)
        assert set(s.names) == set(ref.values[side])
        for i, name in enumerate(s.names):
            want = reference.multi_tensor_exponent_histogram([ref.values[side][name]])[0]
            assert torch.equal(h[i], want), (side, name)
        assert h.sum(1).tolist() == s.numel.tolist() and min(s.numel.tolist()) > 0
        # per layer, grouped as layers() groups the rows: every element of the layer, once
        layers, exps = s.layers(), s.layer_exponents()
        assert list(exps) == list(layers)
        for layer, entry in exps.items():
            assert sum(entry["counts"]) == layers[layer]["numel"] > 0, (side, layer)
            assert entry["counts"][0] and entry["counts"][-1]  # trimmed of empty bins
        assert h[:, BIN_ZERO + 1:BIN_ABOVE].sum() > 0  # finite non-zero elements, binned by exponent
    # off (the default): no op call, no histogram, the same statistics
    calls.clear()
    with capture_activations(model) as plain:
        run()
    assert calls == []
    for side in ("forward", "backward"):
        s, full = getattr(plain, side), getattr(cap, side)
        assert s.exponent_histogram is None and s.layer_exponents() is None
        assert s.to_dict() == full.to_dict()


def test_gpt2_rows_equal_float64_hooks():
    pytest.importorskip("transformers")
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    cap = capture_against_reference(model, lambda: model(ids, labels=ids).loss.backward())
    names = cap.forward.names
    assert f"{ROOT_NAME}.logits" in names and f"{ROOT_NAME}.loss" in names  # a ModelOutput
    assert "transformer.h.1.mlp.c_fc" in names and "transformer.h.0.attn[0]" in names  # a tuple output
    assert "transformer.last_hidden_state" in names  # GPT2Model's ModelOutput
    d = cap.forward.to_dict()["params"]
    assert d["transformer.h.1.mlp.c_fc"]["units"] == 4 * 32 and d[f"{ROOT_NAME}.logits"]["units"] == 64
    layers = cap.forward.layers()
    assert {"transformer.h.0", "transformer.h.1", "lm_head", "transformer.wte"} <= set(layers)


def test_resnet_style_cnn_rows_equal_float64_hooks_with_channels_as_units():
    torch.manual_seed(0)
    model = TinyResNet()
    x = torch.randn(4, 3, 16, 16)
    cap = capture_against_reference(model, lambda: model(x).logsumexp(1).sum().backward())
    d = cap.forward.to_dict()["params"]
    assert d["layer2.0.conv1"]["units"] == 16 and d["bn1"]["units"] == 8 and d["fc"]["units"] == 5
    # the in-place ReLU of a block is called twice per forward: one row per call
    assert "layer1.0.relu" in d and "layer1.0.relu#1" in d
    # in-place: bn1's row is its output before the ReLU changed it in place, relu's after
    assert d["bn1"]["zero_fraction"] < 0.01 < d["relu"]["zero_fraction"]
    assert d["bn1"]["mean"] == pytest.approx(0.0, abs=1e-5)  # batch norm in training mode


def test_known_dead_layer_all_units_dead_others_not():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))
    with torch.no_grad():
        model[2].bias.fill_(-1e3)  # every unit of the second ReLU is negative before it: dead
    x = torch.randn(32, 6)
    with capture_activations(model) as cap:
        model(x).sum().backward()
    d = cap.forward.to_dict()["params"]
    assert (d["3"]["dead_units"], d["3"]["units"]) == (12, 12) and d["3"]["dead_fraction"] == 1.0
    assert d["1"]["units"] == 16 and d["1"]["dead_units"] < 4
    assert all(d[n]["dead_units"] == 0 for n in ("0", "2", "4"))
    # behind a dead layer no gradient flows: the first Linear's output gradient is all zero
    b = cap.backward.to_dict()["params"]
    assert b["0"]["zero_fraction"] == 1.0 and b["0"]["dead_units"] == 16 and b["4"]["l2"] > 0
    assert cap.forward.layers()["3"]["dead_fraction"] == 1.0


# -- NaN traced to its origin ----------------------------------------------------------------------
class NaNForward(nn.Module):
    def __init__(self, inner=None):
        super().__init__()
        self.inner = inner if inner is not None else nn.Identity()

    def forward(self, x):
        y = self.inner(x).clone()
        y.view(-1)[3] = math.nan
        return y


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g.view(-1)[1] = math.nan
        return g


class NaNBackward(nn.Module):
    """Finite forward; its backward hands back a gradient with a NaN."""

    def __init__(self, act=None):
        super().__init__()
        self.act = act

    def forward(self, x):
        return _NaNGrad.apply(x if self.act is None else self.act(x))


def test_nan_in_forward_of_a_middle_module_traced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(),
                          nn.Sequential(nn.Linear(8, 8), NaNForward(), nn.Linear(8, 8)), nn.Linear(8, 2))
    with capture_activations(model, trace_nonfinite=True) as cap:
        model(torch.randn(4, 6)).sum().backward()
    assert cap.first_nonfinite == ("forward", "2.1")
    assert cap.describe_nonfinite() == "first non-finite value in the forward output of 2.1 (1 NaN)"
    d = cap.forward.to_dict()["params"]
    assert d["2.0"]["nan_count"] == 0 and d["2.1"]["nan_count"] == 1 and d["3"]["nan_count"] > 0


def test_nan_in_backward_of_another_module_traced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), NaNBackward(), nn.Linear(8, 2))
    with capture_activations(model) as cap:
        model(torch.randn(4, 6)).sum().backward()
    assert cap.forward.nonfinite.item() is False  # the forward is clean
    assert cap.first_nonfinite == ("backward", "2")
    assert "backward of 2 " in cap.describe_nonfinite() and "output of 1 holds 1 NaN" in cap.describe_nonfinite()


def test_nan_traced_in_gpt2_forward_and_backward():
    pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model = tiny_gpt2()
    model.transformer.h[1].attn.c_proj = NaNForward(model.transformer.h[1].attn.c_proj)
    with capture_activations(model) as cap:
        model(ids, labels=ids).loss.backward()
    assert cap.first_nonfinite == ("forward", "transformer.h.1.attn.c_proj")
    model = tiny_gpt2()
    model.transformer.h[0].mlp.act = NaNBackward(model.transformer.h[0].mlp.act)
    with capture_activations(model) as cap:
        model(ids, labels=ids).loss.backward()
    assert cap.first_nonfinite == ("backward", "transformer.h.0.mlp.act")


def test_nan_from_the_loss_names_where_it_entered():
    model = mlp()
    with capture_activations(model) as cap:
        (model(torch.randn(3, 6)).sum() * math.nan).backward()
    o = cap.nonfinite_origin()
    assert o["entered"] and cap.first_nonfinite == ("backward", "4")  # first hook on the output
    assert "from the loss" in cap.describe_nonfinite()


# -- bad input -----------------------------------------------------------------------------------------
def test_module_not_in_model_and_unknown_name():
    model = mlp()
    with pytest.raises(ValueError, match=r"Linear .* is not part of the model Sequential"):
        capture_activations(model, modules=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"no module named '5'; its modules: 0, 1, 2, 3, 4$"):
        capture_activations(model, modules=["5"])
    with pytest.raises(ValueError, match=r"no module named '40'; did you mean '4'"):
        capture_activations(model, modules=["40"])
    with pytest.raises(TypeError, match="modules must hold module names or modules"):
        capture_activations(model, modules=[3])
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        capture_activations([p for p in model.parameters()])
    with capture_activations(model, modules=["2", model[4]], grads=False) as cap:
        model(torch.randn(3, 6)).sum().backward()
    assert cap.forward.names == ["2", "4"] and cap.backward.names == []


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    mask: torch.Tensor
    note: str = "x"


class OddOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return {"pair": (h, h.argmax(-1)), "flag": h > 0, "data": Out(h * 2, h > 1), "none": None,
                "n": 3, "half": h.half()}


def test_tuple_dict_dataclass_outputs_named_int_bool_left_out():
    model = nn.Sequential(OddOutputs())
    with capture_activations(model) as cap:
        out = model[0](torch.randn(2, 4))
        (out["pair"][0].sum() + out["data"].hidden.sum() + out["half"].float().sum()).backward()
    names = cap.forward.names
    assert names == ["0.lin", "0.pair[0]", "0.data.hidden", "0.half"]  # several dtypes in one output
    assert set(cap.backward.names) == {"0.lin", "0.pair[0]", "0.data.hidden", "0.half"}
    assert cap.forward.to_dict()["params"]["0.data.hidden"]["mean"] == pytest.approx(
        2 * cap.forward.to_dict()["params"]["0.pair[0]"]["mean"])


def test_modules_called_twice_get_one_row_per_call():
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), lin)  # weight sharing
    with capture_activations(model) as cap:
        model(torch.randn(2, 4)).sum().backward()
    assert cap.forward.names == ["0", "1", "0#1", ROOT_NAME]
    assert cap.backward.names == ["0#1", ROOT_NAME, "1", "0"]
    assert list(cap.forward.layers()) == ["0", "1", ROOT_NAME]  # calls add up per layer
    assert cap.forward.layers()["0"]["rows"] == 2


def test_inplace_activation_stats_are_the_value_at_the_hooks_moment():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 8),
                          nn.Dropout(0.5, inplace=True), nn.Linear(8, 2))
    x = torch.randn(16, 4)
    ref = ReferenceHooks(model)
    with capture_activations(model) as cap:
        model(x).sum().backward()
    ref.remove()
    assert_rows_match(cap.forward.to_dict()["params"], ref.forward)
    assert_rows_match(cap.backward.to_dict()["params"], ref.backward)
    d = cap.forward.to_dict()["params"]
    # each row is its module's value when its hook ran, before the next in-place module changed it
    assert d["0"]["zero_count"] == 0 < d["1"]["zero_count"] and d["2"]["zero_count"] == 0 < d["3"]["zero_count"]
    b = cap.backward.to_dict()["params"]
    assert b["2"]["zero_count"] == d["3"]["zero_count"] and b["3"]["zero_count"] == 0  # dropout's mask


def test_full_backward_hooks_of_the_user_still_work():
    model = mlp()
    seen = []
    model[2].register_full_backward_hook(lambda m, gi, go: seen.append(go[0].norm().item()))
    with capture_activations(model) as cap:
        model(torch.randn(3, 6)).sum().backward()
    assert seen and cap.backward.to_dict()["params"]["2"]["l2"] == pytest.approx(seen[0], rel=1e-5)


class Tagged(torch.Tensor):
    """A tensor subclass that refuses to be detached or read by other ops than the model's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if "detach" in getattr(func, "__name__", "") or "multi_tensor" in str(func):
            raise RuntimeError(f"Tagged refuses {func}")
        return super().__torch_function__(func, types, args, kwargs or {})


class SubclassOut(nn.Module):
    def forward(self, x):
        return x.as_subclass(Tagged)


def test_a_hook_that_fails_warns_once_and_leaves_the_module_out(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    from gradfuse.activations import capture as acts
    real = acts.unit_dim

    def broken(module, t):
        if t.shape[-1] == 2:
            raise RuntimeError("an odd output")
        return real(module, t)
    monkeypatch.setattr(acts, "unit_dim", broken)
    with pytest.warns(RuntimeWarning, match=r"module '2' left out \(forward hook: RuntimeError: an odd output"):
        with capture_activations(model) as cap:
            for _ in range(3):
                model(torch.randn(3, 4)).sum().backward()  # training goes on
    assert "2" in cap.skipped and not any(n.startswith("2") for n in cap.forward.names)
    assert sum(1 for n in cap.forward.names if n.split("#")[0] == "0") == 3


def test_tensor_subclass_output_does_not_break_training():
    model = nn.Sequential(nn.Linear(4, 4), SubclassOut(), nn.Linear(4, 2))
    with pytest.warns(RuntimeWarning, match=r"module '1' left out \(forward hook: RuntimeError: Tagged refuses"):
        with capture_activations(model) as cap:
            model(torch.randn(3, 4)).sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0
    assert cap.forward.names == ["0"] and set(cap.skipped) == {"1", "2", ROOT_NAME}
    assert cap.backward.names == ["0"]


def test_hooks_removed_when_forward_or_backward_raises():
    model = mlp()

    def counts():
        return sum(len(m._forward_hooks) for m in model.modules())

    with pytest.raises(RuntimeError, match="shape"):
        with capture_activations(model):
            model(torch.randn(3, 5))
    assert counts() == 0

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom in backward")

    with pytest.raises(ValueError, match="boom"):
        with capture_activations(model) as cap:
            out = model(Boom.apply(torch.randn(3, 6, requires_grad=True)))
            out.sum().backward()
    assert counts() == 0 and cap.hook_count == 0


def test_no_reference_kept_to_activations_or_gradients():
    model = mlp()
    caps, refs = [], []
    for _ in range(5):
        with capture_activations(model) as cap:
            out = model(torch.randn(64, 6))
            hidden = model[1](model[0](torch.randn(64, 6)))
            refs += [weakref.ref(out), weakref.ref(hidden)]
            out.sum().backward()
        caps.append(cap)  # the captures stay alive: they must not hold the tensors
        del out, hidden
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(caps[-1].forward) > 0


def live_tensors():
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on deprecated torch objects warns
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_memory_flat_over_many_monitored_steps():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = gradfuse.GradMonitor(model, every=2, activations=True, trace_nonfinite=True)
    counts = []
    for step in range(40):
        model(torch.randn(8, 6)).square().mean().backward()
        mon.step()
        opt.step()
        opt.zero_grad()
        if step in (9, 19, 39):
            counts.append(live_tensors())
    assert counts[0] == counts[1] == counts[2], counts


# -- the monitor ----------------------------------------------------------------------------------------
def forward_hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def test_monitor_arms_hooks_only_for_logged_steps(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = gradfuse.JsonlSink(tmp_path / "run.jsonl")
    mon = gradfuse.GradMonitor(model, every=3, activations=True, sinks=[sink])
    armed_during = []
    for step in range(8):
        armed_during.append(forward_hooks(model))
        model(torch.randn(4, 6)).square().mean().backward()
        report = mon.step()
        assert (report.activations is not None) == (step % 3 == 0)
        opt.step()
        opt.zero_grad()
    assert [n > 0 for n in armed_during] == [s % 3 == 0 for s in range(8)]
    assert armed_during[1] == armed_during[2] == 0  # no hook at all on unlogged steps
    mon.close()
    assert forward_hooks(model) == 0
    from gradfuse.sinks import metrics, read_jsonl
    recs = read_jsonl(tmp_path / "run.jsonl")
    logged = [r for r in recs if "act" in r]
    assert [r["step"] for r in logged] == [0, 3, 6]
    assert not any("act_exponents" in r or "act_grad_exponents" in r for r in recs)  # histogram=False
    m = metrics(logged[0])
    assert {"act/0/rms", "act/3/dead_fraction", "act_grad/4/rms", "act/(root)/std"} <= set(m)
    assert m["act/0/rms"] > 0 and m["act_grad/0/rms"] > 0


def test_monitor_trace_nonfinite_names_the_origin_in_the_message():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
    plant = {"on": False}

    def poison(_m, _a, out):
        if plant["on"]:
            out = out.clone()
            out[0, 0] = math.inf
            return out
    model[2].register_forward_hook(poison)  # before gradfuse's: gradfuse sees the returned output
    mon = gradfuse.GradMonitor(model, every=0, trace_nonfinite=True, on_nonfinite="warn")
    assert forward_hooks(model) > 1  # traced every step
    for step in range(4):
        plant["on"] = step == 2
        model(torch.randn(3, 6)).sum().backward()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            report = mon.step()
        for p in model.parameters():
            p.grad = None
        if step == 2:
            assert report.first_nonfinite == ("forward", "2")
            assert report.message.startswith("first non-finite value in the forward output of 2 (1 Inf); "
                                             "non-finite gradients in ")
            assert any("step 2: first non-finite value in the forward output of 2" in str(x.message) for x in w)
        else:
            assert report.first_nonfinite is None and not report.anomalies


def test_attach_passes_the_model_and_needs_it():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"need the model as an nn.Module .*attach\(optimizer, model"):
        gradfuse.attach(opt, activations=True)
    handle = gradfuse.attach(opt, model, every=2, activations=True)
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert handle.last_report.activations is not None and handle.last_report.step == 2
    handle.detach()
    assert forward_hooks(model) == 0


def test_compiled_models_are_refused_with_a_clear_message():
    model = mlp()
    with pytest.raises(ValueError, match="compiled with torch.compile"):
        capture_activations(torch.compile(model))
    with pytest.raises(ValueError, match="refuse a model compiled with torch.compile"):
        gradfuse.GradMonitor(torch.compile(model), activations=True)
    other = mlp()
    other.compile()
    with pytest.raises(ValueError, match="torch.compile"):
        gradfuse.GradMonitor(other, trace_nonfinite=True)
    gradfuse.GradMonitor(torch.compile(model), every=1)  # without activation hooks: fine


def test_rows_carry_rank_scope_under_distributed(monkeypatch):
    model = mlp()
    with capture_activations(model) as cap:
        model(torch.randn(2, 6)).sum().backward()
    assert cap.forward.scope == "all"
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with capture_activations(model) as cap:
        model(torch.randn(2, 6)).sum().backward()
    assert cap.forward.scope == "rank" and cap.forward.to_dict()["scope"] == "rank"


def test_dead_counts_per_row():
    acts = [torch.tensor([0, 3, 0]), torch.ones(0, dtype=torch.int64), torch.tensor([True, False]),
            torch.tensor([5, 5])]
    assert dead_counts(acts).tolist() == [2, 0, 1, 0]
    assert dead_counts([]).tolist() == []
    assert dead_counts([3, torch.tensor([0, 1, 0]), 0, torch.tensor([0.0])]).tolist() == [3, 2, 0, 1]
    assert dead_counts([0, 4]).tolist() == [0, 4]


@pytest.mark.parametrize("shape,dim", [((5, 3, 4, 4), 1), ((2, 7, 6), 2), ((6,), 0), ((3, 1), 1)])
def test_dead_units_known_from_the_zero_count_agree_with_the_per_unit_pass(shape, dim):
    """On the CPU the per-unit pass is skipped when the zero count decides the answer: too few
    zeros for one unit (0 dead) or all zeros (all dead); every other case takes the pass."""
    from gradfuse.activations.dead_units import _known_dead, _one_slice_alive, _unit_activity
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(shape, generator=gen), torch.zeros(shape), torch.randn(shape, generator=gen).relu()]
    one_dead = torch.randn(shape, generator=gen)
    one_dead.select(dim, 0).zero_()
    almost = one_dead.clone()
    almost[(0,) * len(shape)] = math.nan  # NaN is not zero: the unit is alive
    cases += [one_dead, almost]
    last_zero = torch.randn(shape, generator=gen)
    if len(shape) > 1:
        last_zero[-1] = 0  # the last example (or position) all zero: zeros, no dead unit
        cases.append(last_zero)
    for t in cases:
        truth = int(_unit_activity(t, dim).eq(0).sum()) if t.dim() else 0
        known = _known_dead(t, dim, int(t.eq(0).sum()))
        assert known is None or known == truth
        assert not _one_slice_alive(t, dim) or truth == 0
    assert _one_slice_alive(cases[0], dim) and not _one_slice_alive(cases[1], dim)
    if len(shape) > 1:  # many zeros (a whole last position), no dead unit: the slice decides
        assert _one_slice_alive(last_zero, dim)
    assert _known_dead(one_dead, dim, int(one_dead.eq(0).sum())) is None or shape[dim] == 1
    assert _known_dead(cases[0], dim, 0) == 0 and _known_dead(cases[1], dim, cases[1].numel()) == shape[dim]


def test_trace_with_ignore_policy_still_names_the_origin_and_disabled_monitor_drops_hooks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    mon = gradfuse.GradMonitor(model, every=0, trace_nonfinite=True, on_nonfinite="ignore")
    x = torch.randn(3, 6)
    x[1, 2] = math.nan
    model(x).sum().backward()
    report = mon.step()
    assert report.first_nonfinite == ("forward", "0") and not report.skip
    assert report.message.startswith("first non-finite value in the forward output of 0 (8 NaN)")
    assert forward_hooks(model) > 0
    mon.enabled = False
    mon.step()
    assert forward_hooks(model) == 0


class Huge(nn.Module):
    """Finite outputs whose plain sum overflows (fp32: 4 x 3e38; fp16: 4 x 6e4)."""

    def forward(self, x):
        big = 3e38 if x.dtype == torch.float32 else 6e4
        return x * 0 + torch.full_like(x, big)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_trace_mode_counts_are_exact_when_a_finite_output_sums_to_inf(dtype):
    """Trace mode on the CPU reads one plain sum per output; a sum that overflows while every
    element is finite must not be reported as non-finite (the fused op counts it again)."""
    from gradfuse.activations import ActivationCapture
    model = nn.Sequential(nn.Identity(), Huge(), nn.Identity()).to(dtype)
    x = torch.ones(2, 2, dtype=dtype, requires_grad=True)
    cap = ActivationCapture(model, stats=False, trace_nonfinite=True).arm()
    model(x).sum().backward()  # the loss overflows: the gradients stay finite (ones)
    cap.disarm()
    assert cap.first_nonfinite is None
    with torch.no_grad():
        assert torch.isinf(Huge()(x).sum()) and torch.isfinite(Huge()(x)).all()  # the case is real
    x2 = torch.ones(2, 2, dtype=dtype)
    x2[0, 1] = math.nan
    cap = ActivationCapture(model, stats=False, trace_nonfinite=True).arm()
    model(x2 * 2)  # NaN * 0 stays NaN in Huge: its output holds 1 NaN, the Identity before it too
    cap.disarm()
    assert cap.first_nonfinite == ("forward", "0")
    origin = cap.nonfinite_origin()
    assert origin["nan"] == 1 and origin["inf"] == 0
