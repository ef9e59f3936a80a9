"""Dead units of module outputs (and of the gradients with respect to them): which dimension holds
a module's units, and how many of them are exactly zero everywhere in the batch.

Units
    ``units``: features of the last dimension, or channels (dimension 1) for outputs of
    convolutions, batch/instance/group norms and pooling, and for any output of 4 or more
    dimensions (NCHW images); ``dead_units``: how many of them are exactly zero for every example
    and position of the batch (NaN counts as not zero).

Cost
    The per-unit pass is one ``abs().sum()`` over all but the unit dimension (``_unit_activity``),
    its result a small device tensor; ``dead_counts`` turns the rows' vectors into counts with
    three device ops. On an accelerator nothing is read on the host. On the CPU, where reading a
    CPU tensor is no device sync, the per-unit pass is skipped when the zero count decides it
    (``_known_dead``), when a small corner of the batch (the first image's first 64 pixels, the
    first 16 positions) holds a non-zero in every unit (``_probe_alive``), or when one slice
    across all units holds no zero (``_one_slice_alive``; tried first when under 5% of the
    elements are zero), all exact.

Layer: activations (a capability). Imports ``gradfuse.ops.layout``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from gradfuse.ops.layout import ZERO

_CHANNEL_MODULES = (nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase, nn.GroupNorm,
                    nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                    nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)
_FEW_ZEROS = 0.05  # below this zero fraction the one-slice test is tried before the probe
_PROBE_INNER = 64  # entries after the unit dimension (pixels) the probe reads per row at most
_PROBE_PER_UNIT = 16  # elements per unit the probe reads at least


def unit_dim(module: nn.Module, t: torch.Tensor) -> int:
    """The dimension whose entries are a module's units (see the module docstring)."""
    if t.dim() >= 4 or (t.dim() >= 2 and isinstance(module, _CHANNEL_MODULES)):
        return 1
    return t.dim() - 1


def unit_activity_rows(tensors: list[torch.Tensor], dims: list[int], counts: torch.Tensor) -> list:
    """Per tensor, what ``dead_counts`` takes: the activity vector of its units
    (``_unit_activity``), or its dead-unit count as an int when an exact shortcut decides it
    without the per-unit pass (CPU only; see the module docstring).

    Args:
        tensors: The rows' tensors (detached).
        dims: The unit dimension of each.
        counts: The rows' int64 counts from the fused statistics op (``ZERO`` column used); on an
            accelerator they are not read.

    Returns:
        A list with one entry per tensor: an activity vector (a device tensor) or an int.
    """
    if not counts.is_cpu:  # no host read in a hook on an accelerator
        return [_unit_activity(t, d) for t, d in zip(tensors, dims)]
    dead = []
    for t, d, row in zip(tensors, dims, counts.tolist()):
        known = _known_dead(t, d, row[ZERO]) if t.is_cpu else None
        if known is None and t.is_cpu:
            # Few zeros (a causal LM's gradient: its last position): one slice, the cheaper
            # test, usually decides; many (ReLU, dropout): it fails, the corner probe first.
            if row[ZERO] < _FEW_ZEROS * t.numel():
                alive = _one_slice_alive(t, d) or _probe_alive(t, d)
            else:
                alive = _probe_alive(t, d)
                if alive is None:
                    alive = _one_slice_alive(t, d)
            if alive:
                known = 0
        dead.append(_unit_activity(t, d) if known is None else known)
    return dead


