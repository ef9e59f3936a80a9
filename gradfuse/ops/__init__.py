"""The compiled multi-tensor ops, each routed to gradfuse._C or to its pure-PyTorch reference
per device; every op takes ONE (device, dtype) group of dense float tensors and none waits for
the host.

Layer: ops, the bottom of the package. Its modules import torch and each other, nothing else of
gradfuse: ``gradfuse.ops.library`` (loading the extension, build checks, the backend per
device), ``gradfuse.ops.fake`` (fake kernels for torch.compile and opcheck),
``gradfuse.ops.reference`` (the fallback and test oracle), ``gradfuse.ops.layout`` (the
columns and bins of the results).
"""
from __future__ import annotations

import torch

from gradfuse.ops import fake, reference, step_reference, update_reference  # noqa: F401  (fake: registers the fake kernels)
from gradfuse.ops.layout import (  # noqa: F401
    BIN_ABOVE,
    BIN_BELOW,
    BIN_NAN,
    BIN_NEG_INF,
    BIN_POS_INF,
    BIN_ZERO,
    EXPONENT_OFFSET,
    INF,
    M2,
    MAX_EXPONENT,
    MAXABS,
    MIN_EXPONENT,
    NAN,
    NUM_BINS,
    NUMEL,
    POWSUM,
    SUM,
    SUMSQ,
    ZERO,
)
from gradfuse.ops.library import backend, build_info, has_kernel, op_compiled, stats_dtype, use_compiled  # noqa: F401


def multi_tensor_stats(tensors: list[torch.Tensor], norm_type: float = 2.0):
    """Per-tensor statistics of one (device, dtype) group in one pass.

    Returns ``(floats, counts)``: float64 ``[n, len(FLOAT_COLUMNS)]`` (sum, sum of squares, max
    |x|, sum |x|^p when p is not 0, 2 or inf) and int64 ``[n, len(COUNT_COLUMNS)]`` (NaN, Inf and
    zero counts, numel), on the tensors' device; the columns are those of
    ``gradfuse.ops.layout``.
    """
    if not tensors or not use_compiled(tensors[0].device):
        return reference.multi_tensor_stats(tensors, norm_type)
    return torch.ops.gradfuse.multi_tensor_stats(tensors, float(norm_type))


def multi_tensor_moments(tensors: list[torch.Tensor]):
    """``multi_tensor_stats(tensors, 2)`` with a stable second moment, in the same one pass.

    Returns ``(floats, counts)`` as ``multi_tensor_stats``, except that column ``M2`` (the power
    sum's) holds the sum of squared deviations from each tensor's mean, ``sum (x - mean)^2``:
    the variance is ``M2 / (numel - 1)``. The kernels accumulate ``x - K`` and ``(x - K)^2``
    about a shift ``K`` taken from the data (the median of five of the tensor's elements), so the
    result keeps its precision when ``|mean|`` is many times the spread, where
    ``sum x^2 - (sum x)^2 / n`` keeps none. NaN where the tensor holds a NaN or an Inf.
    """
    if not tensors or not op_compiled("multi_tensor_moments", tensors[0].device):
        return reference.multi_tensor_moments(tensors)
    return torch.ops.gradfuse.multi_tensor_moments(tensors)


def multi_tensor_scale_(tensors: list[torch.Tensor], coef: torch.Tensor,
                        conditional: bool = True) -> None:
    """Multiplies every tensor of one (device, dtype) group in place by ``coef`` (a one-element
    tensor on their device). ``conditional``: only when ``coef < 1`` or NaN, reading and writing
    nothing otherwise; else always."""
    if not tensors or not use_compiled(tensors[0].device):
        return reference.multi_tensor_scale_(tensors, coef, conditional)
    torch.ops.gradfuse.multi_tensor_scale_(tensors, coef, conditional)


# ---- Clipping beyond one global norm: per unit, per tensor, by value.

def multi_tensor_unit_stats(tensors: list[torch.Tensor], units: list[int], norm_type: float = 2.0):
    """Statistics per *unit*: tensor i, in its logical (row-major) order, cut into ``units[i]``
    equal consecutive blocks (``units[i] = w.size(0)``: one row per output unit, the norm over
    dims 1.. as timm's AGC takes it; ``1``: the whole tensor; ``0`` only for an empty tensor).

    Returns ``(floats, counts)``: float64 and int64, ``sum(units)`` rows, the rows of every unit
    of every tensor in order, columns as ``multi_tensor_stats``. A tensor that is not
    contiguous (with units > 1) is copied to a contiguous one first.
    """
    if not tensors or not op_compiled("multi_tensor_unit_stats", tensors[0].device):
        return reference.multi_tensor_unit_stats(tensors, units, norm_type)
    return torch.ops.gradfuse.multi_tensor_unit_stats(tensors, [int(u) for u in units], float(norm_type))


