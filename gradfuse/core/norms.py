"""The arithmetic of norms, in one place: a norm of order p from the per-tensor rows of the
fused op (its power sums, max |x|, counts), the total norm of several tensors, and
torch.nn.utils' clip coefficient. The C++ side has the same arithmetic once, in
csrc/common/engine.h.

Layer: core, at its bottom. Imports ``gradfuse.ops.layout`` only.
"""
from __future__ import annotations

import math

import torch

from gradfuse.ops.layout import MAXABS, NUMEL, POWSUM, SUMSQ, ZERO


def kernel_takes_order(p: float) -> bool:
    """Whether the fused kernels compute norms of order ``p``."""
    # The kernels compute |x|^p with a sign-preserving abs (pow(-0.0, p) < 0 for odd p < 0) and
    # keep no minimum: negative orders and -inf take the per-tensor path.
    return p >= 0


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a norm of ``dtype`` data (real for complex)."""
    return dtype.to_real() if dtype.is_complex else dtype


def row_accumulators(floats: torch.Tensor, counts: torch.Tensor, p: float) -> torch.Tensor:
    """Per row, what its norm of order ``p`` is a root of (the max for inf, the min for -inf, the
    count of non-zero elements for 0), float64: the rows' ``root`` is their norm."""
    if p == 2.0:
        return floats[:, SUMSQ]
    if p == math.inf:
        return floats[:, MAXABS]
    if p == -math.inf:
        return floats[:, POWSUM]
    if p == 0.0:
        return (counts[:, NUMEL] - counts[:, ZERO]).to(floats.dtype)
    return floats[:, POWSUM]


def norm_accumulator(floats: torch.Tensor, counts: torch.Tensor, p: float,
                     elementwise_zero_norm: bool = False) -> torch.Tensor:
    """What the total norm of order p is a root of (or the max / min, for inf / -inf), in
    float64; these add (or max / min) across ranks. As torch.nn.utils, the total is the norm of
    the per-tensor norms; for p != 0 that equals the norm of all elements viewed as one vector,
    for p = 0 it counts tensors with a non-zero element (``elementwise_zero_norm``: counts the
    non-zero elements, the 0-norm of the one vector)."""
    rows = row_accumulators(floats, counts, p)
    if math.isinf(p):  # amax / amin propagate NaN; an empty set of rows has norm 0
        if not rows.shape[0]:
            return rows.new_zeros(())
        return rows.amax() if p > 0 else rows.amin()
    if p == 0.0:  # NaN counts as non-zero
        return (rows if elementwise_zero_norm else (rows > 0).to(rows.dtype)).sum()
    return rows.sum()


def root(acc: torch.Tensor, p: float) -> torch.Tensor:
    """The norm of order ``p`` whose accumulator (``row_accumulators``,
    ``norm_accumulator``) is ``acc``."""
    if p == 2.0:
        return acc.sqrt()
    if math.isinf(p) or p in (0.0, 1.0):
        return acc
    return acc.pow(1.0 / p)


def clip_coefficient(norm: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """torch.nn.utils' clip coefficient ``min(max_norm / (norm + 1e-6), 1)``, in the dtype of
    ``norm``, on its device; elementwise for a tensor of norms (NaN stays NaN)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)



def rms_limit_coefficient(sumsq: torch.Tensor, numel: torch.Tensor, max_rms: float) -> torch.Tensor:
    """Adafactor's update clipping coefficient ``min(1, max_rms / rms)``, ``rms = sqrt(sumsq /
    numel)``, elementwise in float64 on the rows' device (NaN for an empty or non-finite row,
    which then stays unclipped)."""
    return torch.clamp(max_rms / (sumsq.to(torch.float64) / numel.to(torch.float64)).sqrt(), max=1.0)
