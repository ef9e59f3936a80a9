"""Exponent histograms: per tensor, how many elements have each binary exponent floor(log2|x|),
from one fused multi-tensor pass per (device, dtype) group
(``torch.ops.gradfuse.multi_tensor_exponent_histogram``).

Bins (``NUM_BINS`` = 283 per tensor, the same for every dtype; ``bin_labels()`` names them):

====================  =====================================================================
bin                   elements
====================  =====================================================================
0  (``BIN_BELOW``)    finite, non-zero, ``|x| < 2**-149`` (float64 tensors only)
1  (``BIN_ZERO``)     ``+0`` and ``-0``
``e + 151``           ``floor(log2|x|) == e`` for ``e`` in [-149, 127]: bins 2 .. 278 (the
                      exponents of float32 and bfloat16, subnormals included; float16 uses
                      -24 .. 15)
279 (``BIN_ABOVE``)   finite, ``|x| >= 2**128`` (float64 tensors only)
280, 281, 282         ``+inf``, ``-inf``, NaN
====================  =====================================================================

The exponent comes from the bits (the biased exponent field, or for a subnormal the highest set
mantissa bit), the same arithmetic on the CPU and the GPU (``csrc/common/hist_math.h``).

Layer: numerics (a capability). Imports ``gradfuse.ops``, ``gradfuse.core`` and
``gradfuse.numerics.headroom``.
"""
from __future__ import annotations

import torch

from gradfuse import ops
from gradfuse.core import distributed, grouping
from gradfuse.core.grad_stats import GradStats
from gradfuse.numerics.headroom import headroom_columns
from gradfuse.ops import multi_tensor_exponent_histogram  # noqa: F401  (public here too)
from gradfuse.ops.layout import (  # noqa: F401
    BIN_ABOVE,
    BIN_BELOW,
    BIN_NAN,
    BIN_NEG_INF,
    BIN_POS_INF,
    BIN_ZERO,
    EXPONENT_OFFSET,
    MAX_EXPONENT,
    MIN_EXPONENT,
    NUM_BINS,
)
from gradfuse.ops.reference import exponent_histogram as reference_histogram  # noqa: F401

__all__ = ["NUM_BINS", "BIN_BELOW", "BIN_ZERO", "MIN_EXPONENT", "MAX_EXPONENT", "EXPONENT_OFFSET",
           "BIN_ABOVE", "BIN_POS_INF", "BIN_NEG_INF", "BIN_NAN", "bin_of_exponent", "bin_labels",
           "reference_histogram", "multi_tensor_exponent_histogram", "exponent_histogram", "attach"]


def bin_of_exponent(e: int) -> int:
    """The bin of elements with ``floor(log2|x|) == e``, ``-149 <= e <= 127``."""
    if not MIN_EXPONENT <= e <= MAX_EXPONENT:
        raise ValueError(f"exponent {e} outside [{MIN_EXPONENT}, {MAX_EXPONENT}]")
    return e + EXPONENT_OFFSET


def bin_labels() -> list[str]:
    """A short name per bin: ``'<2^-149'``, ``'0'``, ``'2^-149'`` ... ``'2^127'``, ``'>=2^128'``,
    ``'+inf'``, ``'-inf'``, ``'nan'``."""
    return (["<2^-149", "0"] + [f"2^{e}" for e in range(MIN_EXPONENT, MAX_EXPONENT + 1)]
            + [">=2^128", "+inf", "-inf", "nan"])


def exponent_histogram(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Histograms of tensors of any mix of devices and dtypes: one fused pass per (device, dtype)
    group; rows in the order of ``tensors``, on the first tensor's device."""
    if not tensors:
        return torch.zeros((0, NUM_BINS), dtype=torch.int64)
    device = tensors[0].device
    parts = grouping.whole_or_grouped(
        tensors, lambda group, _idx: ops.multi_tensor_exponent_histogram(group).to(device))
    if len(parts) == 1:
        return parts[0][1]
    out = torch.empty((len(tensors), NUM_BINS), dtype=torch.int64, device=device)
    for idx, h in parts:
        out[list(idx)] = h
    return out


def attach(s: GradStats, names: list[str], tensors: list[torch.Tensor]) -> GradStats:
    """Sets ``s.exponent_histogram`` (rows following ``s.names``) from ``tensors`` (named
    ``names``, the tensors ``s`` was taken of) and ``s.headroom`` from it; returns ``s``.
    DTensors count their local shard."""
    if distributed.may_have_dtensors(tensors):
        tensors = [distributed.local_tensor(t) for t in tensors]
    h = exponent_histogram(tensors)
    if list(s.names) != list(names):  # several (device, dtype) groups: rows grouped in s
        position = {name: i for i, name in enumerate(names)}
        h = h[torch.tensor([position[name] for name in s.names], dtype=torch.long, device=h.device)]
    s.exponent_histogram = h.to(s.floats.device)
    s.headroom = headroom_columns(s.exponent_histogram, s.linf)
    return s
