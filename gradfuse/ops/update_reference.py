"""The float64 reference of the optimizer-update ops (``multi_tensor_update_stats``,
``multi_tensor_update_clip_``): the tests' yardstick for the kernels and the fallback where the
compiled extension has no kernel, with the same argument checks and messages.

Layer: ops. Imports ``gradfuse.ops.layout`` and ``gradfuse.ops.reference``.
"""
from __future__ import annotations

import torch

from gradfuse.ops.layout import (
    FLAG_AMSGRAD,
    FLAG_DECOUPLED,
    FLAG_MAXIMIZE,
    FLAG_NESTEROV,
    HYPER_BETA1,
    HYPER_BETA2,
    HYPER_EPS,
    HYPER_FLAGS,
    HYPER_LR,
    HYPER_STEP,
    HYPER_WEIGHT_DECAY,
    NUM_HYPER,
    NUM_UPDATE_COUNT_STATS,
    NUM_UPDATE_FLOAT_STATS,
    RULE_ADAM,
    RULE_SGD,
    UPDATE_COUNT_NAMES,
    UPDATE_FLOAT_NAMES,
)
from gradfuse.ops.reference import KERNEL_DTYPES, stack_columns

# ---- The optimizer-update ops: the update that torch.optim.SGD / Adam / AdamW is about to apply,
# with the formulas of csrc/common/update_math.h (the same operations in the same order), here in
# float64. The hyper table stays on the device: every per-tensor constant is a 0-dim tensor and
# every choice a flag makes is a torch.where, so nothing waits for the host.

# ATen's names (c10::ScalarType), as describe_tensor prints them
_DTYPE_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
                torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
                torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def describe(t: torch.Tensor) -> str:
    """A tensor as the compiled ops' messages describe it (``describe_tensor`` in engine.h)."""
    layout = "" if t.layout == torch.strided else f", layout {t.layout}"
    return (f"shape {_shape(t)}, dtype {_dtype_name(t.dtype)} on {t.device}"
            f"{'' if t.is_contiguous() else ', not contiguous'}{layout}")


def check_update_inputs(op: str, params, grads, moment1, moment2, moment2_max, hyper: torch.Tensor,
                        coefs: torch.Tensor | None = None, table: tuple[str, int] = ("hyper", NUM_HYPER)) -> None:
    """Raises RuntimeError unless the arguments of an update op are as its contract says
    (csrc/common/update_math.h, the schemas in csrc/gradfuse.cpp): one (device, dtype) group of
    dense contiguous float tensors, state lists of the same length whose entries are empty (absent)
    or match their parameter, a float64 ``[n, NUM_HYPER]`` table (``table``: its name and columns
    where another op's) and float64 ``[n]`` coefficients on the parameters' device."""
    n = len(params)
    for name, ts in (("grads", grads), ("moment1", moment1), ("moment2", moment2), ("moment2_max", moment2_max)):
        if len(ts) != n:
            raise RuntimeError(f"{op}: {name} has {len(ts)} tensors but params has {n}")
    device = params[0].device if n else hyper.device
    for i, p in enumerate(params):
        if p.layout != torch.strided or p.dtype not in KERNEL_DTYPES or not p.is_contiguous():
            raise RuntimeError(f"{op}: params[{i}] must be a dense contiguous float16, bfloat16, float32 or "
                               f"float64 tensor, got {describe(p)}")
        if p.dtype != params[0].dtype or p.device != device:
            raise RuntimeError(f"{op}: params[{i}] is {_dtype_name(p.dtype)} on {p.device} but params[0] is "
                               f"{_dtype_name(params[0].dtype)} on {device}")
        for name, ts, may_be_empty in (("grads", grads, False), ("moment1", moment1, True),
                                       ("moment2", moment2, True), ("moment2_max", moment2_max, True)):
            t = ts[i]
            if may_be_empty and t.numel() == 0 and t.layout == torch.strided:
                continue
            if (t.layout != torch.strided or t.shape != p.shape or t.dtype != p.dtype or t.device != p.device
                    or not t.is_contiguous()):
                raise RuntimeError(f"{op}: {name}[{i}] must be contiguous with params[{i}]'s shape {_shape(p)} "
                                   f"and dtype {_dtype_name(p.dtype)} on {p.device}"
                                   f"{' (or empty: absent)' if may_be_empty else ''}, got {describe(t)}")
    name, columns = table
    if (hyper.dtype != torch.float64 or tuple(hyper.shape) != (n, columns) or hyper.device != device
            or not hyper.is_contiguous()):
        raise RuntimeError(f"{op}: {name} must be a contiguous float64 [{n}, {columns}] tensor on {device}, "
                           f"got {describe(hyper)}")
    if coefs is not None and (coefs.dtype != torch.float64 or tuple(coefs.shape) != (n,) or coefs.device != device):
        raise RuntimeError(f"{op}: coefs must be a float64 [{n}] tensor on {device}, got {describe(coefs)}")


