"""Statistics of DTensor gradients (FSDP2 ``fully_shard``, tensor parallel, HSDP): how the fused
pass over this rank's shards becomes the statistics of the full gradients.

- The total norm alone (``clip_grad_norm_``, ``get_total_norm``, the monitor's ordinary step):
  as torch.nn.utils does it, the local accumulator of each sharding layout (sum of |x|^p, or
  max |x| for inf) is a Partial value reduced to Replicate by one functional all-reduce
  (``c10d_functional.all_reduce``, of one scalar; two for inf, the NaN flag beside the max) per
  sharded mesh dimension. A NaN/Inf gradient element makes the total NaN/Inf, so the non-finite
  flag travels in it. The per-parameter rows stay those of the local shards until someone reads
  them (``PendingRows``).
- Per-parameter rows (``stats``, ``clip_``, the monitor's logging and anomaly steps): each
  layout's rows are reduced over its sharded mesh dimensions (gradfuse.core.distributed).

Layer: core. Imports the core's distributed, norms and params.
"""
from __future__ import annotations

import math

import torch

from gradfuse.core import distributed
from gradfuse.core.norms import norm_accumulator
from gradfuse.core.params import check_tensors


def split_dtensors(names: list[str], tensors: list[torch.Tensor], norm_type: float):
    """(local tensors, layouts, spec of the total norm) of ``tensors``, some of them DTensors."""
    pairs = [distributed.local_and_layout(n, t) for n, t in zip(names, tensors)]
    locals_, layouts = [p[0] for p in pairs], [p[1] for p in pairs]
    return locals_, layouts, distributed.total_norm_spec(tensors, layouts, norm_type)


def layout_groups(names, tensors, layouts, what, slow_path=False) -> dict[tuple, list[int]]:
    """Indices per (layout order, device, dtype) when some tensors are sharded: rows of one
    sharding layout stay adjacent, so each layout is reduced as one block."""
    check_tensors(names, tensors, what, slow_path)
    layout_order: dict = {}
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        order = layout_order.setdefault(layout_key(layouts[i]), len(layout_order))
        groups.setdefault((order, t.device, t.dtype), []).append(i)
    return groups


def layout_key(layout):
    """The key under which tensors of one sharding ``layout`` are grouped; None for a plain tensor."""
    # The mesh itself, not its id: FSDP2 can hand equal meshes as distinct objects, which would
    # cost another 2 collectives each (DeviceMesh caches its hash; == checks identity first).
    return None if layout is None else (layout[0], layout[1])


def reduce_rows(floats, counts, segments, norm_type: float):
    """Replaces the rows of sharded gradients with those of the full gradients; consecutive
    segments of one layout (several dtypes) are reduced together."""
    merged = []
    for layout, a, b in segments:
        if merged and merged[-1][0] is not None and layout is not None \
                and layout_key(merged[-1][0]) == layout_key(layout):
            merged[-1] = (layout, merged[-1][1], b)
        else:
            merged.append((layout, a, b))
    f_parts, c_parts = [], []
    for layout, a, b in merged:
        if layout is None:
            f_parts.append(floats[a:b])
            c_parts.append(counts[a:b])
        else:
            f, c = distributed.reduce_sharded_rows(floats, counts, layout, a, b, norm_type)
            f_parts.append(f)
            c_parts.append(c)
    return torch.cat(f_parts), torch.cat(c_parts)


def total_only_takes(norm_type: float) -> bool:
    """Orders whose total is a sum (or max) of per-shard accumulators: p > 0 and inf. The
    gradient 0-norm counts tensors with a non-zero element, and negative orders and -inf take the
    per-tensor path: those reduce the rows."""
    return norm_type > 0


def reduce_total(floats, counts, segments, norm_type: float) -> torch.Tensor:
    """The accumulator of the total norm of the full gradients from the rows of this rank's
    shards (``segments``: (layout, first row, end row)): one functional all-reduce per sharded
    mesh dimension and sharding layout (FSDP2 and HSDP have one layout)."""
    combine = _maximum if math.isinf(norm_type) else _add
    unsharded, by_layout = [], {}
    for layout, a, b in segments:
        acc = norm_accumulator(floats[a:b], counts[a:b], norm_type)
        if layout is None:
            unsharded.append(acc)
        else:
            by_layout.setdefault(layout_key(layout), (layout, []))[1].append(acc)
    parts = unsharded
    for layout, accs in by_layout.values():
        local = accs[0]
        for acc in accs[1:]:
            local = combine(local, acc)
        parts.append(distributed.all_reduce_accumulator(local, layout, norm_type))
    total = parts[0]
    for acc in parts[1:]:
        total = combine(total, acc)
    return total


def _add(a, b):
    return a + b


def _maximum(a, b):
    return torch.maximum(a, b)  # propagates NaN


class PendingRows:
    """The rows of this rank's shards, reduced to those of the full gradients when first read
    (a collective: like any DTensor read, every rank must read them)."""

    def __init__(self, floats, counts, segments, norm_type: float):
        self._args = (floats, counts, segments, norm_type)
        self._rows = None

    def get(self):
        """The ``(floats, counts)`` rows of the full gradients, reduced on the first call and kept."""
        if self._rows is None:
            self._rows = reduce_rows(*self._args)
            self._args = None
        return self._rows
