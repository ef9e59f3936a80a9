"""AMP: GradScaler's unscale, the statistics and clipping in one read and one write.

The usual order reads and writes the gradients twice (``scaler.unscale_`` then clipping) and
reads them once more for statistics. ``unscale_clip_`` takes the statistics of the scaled
gradients in one pass, derives the unscaled ones from them (norms and sums scale linearly,
counts do not change), and multiplies each gradient once by ``inv_scale * clip_coef``. It
then records in the scaler what ``scaler.unscale_`` would have (found_inf per device, stage
UNSCALED), so ``scaler.step(optimizer)`` and ``scaler.update()`` work as usual: a step whose
gradients hold Inf/NaN is skipped by the scaler and lowers its scale.

Layer: core. Imports ``gradfuse.ops`` and the core modules below it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from gradfuse import ops
from gradfuse.core import grouping
from gradfuse.core.engine import fused_stats, scale_to_max_norm
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.norms import clip_coefficient, norm_accumulator, root
from gradfuse.core.params import check_max_norm, check_norm_type
from gradfuse.ops.layout import FLOAT_COLUMNS


def _optimizer_state(scaler, optimizer) -> dict:
    from torch.amp.grad_scaler import OptState
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED:
        raise RuntimeError("gradfuse.unscale_clip_: unscale_() has already been called on this "
                           "optimizer since the last update(); call one or the other, not both.")
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("gradfuse.unscale_clip_: called after scaler.step(); call it before.")
    return state


def scaler_unscaled(scaler, optimizer) -> bool:
    """Whether ``scaler`` has unscaled ``optimizer``'s gradients since its last ``update()``
    (``scaler.unscale_``, or its ``step``): the optimizer's stage is past READY. An optimizer the
    scaler has not seen is not (read with ``.get``: the scaler's defaultdict would make its
    state, and a scaler wrapped by a Mock, as in Lightning's tests, has no ``__getitem__``)."""
    from torch.amp.grad_scaler import OptState
    state = scaler._per_optimizer_states.get(id(optimizer))
    return state is not None and state["stage"] is not OptState.READY


def optimizer_named_grads(optimizer, names_by_param: nn.Module | dict | None = None):
    """(names, gradients) of the optimizer's parameters that have one. Names: from
    ``names_by_param`` (a module, whose ``named_parameters()`` name them, or a dict
    id(param) -> name); else the names the optimizer was built with
    (``torch.optim.X(model.named_parameters())``); else ``group{g}.{i}``."""
    if isinstance(names_by_param, nn.Module):
        names_by_param = {id(p): n for n, p in names_by_param.named_parameters()}
    names, grads = [], []
    for g, group in enumerate(optimizer.param_groups):
        own_names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            name = (names_by_param or {}).get(id(p))
            names.append(name or (own_names[i] if own_names else f"group{g}.{i}"))
            grads.append(p.grad)
    return names, grads


def unscaled_stats(names, grads, scaler, norm_type: float) -> tuple[GradStats, torch.Tensor]:
    """Statistics of ``grads / scale`` from one pass over the scaled ``grads``; and inv_scale."""
    if scaler._scale is None:
        raise RuntimeError("gradfuse: the GradScaler has no scale yet; call "
                           "scaler.scale(loss).backward() before unscaling")
    s = fused_stats(names, grads, norm_type)
    dev = s.floats.device
    # in the rows' dtype (float64 where the device has it); torch unscales in float32
    inv = scaler._scale.to(dev, s.floats.dtype).reciprocal()
    one = torch.ones((), dtype=s.floats.dtype, device=dev)
    p = norm_type
    pow_factor = inv.pow(p) if p not in (0.0, 2.0) and not math.isinf(p) else one
    factor = {1: inv, 2: inv * inv, "p": pow_factor}  # by each column's degree in the data
    floats = s.floats * torch.stack([factor[c.degree] if c.degree in factor else inv.pow(c.degree)
                                     for c in FLOAT_COLUMNS])
    # From the float64 rows, not from s.total_norm: that is in the gradients' dtype, where a
    # scaled fp16 norm can overflow.
    total = root(norm_accumulator(floats, s.counts, p), p).to(s.total_norm.dtype)
    return s.replace(floats=floats, total_norm=total), inv


def unscale_coefficient(inv_scale: torch.Tensor, clip_coef: torch.Tensor | None) -> torch.Tensor:
    """The one factor that unscales the gradients (and clips them, with ``clip_coef``): float32,
    as torch unscales."""
    coef = inv_scale.float()
    return coef if clip_coef is None else coef * clip_coef.float()


def finish_unscale_(scaler, optimizer, grads, s: GradStats, inv_scale: torch.Tensor,
                    max_norm: float | None, apply: bool = True) -> GradStats:
    """Multiplies ``grads`` once by inv_scale (times the clip coefficient when ``max_norm`` is
    set) and records the unscale in the scaler. Returns ``s`` with ``clip_coef`` when clipping.
    ``apply=False``: records it and multiplies nothing (the optimizer's step applies
    ``unscale_coefficient`` as it reads the gradients)."""
    from torch.amp.grad_scaler import OptState
    state = _optimizer_state(scaler, optimizer)
    clip_coef = None
    if max_norm is not None:
        clip_coef = clip_coefficient(s.total_norm, max_norm)
        s = s.replace(clip_coef=clip_coef, max_norm=max_norm)
    coef = unscale_coefficient(inv_scale, clip_coef)
    found_inf = s.nonfinite.to(torch.float32)
    per_device = {}
    for (device, _dtype), idx in grouping.groups(grads).items():
        if apply:
            ops.multi_tensor_scale_([grads[i] for i in idx], coef.to(device), conditional=False)
        per_device.setdefault(device, found_inf.to(device))
    state["found_inf_per_device"] = per_device
    state["stage"] = OptState.UNSCALED
    return s


@torch.no_grad()
def unscale_clip_(optimizer: torch.optim.Optimizer, scaler, max_norm: float | None = None,
                  norm_type: float = 2.0, names_by_param: nn.Module | dict | None = None) -> GradStats:
    """``scaler.unscale_(optimizer)``, statistics and (with ``max_norm``) clipping, fused.

    One read and one write of the gradients instead of three reads and two writes. Then call
    ``scaler.step(optimizer)`` and ``scaler.update()`` as usual: a step whose gradients hold
    Inf/NaN is skipped by the scaler. With a disabled scaler, only the statistics (and clip).

    Args:
        optimizer: The optimizer whose parameters' gradients are unscaled.
        scaler: The ``torch.amp.GradScaler`` that scaled the loss.
        max_norm: Clip by this total norm (None: statistics only).
        norm_type: The order of the norm.
        names_by_param: Names for the rows: the model, or a dict ``id(param) -> name``. Without
            it, the names the optimizer was built with (``AdamW(model.named_parameters())``),
            else ``group{g}.{i}``.

    Returns:
        GradStats: The statistics of the unscaled gradients, from before clipping.

    Raises:
        RuntimeError: ``unscale_()`` was already called on this optimizer since the last
            ``update()``, or this is called after ``scaler.step()``, or the scaler has no scale
            yet.
        ValueError: ``max_norm`` is negative or NaN, or ``norm_type`` is NaN.

    Example:
        ```python
        scaler.scale(loss).backward()
        s = gradfuse.unscale_clip_(optimizer, scaler, max_norm=1.0, names_by_param=model)
        scaler.step(optimizer)
        scaler.update()
        ```
    """
    p = check_norm_type(norm_type)
    max_norm = None if max_norm is None else check_max_norm(max_norm)
    names, grads = optimizer_named_grads(optimizer, names_by_param)
    if not scaler.is_enabled():
        s = fused_stats(names, grads, p)
        return s if max_norm is None else scale_to_max_norm(s, grads, max_norm)
    _optimizer_state(scaler, optimizer)  # fail before touching anything
    s, inv = unscaled_stats(names, grads, scaler, p)
    return finish_unscale_(scaler, optimizer, grads, s, inv, max_norm)
