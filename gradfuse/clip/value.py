"""Clipping by value: the drop-in for ``torch.nn.utils.clip_grad_value_``, and the clamp that
also returns the statistics from before clamping and the clamped counts.

Layer: clip (a capability). Imports ``gradfuse.ops`` and ``gradfuse.core``.
"""
from __future__ import annotations

import math

import torch
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

from gradfuse import ops
from gradfuse.core import distributed, grouping
from gradfuse.core.engine import fused_stats
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.norms import norm_accumulator, root
from gradfuse.core.params import SUPPORTED_DTYPES, check_tensors


def check_clip_value(clip_value) -> float:
    """``clip_value`` as a float.

    Raises:
        ValueError: ``clip_value`` is not a number, or is NaN or negative.
    """
    try:
        v = float(clip_value)
    except (TypeError, ValueError):
        raise ValueError(f"gradfuse: clip_value must be a number, got {clip_value!r}") from None
    if math.isnan(v) or v < 0:
        raise ValueError(f"gradfuse: clip_value must be a non-negative number, got {clip_value!r}")
    return v


def clamp_stats_(names: list[str], grads: list[torch.Tensor], clip_value: float) -> GradStats:
    """Clamps ``grads`` in place to [-clip_value, clip_value] in one fused pass per (device,
    dtype) group; returns the statistics from before clamping (L2 norms) with ``clamped``, the
    number of elements changed per row."""
    if distributed.may_have_dtensors(grads):
        raise TypeError("gradfuse: clipping by value with statistics takes plain tensors, not "
                        "DTensor gradients; use gradfuse.clip_grad_value_ (clamps the local shards)")
    check_tensors(names, grads, "gradient")
    if not grads:
        s = fused_stats(names, grads, 2.0)
        s.clamped, s.clip_value = torch.empty(0, dtype=torch.int64), clip_value
        return s
    groups = grouping.groups(grads)
    order: list[int] = []
    parts_f, parts_c, parts_k = [], [], []
    for (_device, _dtype), idx in groups.items():
        f, c, k = ops.multi_tensor_clamp_([grads[i] for i in idx], clip_value)
        order += idx
        parts_f.append(f)
        parts_c.append(c)
        parts_k.append(k)
    dev = parts_f[0].device
    floats = torch.cat([f.to(dev) for f in parts_f])
    counts = torch.cat([c.to(dev) for c in parts_c])
    clamped = torch.cat([k.to(dev) for k in parts_k])
    row_names = [names[i] for i in order]
    total = root(norm_accumulator(floats, counts, 2.0), 2.0)
    dtype = grads[0].dtype if len(groups) == 1 else torch.float32
    s = GradStats(row_names, floats, counts, 2.0, total.to(dtype))
    s.clamped, s.clip_value = clamped, clip_value
    return s


def clamp_watch_(watch, clip_value: float) -> GradStats:
    """``clamp_stats_`` of the gradients of ``watch`` (a ``GradWatch``); of gradients held in
    pieces across ranks (a ``FragmentWatch``), the statistics and clamped counts of the whole
    ones (one collective)."""
    names, grads = watch.named_grads()
    s = clamp_stats_(names, grads, clip_value)
    return watch.whole_of(s) if watch.in_pieces else s


@torch.no_grad()
def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
    """Drop-in for `torch.nn.utils.clip_grad_value_`: clamps the gradients in place.

    The gradients of ``parameters`` are clamped to ``[-clip_value, clip_value]``, one fused pass
    per (device, dtype) group, with torch's arguments and results. For the statistics from
    before clamping and the clamped counts: ``gradfuse.clip_(model, None, value=0.5)``.

    Args:
        parameters: A tensor or an iterable of parameters; those without ``.grad`` are left out.
        clip_value: The bound; a non-negative number.
        foreach: As torch's: ``True`` on a device without foreach support raises.

    Returns:
        None; the gradients are clamped in place.

    Raises:
        ValueError: ``clip_value`` is negative, NaN or not a number (torch would clamp every
            gradient to ``-|clip_value|`` / NaN).
        RuntimeError: ``foreach=True`` on a device without foreach support, as torch raises.

    Example:
        ```python
        loss.backward()
        gradfuse.clip_grad_value_(model.parameters(), clip_value=0.5)
        ```
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_value = check_clip_value(clip_value)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    for (device, _dtype), idx in grouping.groups(grads).items():
        group = [grads[i] for i in idx]
        if foreach and not _device_has_foreach_support(device):
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on "
                               f"{device.type} tensors")
        if distributed.may_have_dtensors(group):
            group = [distributed.local_tensor(g) for g in group]
        if (all(g.layout == torch.strided and g.dtype in SUPPORTED_DTYPES for g in group)
                and _has_foreach_support(group, device=device)):
            ops.multi_tensor_clamp_(group, clip_value)
        else:  # what the fused op does not take (sparse, integer...): torch's own loop
            for g in group:
                g.clamp_(min=-clip_value, max=clip_value)