def check_rule(op: str, rule: int) -> int:
    """``rule`` as an int, or the compiled ops' RuntimeError for an unknown one."""
    rule = int(rule)
    if rule not in (RULE_SGD, RULE_ADAM):
        raise RuntimeError(f"{op}: rule must be {RULE_SGD} (SGD) or {RULE_ADAM} (Adam, AdamW), got {rule}")
    return rule


class _UpdateParams:
    """One tensor's constants from its row of the hyper table (``UpdateParams::from_row``), as
    float64 0-dim tensors and boolean 0-dim tensors on the table's device."""

    def __init__(self, row: torch.Tensor, rule: int):
        self.adam = rule == RULE_ADAM
        flags = row[HYPER_FLAGS].to(torch.int64)
        self.maximize = (flags & FLAG_MAXIMIZE) != 0
        self.nesterov = (flags & FLAG_NESTEROV) != 0
        self.amsgrad = (flags & FLAG_AMSGRAD) != 0
        self.decoupled = (flags & FLAG_DECOUPLED) != 0
        self.lr, self.weight_decay = row[HYPER_LR], row[HYPER_WEIGHT_DECAY]
        self.beta1, self.beta2, self.eps, t = row[HYPER_BETA1], row[HYPER_BETA2], row[HYPER_EPS], row[HYPER_STEP]
        self.one_minus_beta1 = 1.0 - self.beta1
        self.one_minus_beta2 = 1.0 - self.beta2
        self.one_minus_dampening = 1.0 - self.beta2
        self.step_size = self.lr / (1.0 - self.beta1 ** t)
        self.bias_correction2_sqrt = torch.sqrt(1.0 - self.beta2 ** t)
        self.decay_factor = 1.0 - self.lr * self.weight_decay
        # Where the decay sits outside the state: AdamW's decoupled decay, and SGD's when the
        # update is not the momentum buffer itself (no momentum, or nesterov).
        outside = self.decoupled if self.adam else (self.beta1 == 0) | self.nesterov
        self.decay = torch.where(outside, -self.lr * self.weight_decay, torch.zeros_like(self.lr))


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # torch.lerp's formula (aten/src/ATen/native/Lerp.h): exact at both ends
    return torch.where(weight < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight))