def _unit_activity(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Per entry along ``dim``, the sum of |x| over everything else: 0 exactly when the unit is
    zero everywhere (a sum of non-negative numbers is 0 only if each is; NaN and Inf are not 0).
    ``abs().sum()`` runs 3-4x faster on the CPU than ``count_nonzero`` or ``ne(0).any()`` over
    the leading dimensions. An empty or 0-d tensor has no units to count."""
    if t.dim() == 0 or t.numel() == 0:
        return torch.ones(0, dtype=torch.int64, device=t.device)
    a = t.abs()
    if t.dim() == 1:
        return a
    return a.sum(dim=tuple(d for d in range(t.dim()) if d != dim))


def dead_counts(activity: list) -> torch.Tensor:
    """Dead units per row, from the rows' activity vectors: three device ops for all rows. A row
    may instead hold its dead-unit count as an int (known without the per-unit pass, see
    ``_known_dead``).

    Args:
        activity: Per row, an activity vector (``unit_activity_rows``) or an int.

    Returns:
        int64 ``[len(activity)]`` on the device of the first vector (the CPU without one).
    """
    if any(isinstance(a, int) for a in activity):
        vectors = [a for a in activity if not isinstance(a, int)]
        dev = vectors[0].device if vectors else "cpu"
        out = torch.tensor([a if isinstance(a, int) else 0 for a in activity], dtype=torch.int64, device=dev)
        if vectors:  # the counted rows put in place on the device: no host read
            at = torch.tensor([i for i, a in enumerate(activity) if not isinstance(a, int)], device=dev)
            out.index_copy_(0, at, dead_counts(vectors))
        return out
    lengths = [len(a) for a in activity]
    if not activity or not sum(lengths):
        return torch.zeros(len(activity), dtype=torch.int64,
                           device=activity[0].device if activity else "cpu")
    dead = torch.cat(activity).eq(0).to(torch.int64).cumsum(0)
    ends = torch.tensor(lengths, device=dead.device).cumsum(0)
    at_end = torch.cat([dead.new_zeros(1), dead])[ends]
    return at_end.diff(prepend=at_end.new_zeros(1))


def _known_dead(t: torch.Tensor, dim: int, zeros: int) -> int | None:
    """The number of dead units when the zero count alone decides it, else None. A dead unit is
    ``numel / units`` zeros: with fewer zeros in the whole output no unit can be dead (0), with
    every element zero all are. Exact; used on the CPU only, where reading the count (a CPU
    tensor) costs no device sync, to skip the per-unit pass (most outputs of GELU, tanh,
    convolutions and norms, and their gradients, hold no zero at all)."""
    if t.dim() == 0 or t.numel() == 0:
        return 0
    units = t.shape[dim]
    if zeros < t.numel() // units:
        return 0
    if zeros == t.numel():
        return units
    return None


def _one_slice_alive(t: torch.Tensor, dim: int) -> bool:
    """True when one slice holding one element of every unit (index 0 of every other dimension)
    has no zero: then every unit is alive (a dead unit is zero everywhere, also there). Exact; a
    tiny read, tried on the CPU before the per-unit pass (a gradient whose last position is all
    zero, as a causal LM's is, has many zeros but no dead unit)."""
    if t.dim() == 0 or t.numel() == 0:
        return True
    v = t[(0,) * dim + (slice(None),) + (0,) * (t.dim() - dim - 1)]
    return int(torch.count_nonzero(v)) == v.numel()


def _probe_alive(t: torch.Tensor, dim: int) -> bool | None:
    """True when a small corner of the tensor already holds a non-zero in every unit: then no
    unit is dead (a dead unit is zero everywhere, also there). Exact; CPU only (reads the
    result). With ``rows`` the entries of the dimensions before ``dim`` (examples, positions)
    and ``inner`` those after it (pixels), the corner is the first ``m <= 64`` inner entries of
    the first ``k`` rows, at least 16 elements per unit, at most a quarter of the rows: 64
    pixels of the first image for a conv output, 16 positions of a transformer's hidden state.
    The full per-unit pass runs only when a unit is still all zero there. A ReLU output (half
    its elements zero) or a dropout output (a tenth) defeats the zero count and the one-slice
    test but not this. None when the probe does not apply (unit dimension first, too few rows,
    not contiguous): the caller tries the one-slice test instead (the corner holds that slice)."""
    if dim == 0 or t.dim() < 2 or not t.is_contiguous():
        return None
    units = t.shape[dim]
    rows = math.prod(t.shape[:dim])
    inner = math.prod(t.shape[dim + 1:])
    if rows < 4 or units == 0 or inner == 0:
        return None
    m = min(inner, _PROBE_INNER)
    k = min(-(-_PROBE_PER_UNIT // m), rows // 4)
    if inner == 1:  # (positions, units): the first k rows, contiguous
        activity = t.view(rows, units)[:k].abs().sum(0)
    elif k == 1:  # (units, pixels) of the first image
        activity = t.view(rows, units, inner)[0, :, :m].abs().sum(1)
    else:
        activity = t.view(rows, units, inner)[:k, :, :m].abs().sum(dim=(0, 2))
    return int(torch.count_nonzero(activity)) == units
