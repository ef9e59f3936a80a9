"""torch's optimizer database (``torch.testing._internal.common_optimizers.optim_db``, from the
installed torch) with gradfuse's classes in place of torch's, for the tests of torch's
test/test_optim.py copied next to this file (see their docstrings and LICENSE).

``optim_db`` here holds torch's own ``OptimizerInfo`` entries of SGD, Adam and AdamW with:

- ``optim_cls``: ``gradfuse.optim.SGD`` / ``Adam`` / ``AdamW`` (same ``__name__`` as torch's, which
  the copied tests read);
- ``optim_inputs_func``: torch's inputs, less those that set what gradfuse refuses at
  construction (``refused_setting`` says which; ``test_upstream_optim_reference`` checks that each
  of them raises). On the CPU torch's lists hold none: the dropped ones are CUDA's capturable and
  tensor-betas inputs;
- ``supported_impls = ("foreach",)``: torch's class takes ``foreach`` and gradfuse's does too (its
  step is one fused pass either way); ``differentiable`` and ``fused`` are refused, so no copied
  test adds them;
- ``supports_complex = False``, ``supports_sparse = False``, ``supports_fused_on = ()``: refused;
- ``optim_error_inputs_func``: torch's error inputs plus gradfuse's refusals (``differentiable``,
  ``fused``, ``capturable``, tensor ``betas`` / ``weight_decay``, complex and integer parameters
  at construction; a sparse gradient at the step).

Importing torch's ``common_utils`` (as the test modules here do, before or after this one) freezes
``torch.backends`` flags for the whole process (torch's own suite forbids bare assignment to
them); the rest of this suite runs in the same process and sets them (Lightning's Trainer sets
``cudnn.benchmark``), so the freeze is undone here, after that import.
"""
from __future__ import annotations

import copy
import unittest

import pytest
import torch

pytest.importorskip("expecttest")  # torch.testing._internal.common_utils imports it

from torch.testing._internal import common_optimizers  # noqa: E402
from torch.testing._internal.common_methods_invocations import DecorateInfo  # noqa: E402
from torch.testing._internal.common_optimizers import (  # noqa: E402
    ErrorOptimizerInput,
    OptimizerErrorEnum,
    OptimizerInput,
)

# torch.backends.disable_global_flags() undone: the flag lives in torch/backends/__init__.py's globals
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
assert not torch.backends.flags_frozen()

import gradfuse.optim  # noqa: E402

GRADFUSE_CLASSES = {torch.optim.SGD: gradfuse.optim.SGD, torch.optim.Adam: gradfuse.optim.Adam,
                    torch.optim.AdamW: gradfuse.optim.AdamW}
TORCH_CLASSES = {v: k for k, v in GRADFUSE_CLASSES.items()}

# The hyperparameters gradfuse takes as Python numbers only (lr may be a tensor).
_NUMBER_ONLY = ("betas", "weight_decay", "momentum", "dampening", "eps")


def refused_setting(kwargs: dict) -> str | None:
    """The setting of ``kwargs`` that gradfuse's classes refuse at construction, or None."""
    for flag in ("differentiable", "fused", "capturable"):
        if kwargs.get(flag, False):
            return f"{flag}=True"
    for key in _NUMBER_ONLY:
        value = kwargs.get(key)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, torch.Tensor) for v in values):
            return f"{key} as a tensor"
    return None


def _accepted_inputs(inputs_func):
    def accepted(device, dtype=None):
        return [i for i in inputs_func(device, dtype) if refused_setting(i.kwargs) is None]
    return accepted


def _param(dtype=torch.float32, **kwargs):
    return torch.nn.Parameter(torch.randn(2, 2, **kwargs).to(dtype))


