"""Grouping tensors by (device, dtype): every fused op takes one such group.

Layer: core. Imports torch only.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


def groups(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` per (device, dtype), grouped in C++ (no per-tensor Python)."""
    if not tensors:
        return {}
    grouped = _group_tensors_by_device_and_dtype([tensors], with_indices=True)
    return {key: idx for key, (_, idx) in grouped.items()}


def whole_or_grouped(tensors: list[torch.Tensor], run: Callable[[list[torch.Tensor], Sequence[int]], object],
                     fallback: Callable[[list[torch.Tensor], Sequence[int]], object] | None = None
                     ) -> list[tuple[Sequence[int], object]]:
    """``run(group, indices)`` on the whole list, else on each (device, dtype) group; returns
    ``[(indices, result)]``. The usual list is one group, and the op checks that in C++: trying
    it whole costs nothing, grouping first costs a pass over every tensor. A RuntimeError from
    the whole list means several groups (or a tensor the op refuses); a RuntimeError from one
    group goes to ``fallback(group, indices)`` when given (e.g. torch's per-tensor ops for sparse
    or complex tensors), else up to the caller."""
    if not tensors:
        return []
    try:
        return [(range(len(tensors)), run(tensors, range(len(tensors))))]
    except RuntimeError:
        pass
    out = []
    for idx in groups(tensors).values():
        group = [tensors[i] for i in idx]
        try:
            out.append((idx, run(group, idx)))
        except RuntimeError:
            if fallback is None:
                raise
            out.append((idx, fallback(group, idx)))
    return out
