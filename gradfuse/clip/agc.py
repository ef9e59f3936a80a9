"""Adaptive gradient clipping (AGC, Brock et al. 2021) with timm's semantics: unit-wise norms of
weights and gradients from fused passes, one unit-wise scale pass, coefficients on the device.

Layer: clip (a capability). Imports ``gradfuse.ops`` and ``gradfuse.core``.
"""
from __future__ import annotations

import math

import torch

from gradfuse import ops
from gradfuse.core import distributed, grouping
from gradfuse.core.norms import root, row_accumulators
from gradfuse.core.params import check_norm_type, check_tensors


def check_agc_args(clip_factor, eps, norm_type) -> tuple[float, float, float]:
    """Validates the adaptive clipping arguments; returns ``(clip_factor, eps, norm_type)`` as floats.

    Raises:
        ValueError: ``clip_factor`` is not a positive finite number, ``eps`` is not a non-negative
            finite number, or ``norm_type`` is negative or NaN.
    """
    cf, e = float(clip_factor), float(eps)
    if not cf > 0 or math.isinf(cf):
        raise ValueError(f"gradfuse.adaptive_clip_grad_: clip_factor must be a positive number, "
                         f"got {clip_factor!r}")
    if not e >= 0 or math.isinf(e):
        raise ValueError(f"gradfuse.adaptive_clip_grad_: eps must be a non-negative number, got {eps!r}")
    p = check_norm_type(norm_type)
    if p < 0:
        raise ValueError(f"gradfuse.adaptive_clip_grad_: norm_type must be >= 0 or inf, got {norm_type!r}")
    return cf, e, p


def _unit_count(t: torch.Tensor) -> int:
    # timm's unitwise_norm: the output dimension of a weight (dim 0) for ndim > 1, else whole
    return t.shape[0] if t.ndim > 1 else 1


@torch.no_grad()
def adaptive_clip_grad_(parameters, clip_factor: float = 0.01, eps: float = 1e-3,
                        norm_type: float = 2.0) -> None:
    """Adaptive gradient clipping (Brock et al. 2021), as ``timm.utils.adaptive_clip_grad``.

    Each unit of a gradient (a row along dim 0 of a weight of 2 or more dims; a whole bias or
    norm vector) whose norm is at least ``clip_factor * max(||unit of the weight||, eps)`` is
    scaled to that norm. Same results as timm, with the unit norms of the weights and of the
    gradients from two fused passes and one unit-wise scale pass, coefficients on the device.
    An empty gradient is left alone.

    Args:
        parameters: A tensor or an iterable of parameters; those without ``.grad`` are left out.
        clip_factor: The largest ratio of a unit's gradient norm to its weight norm; positive.
        eps: The smallest weight norm a unit is measured against; non-negative.
        norm_type: The order of the unit norms: >= 0 or ``inf``.

    Returns:
        None; the gradients are scaled in place.

    Raises:
        ValueError: ``clip_factor``, ``eps`` or ``norm_type`` out of range.
        TypeError: DTensor parameters (a unit of a sharded weight spans ranks).

    Example:
        ```python
        loss.backward()
        gradfuse.adaptive_clip_grad_(model.parameters(), clip_factor=0.01)
        ```
    """
    clip_factor, eps, p = check_agc_args(clip_factor, eps, norm_type)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [q for q in parameters if q.grad is not None]
    if not params:
        return
    weights = [q.detach() for q in params]
    grads = [q.grad.detach() for q in params]
    if distributed.may_have_dtensors(weights) or distributed.may_have_dtensors(grads):
        raise TypeError("gradfuse.adaptive_clip_grad_: DTensor parameters are not supported: "
                        "the unit-wise norms of a sharded weight span ranks (gather the full "
                        "parameters first, or clip per rank on plain local tensors)")
    names = [f"[{i}]" for i in range(len(params))]
    check_tensors(names, weights, "parameter")
    check_tensors(names, grads, "gradient")
    keep = [i for i, g in enumerate(grads) if g.numel() > 0]
    for (device, dtype), idx in grouping.groups([grads[i] for i in keep]).items():
        idx = [keep[i] for i in idx]
        g_group = [grads[i] for i in idx]
        w_group = [weights[i] for i in idx]
        units = [_unit_count(g) for g in g_group]
        gn = _unit_norms(g_group, units, p)
        wn = _weight_unit_norms(w_group, units, p, device)
        # timm's arithmetic, in the parameters' dtype: the max norm and coefficient round as there
        wdt = w_group[0].dtype if all(w.dtype == w_group[0].dtype for w in w_group) else dtype
        max_norm = wn.to(device, wdt).clamp(min=eps).mul(clip_factor).to(dtype)
        gn = gn.to(device, dtype)
        coef = torch.where(gn < max_norm, torch.ones_like(gn), max_norm / gn.clamp(min=1e-6))
        coef = coef.to(torch.float64 if dtype == torch.float64 else torch.float32)
        ops.multi_tensor_unit_scale_(g_group, units, coef, True)


def _weight_unit_norms(weights, units, p: float, device) -> torch.Tensor:
    """Unit-wise norms of the weights, one fused pass per (device, dtype) of the weights."""
    groups = grouping.groups(weights)
    if len(groups) == 1:
        return _unit_norms(weights, units, p).to(device)
    offsets = [0]
    for u in units:
        offsets.append(offsets[-1] + u)
    out = torch.empty(offsets[-1], dtype=ops.stats_dtype(device), device=device)
    for (_dev, _dt), idx in groups.items():
        n = _unit_norms([weights[i] for i in idx], [units[i] for i in idx], p)
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in idx]).to(device)
        out[rows] = n.to(device)
    return out



def _unit_norms(tensors, units, p: float) -> torch.Tensor:
    """Norms of order ``p`` of every unit of one (device, dtype) group, float64."""
    floats, counts = ops.multi_tensor_unit_stats(tensors, units, p)
    return root(row_accumulators(floats, counts, p), p)