def _gradfuse_error_inputs(torch_error_inputs):
    """The error inputs of torch's database, then gradfuse's refusals, each naming the setting."""
    def error_inputs(device, dtype):
        inputs = list(torch_error_inputs(device, dtype))
        if common_optimizers._get_device_type(device) != "cpu":
            return inputs
        construction = [
            (dict(differentiable=True), "differentiable=True is not supported"),
            (dict(fused=True), "fused=True selects torch's own fused kernel"),
            (dict(weight_decay=torch.tensor(0.1)), "weight_decay as a tensor is not supported"),
        ]
        for kwargs, regex in construction:
            inputs.append(ErrorOptimizerInput(OptimizerInput(params=[_param(dtype)], kwargs=kwargs, desc=regex),
                                              error_type=ValueError, error_regex=regex))
        inputs.append(ErrorOptimizerInput(
            OptimizerInput(params=[_param(torch.complex64)], kwargs={}, desc="complex parameter"),
            error_type=ValueError, error_regex=r"parameter 0 of its group is complex \(torch.complex64\)"))
        inputs.append(ErrorOptimizerInput(
            OptimizerInput(params=[torch.ones(2, dtype=torch.int64)], kwargs={}, desc="integer parameter"),
            error_type=ValueError, error_regex="parameter 0 of its group is torch.int64, not a floating-point"))
        sparse = _param(dtype)
        sparse.grad = torch.sparse_coo_tensor([[0], [1]], torch.ones(1, dtype=dtype), (2, 2))
        inputs.append(ErrorOptimizerInput(
            OptimizerInput(params=[sparse], kwargs={}, desc="sparse gradient"),
            error_on=OptimizerErrorEnum.STEP_ERROR, error_type=RuntimeError,
            error_regex=r"a parameter of shape \(2, 2\) has a sparse gradient"))
        return inputs
    return error_inputs


def _sgd_only_error_inputs(base):
    def error_inputs(device, dtype):
        inputs = base(device, dtype)
        if common_optimizers._get_device_type(device) == "cpu":
            inputs.append(ErrorOptimizerInput(
                OptimizerInput(params=[_param(dtype)], kwargs=dict(momentum=torch.tensor(0.9)), desc="tensor momentum"),
                error_type=ValueError, error_regex="momentum as a tensor is not supported"))
        return inputs
    return error_inputs


def _adam_only_error_inputs(base):
    def error_inputs(device, dtype):
        inputs = base(device, dtype)
        if common_optimizers._get_device_type(device) == "cpu":
            inputs += [
                ErrorOptimizerInput(OptimizerInput(params=[_param(dtype)], kwargs=dict(capturable=True),
                                                   desc="capturable"),
                                    error_type=ValueError, error_regex="capturable=True is not supported yet"),
                ErrorOptimizerInput(OptimizerInput(params=[_param(dtype)],
                                                   kwargs=dict(betas=(torch.tensor(0.9), torch.tensor(0.99))),
                                                   desc="tensor betas"),
                                    error_type=ValueError, error_regex="betas as a tensor is not supported"),
            ]
        return inputs
    return error_inputs


# What torch's tests find wrong in gradfuse's classes: expected to fail (an unexpected pass fails
# the run, so the mark goes with the fix).
# - test_deepcopy_copies_all_public_attrs: ``copy.deepcopy`` (and pickle) of an optimizer that has
#   stepped loses its public attribute ``last_rows`` (torch's ``Optimizer.__getstate__`` keeps only
#   defaults, state and param_groups); the copy raises AttributeError on ``last_rows``, as the
#   optimizer itself does before its first step.
KNOWN_DEFECTS = (
    DecorateInfo(unittest.expectedFailure, "TestOptimRenewed", "test_deepcopy_copies_all_public_attrs"),
)


def _gradfuse_info(info):
    ours = copy.copy(info)
    ours.optim_cls = GRADFUSE_CLASSES[info.optim_cls]
    ours.optim_inputs_func = _accepted_inputs(info.optim_inputs_func)
    error_inputs = _gradfuse_error_inputs(info.optim_error_inputs_func)
    if info.optim_cls is torch.optim.SGD:
        error_inputs = _sgd_only_error_inputs(error_inputs)
    else:
        error_inputs = _adam_only_error_inputs(error_inputs)
    ours.optim_error_inputs_func = error_inputs
    ours.supported_impls = ("foreach",)
    ours.supports_fused_on = ()
    ours.supports_complex = False
    ours.supports_sparse = False
    ours.decorators = (*info.decorators, *KNOWN_DEFECTS)
    return ours


optim_db = [_gradfuse_info(info) for info in common_optimizers.optim_db if info.optim_cls in GRADFUSE_CLASSES]
assert [i.optim_cls for i in optim_db] == [gradfuse.optim.Adam, gradfuse.optim.AdamW, gradfuse.optim.SGD]
# torch's own entries, for the tests that run torch's class beside gradfuse's
torch_optim_db = {info.optim_cls: info for info in common_optimizers.optim_db if info.optim_cls in GRADFUSE_CLASSES}
