"""gradfuse.optim's classes as torch's, beyond torch's database of settings (test_optim_db.py):
``isinstance`` with torch's classes, LR schedulers giving torch's lrs and weights, state dicts
crossing between torch's classes and gradfuse's and continuing bit for bit, the step hooks, the
refusals and their messages, ``from_torch``, non-contiguous parameters, sparse gradients, the
closure's return value, pickling."""
import copy
import pickle
import re

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR, StepLR
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import gradfuse.optim

# torch's class, gradfuse's, the settings they step with
PAIRS = [
    (torch.optim.SGD, gradfuse.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.Adam, gradfuse.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    (torch.optim.AdamW, gradfuse.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
]
IDS = ["SGD", "Adam", "AdamW"]


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(model):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    return ((model(x) - y) ** 2).mean()


def _train_step(model, optimizer, **step_kwargs):
    optimizer.zero_grad()
    loss = _loss(model)
    loss.backward()
    optimizer.step(**step_kwargs)
    return loss


def _assert_same(a_tensors, b_tensors):
    """Bit for bit: same dtype, same shape, same values (no NaN here)."""
    a_tensors, b_tensors = list(a_tensors), list(b_tensors)
    assert len(a_tensors) == len(b_tensors) > 0
    for a, b in zip(a_tensors, b_tensors):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.detach(), b.detach())


def _state_tensors(optimizer):
    return [v for state in optimizer.state.values() for _, v in sorted(state.items()) if torch.is_tensor(v)]


@pytest.mark.parametrize("torch_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_is_an_instance_of_torchs_class(torch_cls, fused_cls, kwargs):
    optimizer = fused_cls(_model().parameters(), **kwargs)
    assert isinstance(optimizer, torch_cls)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert isinstance(optimizer, gradfuse.optim.FusedStep)
    assert type(optimizer).__name__ == torch_cls.__name__


def _step_lr(optimizer):
    return StepLR(optimizer, step_size=3, gamma=0.5)


def _one_cycle(optimizer):
    return OneCycleLR(optimizer, max_lr=0.1, total_steps=10)


@pytest.mark.parametrize("make_scheduler, lr", [(_step_lr, 0.05), (_one_cycle, torch.tensor(0.01))],
                         ids=["StepLR", "OneCycleLR-tensor-lr"])
@pytest.mark.parametrize("torch_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_lr_scheduler_gives_torchs_lrs_and_weights(torch_cls, fused_cls, kwargs, make_scheduler, lr):
    runs = []
    for cls in (torch_cls, fused_cls):
        model = _model()
        optimizer = cls(model.parameters(), **{**kwargs, "lr": lr.clone() if torch.is_tensor(lr) else lr})
        scheduler = make_scheduler(optimizer)
        lrs = []
        for _ in range(10):
            _train_step(model, optimizer)
            scheduler.step()
            lrs.append([float(x) for x in scheduler.get_last_lr()])
        runs.append((model, optimizer, lrs))
    (torch_model, torch_opt, torch_lrs), (model, optimizer, lrs) = runs
    assert lrs == torch_lrs
    assert len({x for row in lrs for x in row}) > 2  # the scheduler changed the lr
    _assert_same(torch_model.parameters(), model.parameters())
    _assert_same(_state_tensors(torch_opt), _state_tensors(optimizer))
    if torch.is_tensor(lr):
        assert torch.is_tensor(optimizer.param_groups[0]["lr"])  # still a tensor, updated in place


@pytest.mark.parametrize("direction", ["torch-to-gradfuse", "gradfuse-to-torch"])
@pytest.mark.parametrize("torch_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_state_dict_crosses_between_torch_and_gradfuse(torch_cls, fused_cls, kwargs, direction, tmp_path):
    """3 steps with one class, its state dict saved and loaded into the other class, 3 more steps:
    the same bits as 6 steps of torch's class."""
    first, second = (torch_cls, fused_cls) if direction == "torch-to-gradfuse" else (fused_cls, torch_cls)
    reference = _model()
    reference_opt = torch_cls(reference.parameters(), **kwargs)
    for _ in range(6):
        _train_step(reference, reference_opt)

    model = _model()
    optimizer = first(model.parameters(), **kwargs)
    for _ in range(3):
        _train_step(model, optimizer)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    resumed = second(model.parameters(), **kwargs)
    resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    for _ in range(3):
        _train_step(model, resumed)

    _assert_same(reference.parameters(), model.parameters())
    _assert_same(_state_tensors(reference_opt), _state_tensors(resumed))
    assert not torch.equal(reference[0].weight, _model()[0].weight)  # the steps moved the weights


@pytest.mark.parametrize("torch_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_step_hooks_see_the_step_and_its_arguments(torch_cls, fused_cls, kwargs):
    model = _model()
    optimizer = fused_cls(model.parameters(), **kwargs)
    weight = model[0].weight
    seen = []

    def pre_hook(opt, args, step_kwargs):
        seen.append(("pre", opt is optimizer, args, dict(step_kwargs), weight.detach().clone()))

    def post_hook(opt, args, step_kwargs):
        seen.append(("post", opt is optimizer, args, dict(step_kwargs), weight.detach().clone()))

    handles = [optimizer.register_step_pre_hook(pre_hook), optimizer.register_step_post_hook(post_hook),
               register_optimizer_step_pre_hook(lambda *a: seen.append(("global pre",))),
               register_optimizer_step_post_hook(lambda *a: seen.append(("global post",)))]
    try:
        before = weight.detach().clone()
        _train_step(model, optimizer, stats=True)
    finally:
        for handle in handles:
            handle.remove()
    assert [s[0] for s in seen] == ["global pre", "pre", "post", "global post"]
    (_, pre_opt, pre_args, pre_kwargs, at_pre), (_, post_opt, _, post_kwargs, at_post) = seen[1], seen[2]
    assert pre_opt and post_opt and pre_args == (optimizer,) and pre_kwargs == post_kwargs == {"stats": True}
    assert torch.equal(at_pre, before) and not torch.equal(at_post, before)
    assert len(optimizer.last_rows) == 1  # the step the hooks saw ran with stats=True


def test_add_param_group_refuses_a_fused_group():
    optimizer = gradfuse.optim.SGD(_model().parameters(), lr=0.1)
    extra = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=re.escape("gradfuse.optim.SGD: fused=True selects torch's own fused kernel")):
        optimizer.add_param_group({"params": [extra], "fused": True})


def test_a_refused_param_group_is_not_added():
    optimizer = gradfuse.optim.Adam(_model().parameters(), lr=0.1)
    extra = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError):
        optimizer.add_param_group({"params": [extra], "capturable": True})
    assert len(optimizer.param_groups) == 1


REFUSALS = [
    (gradfuse.optim.Adam, dict(differentiable=True),
     "gradfuse.optim.Adam: differentiable=True is not supported (the fused step is not recorded by autograd); "
     "use torch.optim.Adam"),
    (gradfuse.optim.SGD, dict(differentiable=True),
     "gradfuse.optim.SGD: differentiable=True is not supported (the fused step is not recorded by autograd); "
     "use torch.optim.SGD"),
    (gradfuse.optim.AdamW, dict(fused=True),
     "gradfuse.optim.AdamW: fused=True selects torch's own fused kernel, whose results differ from the default "
     "step; gradfuse.optim.AdamW is fused already and gives the default step's results: leave fused unset"),
    (gradfuse.optim.Adam, dict(capturable=True),
     "gradfuse.optim.Adam: capturable=True is not supported yet: its step counters live on the device, and the "
     "fused step reads them on the host"),
    (gradfuse.optim.AdamW, dict(betas=(torch.tensor(0.9), torch.tensor(0.999))),
     "gradfuse.optim.AdamW: betas as a tensor is not supported (only lr may be a tensor)"),
    (gradfuse.optim.Adam, dict(eps=torch.tensor(1e-8)),
     "gradfuse.optim.Adam: eps as a tensor is not supported (only lr may be a tensor)"),
    (gradfuse.optim.SGD, dict(weight_decay=torch.tensor(0.1)),
     "gradfuse.optim.SGD: weight_decay as a tensor is not supported (only lr may be a tensor)"),
]


@pytest.mark.parametrize("cls, kwargs, message", REFUSALS,
                         ids=[f"{c.__name__}-{next(iter(k))}" for c, k, _ in REFUSALS])
def test_refusal_messages(cls, kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        cls(_model().parameters(), **kwargs)


@pytest.mark.parametrize("param, message", [
    (torch.randn(2, dtype=torch.complex64),
     "gradfuse.optim.SGD: parameter 1 of its group is complex (torch.complex64); the fused step takes float16, "
     "bfloat16, float32 and float64 parameters"),
    (torch.ones(2, dtype=torch.int32), "gradfuse.optim.SGD: parameter 1 of its group is torch.int32, not a "
     "floating-point tensor"),
], ids=["complex", "int32"])
def test_refused_parameters_are_named(param, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        gradfuse.optim.SGD([nn.Parameter(torch.randn(2)), param], lr=0.1)


def test_sparse_gradient_raises_at_the_step():
    embedding = nn.Embedding(10, 3, sparse=True)
    optimizer = gradfuse.optim.SGD(embedding.parameters(), lr=0.1)
    before = embedding.weight.detach().clone()
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match=re.escape("gradfuse.optim.SGD: a parameter of shape (10, 3) has a sparse "
                                                     "gradient; the fused step takes dense gradients")):
        optimizer.step()
    assert torch.equal(embedding.weight.detach(), before)


@pytest.mark.parametrize("torch_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_closure_is_called_with_grad_and_its_value_returned(torch_cls, fused_cls, kwargs):
    model = _model()
    optimizer = fused_cls(model.parameters(), **kwargs)
    returned = object()
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        optimizer.zero_grad()
        _loss(model).backward()
        return returned

    with torch.no_grad():  # the closure runs with gradients all the same
        assert optimizer.step(closure) is returned
    assert calls == [True]
    assert optimizer.step() is None


@pytest.mark.parametrize("torch_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_from_torch_adopts_in_place_and_keeps_torchs_results(torch_cls, fused_cls, kwargs):
    reference, model = _model(), _model()
    reference_opt = torch_cls(reference.parameters(), **kwargs)
    optimizer = torch_cls(model.parameters(), **kwargs)
    for opt, m in ((reference_opt, reference), (optimizer, model)):
        _train_step(m, opt)  # state made by torch's step before the adoption
    groups, state = optimizer.param_groups, optimizer.state

    adopted = gradfuse.optim.from_torch(optimizer)
    assert adopted is optimizer and type(adopted) is fused_cls
    assert adopted.param_groups is groups and adopted.state is state
    assert gradfuse.optim.from_torch(adopted) is adopted
    for _ in range(3):
        _train_step(reference, reference_opt)
        _train_step(model, adopted, stats=True)  # stats=True: gradfuse's step ran
        assert len(adopted.last_rows) == 1
        _assert_same(reference.parameters(), model.parameters())
    _assert_same(_state_tensors(reference_opt), _state_tensors(adopted))


def test_from_torch_with_a_scheduler_attached_before_gives_torchs_lrs_and_weights():
    runs = []
    for adopt in (False, True):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        scheduler = StepLR(optimizer, step_size=2, gamma=0.5)
        if adopt:
            assert gradfuse.optim.from_torch(optimizer) is scheduler.optimizer
        lrs = []
        for _ in range(5):
            _train_step(model, optimizer)
            scheduler.step()
            lrs.append(scheduler.get_last_lr())
        runs.append((model, lrs))
    (reference, reference_lrs), (model, lrs) = runs
    assert lrs == reference_lrs and lrs[-1] == [0.0125]
    _assert_same(reference.parameters(), model.parameters())


def test_from_torch_with_a_scheduler_attached_before_runs_the_fused_step():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    StepLR(optimizer, step_size=2, gamma=0.5)
    gradfuse.optim.from_torch(optimizer)
    _train_step(model, optimizer, stats=True)
    assert len(optimizer.last_rows) == 1


def test_from_torch_keeps_the_step_hooks(monkeypatch):
    # gradfuse.optim.Adam as in a process that has not made one yet: torch wraps a class's step
    # (Optimizer._patch_step_function) when its first instance is made
    monkeypatch.delattr(gradfuse.optim.Adam, "step", raising=False)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    calls = []
    optimizer.register_step_pre_hook(lambda *a: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *a: calls.append("post"))
    gradfuse.optim.from_torch(optimizer)
    _train_step(model, optimizer)
    assert calls == ["pre", "post"]


def test_from_torch_refusals():
    optimizer = torch.optim.Adam(_model().parameters(), lr=0.1, fused=True)
    with pytest.raises(ValueError, match=re.escape("gradfuse.optim.Adam: fused=True selects torch's own fused")):
        gradfuse.optim.from_torch(optimizer)
    assert type(optimizer) is torch.optim.Adam  # left as it was
    with pytest.raises(TypeError, match=re.escape("gradfuse.optim.from_torch takes a torch.optim.SGD, Adam or AdamW, "
                                                  "got torch.optim.rmsprop.RMSprop")):
        gradfuse.optim.from_torch(torch.optim.RMSprop(_model().parameters()))


def _transposed_model(seed=0):
    """A model whose parameters are not contiguous: a transposed weight and a channels_last conv."""
    torch.manual_seed(seed)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    linear_t = nn.Parameter(torch.randn(6, 4).t())  # 4 x 6, strides (1, 4)
    return conv, linear_t


@pytest.mark.parametrize("torch_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_non_contiguous_parameters_step_as_torchs(torch_cls, fused_cls, kwargs):
    runs = []
    for cls in (torch_cls, fused_cls):
        conv, linear_t = _transposed_model()
        params = [conv.weight, conv.bias, linear_t]
        assert not conv.weight.is_contiguous() and not linear_t.is_contiguous()
        optimizer = cls(params, **kwargs)
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2)).to(memory_format=torch.channels_last)
        for _ in range(3):
            optimizer.zero_grad()
            (conv(x).mean(dim=(2, 3)) @ linear_t).square().sum().backward()
            optimizer.step()
        runs.append((params, optimizer))
    (torch_params, torch_opt), (params, optimizer) = runs
    _assert_same(torch_params, params)
    assert [p.stride() for p in params] == [p.stride() for p in torch_params]  # the layout kept
    _assert_same(_state_tensors(torch_opt), _state_tensors(optimizer))
    assert not torch.equal(params[2], _transposed_model()[1])  # the steps moved the weights


@pytest.mark.parametrize("torch_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_pickled_and_deepcopied_optimizers_continue_as_torchs(torch_cls, fused_cls, kwargs):
    runs = []
    for cls in (torch_cls, fused_cls):
        model = _model()
        optimizer = cls(model.parameters(), **kwargs)
        _train_step(model, optimizer)
        for copied in (pickle.loads(pickle.dumps(optimizer)), copy.deepcopy(optimizer)):
            assert type(copied) is cls
            params = [p for group in copied.param_groups for p in group["params"]]
            for p, original in zip(params, model.parameters()):
                p.grad = original.grad.clone()
            copied.step()
            runs.append((cls, params, copied))
    for (_, torch_params, torch_opt), (_, params, optimizer) in zip(runs[:2], runs[2:]):
        _assert_same(torch_params, params)
        _assert_same(_state_tensors(torch_opt), _state_tensors(optimizer))


def test_a_state_dict_of_torchs_fused_optimizer_loads_and_one_with_capturable_is_refused():
    model = _model()
    fused = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    _train_step(model, fused)
    ours = gradfuse.optim.Adam(model.parameters(), lr=0.05)
    ours.load_state_dict(fused.state_dict())
    assert ours.param_groups[0]["fused"] is None and len(ours.state) > 0
    state = fused.state_dict()
    state["param_groups"][0]["capturable"] = True
    with pytest.raises(ValueError, match="capturable=True is not supported"):
        gradfuse.optim.Adam(model.parameters(), lr=0.05).load_state_dict(state)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["scaler.step", "scaler.unscale_ first"])
@pytest.mark.parametrize("torch_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_a_grad_scaler_steps_them_as_torchs(torch_cls, fused_cls, kwargs, unscale_first):
    """GradScaler hands the step its scale and found-Inf flag (``_step_supports_amp_scaling``,
    as torch's fused Adam): unscaled inside the step, an overflow skipped on the device; the
    weights, state and scale of torch's optimizer under the same scaler, bit for bit."""
    def train(cls):
        model = _model()
        opt = cls(model.parameters(), **kwargs)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
        g = torch.Generator().manual_seed(1)
        for step in range(8):
            scaler.scale(model(torch.randn(6, 4, generator=g)).square().sum()).backward()
            if step == 3:  # an overflow: the step is skipped and the scale halved
                model[0].bias.grad[0] = float("inf")
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return model, opt, scaler

    (mt, ot, st), (mf, of, sf) = train(torch_cls), train(fused_cls)
    assert not hasattr(of, "grad_scale") and not hasattr(of, "found_inf")  # the scaler took them back
    assert all(torch.equal(a, b) for a, b in zip(mt.parameters(), mf.parameters()))
    for k, state in ot.state_dict()["state"].items():
        assert all(torch.equal(v, of.state_dict()["state"][k][key]) for key, v in state.items())
    if torch_cls is not torch.optim.SGD:  # (SGD keeps no step counter)
        assert float(of.state_dict()["state"][0]["step"]) == 7  # the overflow step not taken
    assert st.get_scale() == sf.get_scale() != 2.0 ** 12
