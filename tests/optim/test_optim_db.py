"""gradfuse.optim's classes over torch's own test database of optimizer settings and errors
(``torch.testing._internal.common_optimizers.optim_db``, as the installed torch ships it): every
input torch tests SGD, Adam and AdamW with on the CPU, in every dtype, several steps of a small
model (a step without gradients, a frozen layer) bit for bit against torch's class, and the state
dicts across the two; every error input gives torch's error, and every input torch lists (CUDA's
included) that sets what the fused step does not do is refused at construction, naming it."""
import copy
import re
import warnings

import pytest
import torch
from test_optim_exact import same_bits
from torch import nn

import gradfuse.optim

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")

OURS = {torch.optim.SGD: gradfuse.optim.SGD, torch.optim.Adam: gradfuse.optim.Adam,
        torch.optim.AdamW: gradfuse.optim.AdamW}
INFOS = [info for info in common_optimizers.optim_db if info.optim_cls in OURS]
REFUSED = ("differentiable", "fused", "capturable")


def _refused(kwargs: dict) -> str | None:
    for key in REFUSED:
        if kwargs.get(key):
            return key
    if any(isinstance(b, torch.Tensor) for b in kwargs.get("betas", ())):
        return "betas"
    return None


def _inputs(device, dtype):
    return [(info.optim_cls, inp) for info in INFOS for inp in info.optim_inputs_func(device=device, dtype=dtype)]


CASES = [(cls, inp) for cls, inp in _inputs("cpu", torch.float32) if _refused(inp.kwargs) is None]
CASE_IDS = [f"{c.__name__}-{i.desc}" for c, i in CASES]


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 13), nn.Sigmoid(), nn.Linear(13, 3)).to(dtype)


def _kwargs(inp):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.kwargs.items()}


def _steps(model, optimizer, dtype, steps=5):
    x = torch.randn(7, 10, generator=torch.Generator().manual_seed(1)).to(dtype)
    for i in range(steps):
        optimizer.zero_grad()
        model[2].weight.requires_grad_(i not in (3, 4))  # a frozen layer for two steps
        if i != 2:  # a step without gradients
            model(x).float().square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cls, inp", CASES, ids=CASE_IDS)
def test_torchs_inputs_bit_for_bit(cls, inp, dtype):
    theirs, ours = _model(dtype), _model(dtype)
    before = [p.detach().clone() for p in theirs.parameters()]
    ref, opt = cls(theirs.parameters(), **_kwargs(inp)), OURS[cls](ours.parameters(), **_kwargs(inp))
    _steps(theirs, ref, dtype)
    _steps(ours, opt, dtype)
    assert any(not torch.equal(p, b) for p, b in zip(theirs.parameters(), before))
    for p, q in zip(theirs.parameters(), ours.parameters()):
        assert same_bits(p.detach(), q.detach())
        assert ref.state[p].keys() == opt.state[q].keys()
        for key in ref.state[p]:
            assert same_bits(ref.state[p][key], opt.state[q][key]), key


@pytest.mark.parametrize("cls, inp", CASES, ids=CASE_IDS)
def test_state_dicts_across_torch_and_gradfuse(cls, inp):
    """A checkpoint of either continues in the other, bit for bit."""
    for first, second in ((cls, OURS[cls]), (OURS[cls], cls)):
        a, b = _model(torch.float32), _model(torch.float32)
        opt_a = first(a.parameters(), **_kwargs(inp))
        _steps(a, opt_a, torch.float32, steps=3)
        b.load_state_dict(a.state_dict())
        opt_b = second(b.parameters(), **_kwargs(inp))
        opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
        _steps(a, opt_a, torch.float32, steps=2)
        _steps(b, opt_b, torch.float32, steps=2)
        assert all(same_bits(p.detach(), q.detach()) for p, q in zip(a.parameters(), b.parameters()))


ERRORS = [(info.optim_cls, e) for info in INFOS for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32)
          if e.error_on == common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR]


@pytest.mark.parametrize("cls, error", ERRORS,
                         ids=[f"{c.__name__}-{e.optimizer_error_input.desc}" for c, e in ERRORS])
def test_torchs_error_inputs_give_torchs_errors(cls, error):
    inp = error.optimizer_error_input
    if issubclass(error.error_type, Warning):
        with pytest.warns(error.error_type, match=error.error_regex):
            OURS[cls](inp.params, **inp.kwargs)
    else:
        with pytest.raises(error.error_type, match=error.error_regex):
            OURS[cls](inp.params, **inp.kwargs)


REFUSED_CASES = [(cls, inp) for device in ("cpu", "cuda") for cls, inp in _inputs(device, torch.float32)
                 if _refused(inp.kwargs) is not None]


def test_refused_inputs_name_the_setting():
    assert REFUSED_CASES  # torch's lists (CUDA's) set capturable, fused or tensor betas
    for cls, inp in REFUSED_CASES:
        params = [nn.Parameter(torch.randn(3))]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own warnings about CUDA-only settings on the CPU
            with pytest.raises(ValueError, match=re.escape(_refused(inp.kwargs))):
                OURS[cls](params, **_kwargs(inp))