def multi_tensor_unit_scale_(tensors: list[torch.Tensor], units: list[int], coefs: torch.Tensor,
                             conditional: bool = True) -> None:
    """Multiplies unit j of tensor i (units as ``multi_tensor_unit_stats``) in place by its
    coefficient: ``coefs`` is 1-D with ``sum(units)`` entries on the tensors' device (any float
    dtype; the kernels compute in float32, float64 for float64 data). ``conditional``: a unit
    whose coefficient is >= 1 is not touched at all (decided on the device); NaN scales."""
    if not tensors or not op_compiled("multi_tensor_unit_scale_", tensors[0].device):
        return reference.multi_tensor_unit_scale_(tensors, units, coefs, conditional)
    torch.ops.gradfuse.multi_tensor_unit_scale_(tensors, [int(u) for u in units], coefs, conditional)


def multi_tensor_scale_per_tensor_(tensors: list[torch.Tensor], coefs: torch.Tensor,
                                   conditional: bool = True) -> None:
    """Multiplies tensor i in place by ``coefs[i]`` (1-D, ``len(tensors)`` entries, on their
    device). ``conditional``: a tensor whose coefficient is >= 1 is not read nor written (decided
    on the device); a NaN coefficient scales, as the scalar op does."""
    if tensors and op_compiled("multi_tensor_unit_scale_", tensors[0].device):
        # units of 1 are ints already: no per-tensor int() (10 000 parameters: ~0.5 ms)
        torch.ops.gradfuse.multi_tensor_unit_scale_(tensors, [1] * len(tensors), coefs, conditional)
        return
    multi_tensor_unit_scale_(tensors, [1] * len(tensors), coefs, conditional)


def multi_tensor_clamp_(tensors: list[torch.Tensor], clip_value: float):
    """Clamps every element to ``[-clip_value, clip_value]`` in place in one pass, exactly as
    ``torch.nn.utils.clip_grad_value_`` (NaN stays NaN, -0.0 stays), and returns
    ``(floats, counts, clamped)``: the ``multi_tensor_stats`` rows (norm_type 2) of the values
    *before* clamping, and int64 ``[n]`` with the number of elements clamping changed per tensor
    (|x| > clip_value as rounded to the dtype; NaN not counted). ``clip_value`` must be >= 0."""
    reference.check_clip_value(clip_value, "gradfuse.multi_tensor_clamp_")
    if not tensors or not op_compiled("multi_tensor_clamp_", tensors[0].device):
        return reference.multi_tensor_clamp_(tensors, clip_value)
    return torch.ops.gradfuse.multi_tensor_clamp_(tensors, float(clip_value))