def _nan_max(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # torch.maximum: a NaN on either side propagates
    return torch.where((a > b) | a.isnan(), a, b)


def _update_element(h: _UpdateParams, w, g, m, v, v_max, has_buffer: bool):
    """``update_element``: (update, moment1, root, moment2) of every element, before the step."""
    g = torch.where(h.maximize, -g, g)
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    if h.adam:
        g = torch.where((h.weight_decay != 0) & ~h.decoupled, g + h.weight_decay * w, g)
        moment1 = _lerp(m, g, h.one_minus_beta1)
        v_new = v * h.beta2 + h.one_minus_beta2 * g * g
        # an absent moment2_max reads as zeros, as torch's max_exp_avg_sq starts
        v_new = torch.where(h.amsgrad, _nan_max(v_max, v_new), v_new)
        root = torch.sqrt(v_new) / h.bias_correction2_sqrt
        adam = -h.step_size * (moment1 / (root + h.eps))
        update = torch.where(h.decoupled, (w * h.decay_factor - w) + adam, adam)
        return update, moment1, root, v_new
    d = torch.where(h.weight_decay != 0, g + h.weight_decay * w, g)
    buf = m * h.beta1 + h.one_minus_dampening * d if has_buffer else d
    momentum = h.beta1 != 0
    moment1 = torch.where(momentum, buf, zero)
    d = torch.where(momentum, torch.where(h.nesterov, d + h.beta1 * buf, buf), d)
    return -h.lr * d, moment1, zero.expand_as(w), zero.expand_as(w)


def _applied_update_part(h: _UpdateParams, g, m_after, v_after):
    """``applied_update_part``: the part of the update just applied that does not depend on the weight."""
    if h.adam:
        root = torch.sqrt(v_after) / h.bias_correction2_sqrt
        return -h.step_size * (m_after / (root + h.eps))
    momentum = h.beta1 != 0
    g = torch.where(h.maximize, -g, g)
    other = -h.lr * torch.where(momentum, g + h.beta1 * m_after, g)
    return torch.where(momentum & ~h.nesterov, -h.lr * m_after, other)  # the buffer holds the decay


def _clipped_weight(h: _UpdateParams, w_after, a, c):
    """``clipped_weight``: w_before + c * u, from w_after = w_before * (1 + k) + a."""
    w_before = (w_after - a) / (1.0 + h.decay)
    return w_before + c * (a + h.decay * w_before)


def _state(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # an absent state (empty tensor) reads as zeros, as Adam's moments start
    return t.detach().reshape(-1).to(torch.float64) if t.numel() else torch.zeros_like(like)


def multi_tensor_update_stats(params, grads, moment1, moment2, moment2_max, hyper: torch.Tensor, rule: int):
    """The rows of ``gradfuse::multi_tensor_update_stats``: per parameter, the statistics of the
    update that the optimizer's step (``rule``: 0 SGD, 1 Adam / AdamW) is about to apply, from the
    weight, the gradient and the state before the step (an empty state tensor: absent).

    Returns:
        ``(floats, counts)``: float64 ``[n, NUM_UPDATE_FLOAT_STATS]`` and int64
        ``[n, NUM_UPDATE_COUNT_STATS]``, columns as ``UPDATE_FLOAT_COLUMNS`` / ``UPDATE_COUNT_COLUMNS``.
    """
    op = "multi_tensor_update_stats"
    rule = check_rule(op, rule)
    check_update_inputs(op, params, grads, moment1, moment2, moment2_max, hyper)
    device = params[0].device if params else hyper.device
    if not params:
        return (torch.empty((0, NUM_UPDATE_FLOAT_STATS), dtype=torch.float64, device=device),
                torch.empty((0, NUM_UPDATE_COUNT_STATS), dtype=torch.int64, device=device))
    rows_f, rows_c = [], []
    for i, p in enumerate(params):
        h = _UpdateParams(hyper[i], rule)
        w = p.detach().reshape(-1).to(torch.float64)
        g = grads[i].detach().reshape(-1).to(torch.float64)
        u, m1, root, m2 = _update_element(h, w, g, _state(moment1[i], w), _state(moment2[i], w),
                                          _state(moment2_max[i], w), moment1[i].numel() > 0)
        eps_dominated = (root < h.eps).sum() if h.adam else torch.zeros((), dtype=torch.int64, device=device)
        rows_f.append(stack_columns({"update_sumsq": (u * u).sum(), "weight_sumsq": (w * w).sum(),
                                      "moment1_sumsq": (m1 * m1).sum(), "moment2_sumsq": (root * root).sum()},
                                     UPDATE_FLOAT_NAMES, 0))
        rows_c.append(stack_columns({"update_nonfinite": (~u.isfinite()).sum(),
                                      "weight_nonfinite": (~w.isfinite()).sum(),
                                      "moment_nonfinite": (~(m1.isfinite() & m2.isfinite())).sum(),
                                      "eps_dominated": eps_dominated,
                                      "numel": torch.tensor(w.numel(), device=device)}, UPDATE_COUNT_NAMES, 0))
    return torch.stack(rows_f), torch.stack(rows_c).to(torch.int64)


def multi_tensor_update_clip_(params, grads, moment1, moment2, moment2_max, hyper: torch.Tensor,
                              coefs: torch.Tensor, rule: int) -> None:
    """``gradfuse::multi_tensor_update_clip_``: after ``optimizer.step()``, rescales the update
    just applied to ``params[i]`` by ``coefs[i]`` where it is below 1 (a coefficient >= 1 or NaN
    leaves the tensor as the step left it): ``w = w_before + c * u``, with ``w_before`` formed
    again from the weight, the gradient and the state the step left (``moment2_max`` with amsgrad,
    else ``moment2``; with amsgrad and ``moment2_max`` absent, the max of a first amsgrad step,
    ``max(0, moment2)``), without a copy of the weights."""
    op = "multi_tensor_update_clip_"
    rule = check_rule(op, rule)
    check_update_inputs(op, params, grads, moment1, moment2, moment2_max, hyper, coefs)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        h = _UpdateParams(hyper[i], rule)
        w = p.detach().reshape(-1).to(torch.float64)
        g = grads[i].detach().reshape(-1).to(torch.float64)
        v_after = _state(moment2[i], w)
        if h.adam:
            # amsgrad: the running max the step left; absent, that of a first amsgrad step,
            # torch.maximum(zeros, exp_avg_sq)
            v_max = _state(moment2_max[i], w) if moment2_max[i].numel() else _nan_max(torch.zeros_like(w), v_after)
            v_after = torch.where(h.amsgrad, v_max, v_after)
        c = coefs[i]
        a = _applied_update_part(h, g, _state(moment1[i], w), v_after)
        clipped = torch.where(c < 1, _clipped_weight(h, w, a, c), w)
        p.detach().copy_(clipped.reshape(p.shape))
