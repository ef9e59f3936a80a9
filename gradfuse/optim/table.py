"""The fused step's table: per parameter, the scalars torch's SGD / Adam / AdamW step forms in
Python, formed here the same way (the same expressions on the same types: Python floats, or a
tensor ``lr``'s own dtype), so that the kernels, which round each as torch's kernels do, give
torch's bits. Columns as ``gradfuse.ops.layout.STEP_COLUMNS``.

Layer: optim. Imports ``gradfuse.ops``.
"""
from __future__ import annotations

import torch

from gradfuse.ops.layout import (
    NUM_STEP_COEFS,
    STEP_AMSGRAD,
    STEP_COLUMNS,
    STEP_DECOUPLED,
    STEP_FIRST,
    STEP_MAXIMIZE,
    STEP_NESTEROV,
)

_INDEX = {name: i for i, name in enumerate(STEP_COLUMNS)}


def _number(x) -> float:
    """A scalar as torch's kernels receive it: a tensor becomes its value (``Scalar(tensor)``)."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _row(values: dict) -> list[float]:
    row = [0.0] * NUM_STEP_COEFS
    for name, v in values.items():
        row[_INDEX[name]] = _number(v)
    return row


def sgd_row(group: dict, first: bool) -> list[float]:
    """The row of a parameter of an SGD ``group`` (``first``: its momentum buffer does not exist
    yet), from torch/optim/sgd.py's ``_single_tensor_sgd``."""
    lr = group["lr"]
    flags = (STEP_MAXIMIZE if group["maximize"] else 0) | (STEP_NESTEROV if group["nesterov"] else 0)
    flags |= STEP_FIRST if first else 0
    return _row({"weight_decay": group["weight_decay"], "momentum": group["momentum"],
                 "damp_alpha": 1 - group["dampening"], "neg_lr": -lr, "flags": flags})


def adam_row(group: dict, step: float, decoupled: bool) -> list[float]:
    """The row of a parameter of an Adam / AdamW ``group`` whose step counter reads ``step``
    after the increment, from torch/optim/adam.py's ``_single_tensor_adam`` (non-capturable)."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    weight_decay = group["weight_decay"]
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    flags = (STEP_MAXIMIZE if group["maximize"] else 0) | (STEP_AMSGRAD if group["amsgrad"] else 0)
    flags |= STEP_DECOUPLED if decoupled else 0
    return _row({"weight_decay": weight_decay, "lerp_weight": 1 - beta1, "beta2": beta2,
                 "one_minus_beta2": 1 - beta2, "bc2_sqrt": bias_correction2 ** 0.5, "eps": group["eps"],
                 "neg_step_size": -step_size, "decay_factor": 1 - lr * weight_decay, "flags": flags})