def multi_tensor_exponent_histogram(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64 ``[len(tensors), NUM_BINS]`` on the tensors' device: per tensor, how many elements
    have each binary exponent (bins as ``gradfuse.ops.layout``), for one (device, dtype)
    group of dense float16 / bfloat16 / float32 / float64 tensors; no host synchronisation."""
    if not tensors or not op_compiled("multi_tensor_exponent_histogram", tensors[0].device):
        return reference.multi_tensor_exponent_histogram(tensors)
    return torch.ops.gradfuse.multi_tensor_exponent_histogram(tensors)


# ---- The optimizer's update: the update that torch.optim.SGD / Adam / AdamW is about to apply,
# per parameter, and its rescaling after the step (csrc/common/update_math.h).

def multi_tensor_update_stats(params: list[torch.Tensor], grads: list[torch.Tensor], moment1: list[torch.Tensor],
                              moment2: list[torch.Tensor], moment2_max: list[torch.Tensor], hyper: torch.Tensor,
                              rule: int):
    """Per parameter of one (device, dtype) group, the statistics of the update the optimizer's
    step is about to apply, in one pass over the weights, the gradients and the state before the
    step, with no temporaries and no host synchronisation.

    ``moment1`` / ``moment2`` / ``moment2_max``: one entry per parameter, the optimizer's state
    (Adam's ``exp_avg`` / ``exp_avg_sq`` / ``max_exp_avg_sq``, SGD's ``momentum_buffer`` in
    ``moment1``) or an empty tensor where it is absent (an absent ``moment2_max`` reads as zeros, as
    torch's ``max_exp_avg_sq`` starts). ``hyper``: float64 ``[n, NUM_HYPER]`` on
    the parameters' device (columns ``HYPER_COLUMNS``); ``rule``: ``RULE_SGD`` or ``RULE_ADAM``.

    Returns ``(floats, counts)``: float64 ``[n, NUM_UPDATE_FLOAT_STATS]`` and int64
    ``[n, NUM_UPDATE_COUNT_STATS]`` (columns ``UPDATE_FLOAT_COLUMNS`` / ``UPDATE_COUNT_COLUMNS``).
    """
    if not params or not op_compiled("multi_tensor_update_stats", params[0].device):
        return update_reference.multi_tensor_update_stats(params, grads, moment1, moment2, moment2_max, hyper, rule)
    return torch.ops.gradfuse.multi_tensor_update_stats(params, grads, moment1, moment2, moment2_max, hyper, rule)


def multi_tensor_update_clip_(params: list[torch.Tensor], grads: list[torch.Tensor], moment1: list[torch.Tensor],
                              moment2: list[torch.Tensor], moment2_max: list[torch.Tensor], hyper: torch.Tensor,
                              coefs: torch.Tensor, rule: int) -> None:
    """After ``optimizer.step()``: rescales the update just applied to ``params[i]`` by
    ``coefs[i]`` (float64 ``[n]`` on the device) where it is below 1, ``w = w_before + c * u``,
    from the state the step left and without a copy of the weights; a coefficient >= 1 or NaN
    leaves the tensor untouched (decided on the device). Arguments as ``multi_tensor_update_stats``;
    with amsgrad and ``moment2_max`` absent, the step's max is that of a first amsgrad step,
    ``max(0, moment2)``."""
    if not params or not op_compiled("multi_tensor_update_clip_", params[0].device):
        return update_reference.multi_tensor_update_clip_(params, grads, moment1, moment2, moment2_max, hyper, coefs,
                                                          rule)
    torch.ops.gradfuse.multi_tensor_update_clip_(params, grads, moment1, moment2, moment2_max, hyper, coefs, rule)


# ---- The optimizer's step itself (csrc/common/step_math.h).

def multi_tensor_optim_step_(params: list[torch.Tensor], grads: list[torch.Tensor], moment1: list[torch.Tensor],
                             moment2: list[torch.Tensor], moment2_max: list[torch.Tensor], coefs: torch.Tensor,
                             rule: int, torch_threads: int = 0, grad_scale: torch.Tensor | None = None,
                             skip: torch.Tensor | None = None, update_coefs: torch.Tensor | None = None,
                             stats: bool = False, write: bool = True):
    """torch.optim.SGD's (``RULE_SGD``) or Adam / AdamW's (``RULE_ADAM``) step of every parameter of
    one (device, dtype) group, in place and bit for bit as torch's own step, in one pass that reads
    weight, gradient and state once and writes them once, with no host synchronisation.

    ``moment1`` / ``moment2`` / ``moment2_max``: the state, as ``multi_tensor_update_stats`` takes
    it (Adam's two moments must be present; SGD's buffer is written on its first step).
    ``coefs``: float64 ``[n, NUM_STEP_COEFS]`` on the device (columns ``STEP_COLUMNS``), the
    scalars torch's step forms in Python. ``torch_threads``: torch's thread count for the step
    being reproduced (a 16-bit ``add`` with alpha rounds differently in torch's scalar tails;
    0: none, the only value on CUDA, whose kernels have no such tails). Optional, each on the
    device: ``grad_scale`` (one element, or float64 ``[n]``: one per parameter) multiplies every
    gradient as it is read (rounded to its dtype, as a scaling pass would; ``p.grad`` itself is
    not changed), ``skip``
    (nonzero: nothing is written), ``update_coefs`` (float64 ``[n]``: the update of parameter i
    times ``update_coefs[i]`` where that is below 1). ``stats``: also returns the rows of
    ``multi_tensor_update_stats`` for this step (else ``[0, k]`` tensors); ``write=False``: the
    rows only, nothing written.
    """
    if not params or not op_compiled("multi_tensor_optim_step_", params[0].device):
        return step_reference.multi_tensor_optim_step_(params, grads, moment1, moment2, moment2_max, coefs, rule,
                                                       torch_threads, grad_scale, skip, update_coefs, stats, write)
    return torch.ops.gradfuse.multi_tensor_optim_step_(params, grads, moment1, moment2, moment2_max, coefs, rule,
                                                       torch_threads, grad_scale, skip, update_coefs, stats, write)
