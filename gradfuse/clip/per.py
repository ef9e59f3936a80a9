"""Clipping each parameter, or each layer, by its own norm, from the one fused statistics pass.

Layer: clip (a capability). Imports ``gradfuse.ops`` and ``gradfuse.core``.
"""
from __future__ import annotations

import math

import torch

from gradfuse import ops
from gradfuse.core import distributed, grouping
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.layers import layer_of
from gradfuse.core.norms import clip_coefficient, root, row_accumulators

PER_MODES = (None, "param", "layer")


def check_per(per) -> str | None:
    """Returns ``per`` if it is None, ``"param"`` or ``"layer"``.

    Raises:
        ValueError: ``per`` is anything else.
    """
    if per not in PER_MODES:
        raise ValueError(f"gradfuse: per must be None, 'param' or 'layer', got {per!r}")
    return per


_layer_index_cache: dict = {}


def _layer_index(names: list[str], depth: int | None, device) -> tuple[torch.Tensor, int]:
    key = (tuple(names), depth, str(device))
    hit = _layer_index_cache.get(key)
    if hit is None:
        ids: dict[str, int] = {}
        idx = [ids.setdefault(layer_of(n, depth), len(ids)) for n in names]
        hit = (torch.tensor(idx, dtype=torch.int64, device=device), len(ids))
        if len(_layer_index_cache) > 64:
            _layer_index_cache.clear()
        _layer_index_cache[key] = hit
    return hit


def group_norms(s: GradStats, per: str, layer_depth: int | None = None) -> torch.Tensor:
    """The norm (of ``s.norm_type``) each row is clipped by: its own (``per="param"``) or its
    layer's (``per="layer"``: the norm of the layer's gradients viewed as one vector, layers as
    ``GradStats.layers`` groups them), one float64 entry per row, on the device."""
    p = s.norm_type
    if per == "param":
        if p == 0.0:
            return row_accumulators(s.floats, s.counts, p)
        return s.norm(p) if p >= 0 or p == -math.inf else root(row_accumulators(s.floats, s.counts, p), p)
    acc = row_accumulators(s.floats, s.counts, p)
    if p == 0.0:  # as torch composes a group's 0-norm: its tensors with a non-zero element
        acc = (acc > 0).to(acc.dtype)
    index, n = _layer_index(s.names, layer_depth, acc.device)
    if math.isinf(p):
        layer = acc.new_zeros(n).scatter_reduce(0, index, acc, "amax" if p > 0 else "amin",
                                                include_self=False)
    else:
        layer = acc.new_zeros(n).index_add_(0, index, acc)
    return root(layer, p)[index]


def scale_rows_(grads: list[torch.Tensor], coefs: torch.Tensor) -> None:
    """Multiplies ``grads[i]`` in place by ``coefs[i]`` where that is < 1 (or NaN), one
    per-tensor scale pass per (device, dtype) group; DTensors by their local shards."""
    if not grads:
        return
    if distributed.may_have_dtensors(grads):
        grads = [distributed.local_tensor(g) for g in grads]
    whole = len(grads)

    def fused(group, idx):
        c = coefs if len(idx) == whole else coefs[torch.tensor(list(idx), device=coefs.device)]
        ops.multi_tensor_scale_per_tensor_(group, c.to(group[0].device))

    def per_tensor(group, idx):  # sparse or complex gradients: multiplied as torch does
        c = coefs if len(idx) == whole else coefs[torch.tensor(list(idx), device=coefs.device)]
        for g, ci in zip(group, torch.clamp(c.to(group[0].device), max=1.0).unbind()):
            g.mul_(ci)

    grouping.whole_or_grouped(grads, fused, per_tensor)


def with_per_coefficients(s: GradStats, max_norm: float, per: str, layer_depth: int | None = None,
                          skip: torch.Tensor | None = None) -> GradStats:
    """``s`` with each row's coefficient, torch's of its own group (``clamp(max_norm / (norm +
    1e-6), max=1)``), as a per-row ``clip_coef``; nothing scaled. ``skip``: the step's device
    skip flag; a skipped step's coefficients are 1."""
    coefs = clip_coefficient(group_norms(s, per, layer_depth), max_norm)
    if skip is not None:
        coefs = torch.where(skip.to(coefs.device), torch.ones_like(coefs), coefs)
    out = s.replace(clip_coef=coefs, max_norm=max_norm)
    out.clip_per = per
    return out


def clip_per_(s: GradStats, grads: list[torch.Tensor], max_norm: float, per: str,
              layer_depth: int | None = None, skip: torch.Tensor | None = None) -> GradStats:
    """Scales each row of ``s`` (taken of ``grads``) by its coefficient (``with_per_coefficients``).
    Returns ``s`` with a per-row ``clip_coef``; a step ``skip`` flags is left unscaled."""
    out = with_per_coefficients(s, max_norm, per, layer_depth, skip)
    scale_rows_(grads, out.clip_coef)
    return out

