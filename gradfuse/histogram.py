"""Exponent histograms: per tensor, how many elements have each binary exponent floor(log2|x|),
from one fused multi-tensor pass (``torch.ops.gradfuse.multi_tensor_exponent_histogram``).

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
"""
from __future__ import annotations

import math

import torch

from gradfuse import _ext

NUM_BINS = 283
BIN_BELOW = 0
BIN_ZERO = 1
MIN_EXPONENT = -149
MAX_EXPONENT = 127
EXPONENT_OFFSET = 151
BIN_ABOVE = 279
BIN_POS_INF = 280
BIN_NEG_INF = 281
BIN_NAN = 282


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


def reference_histogram(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The op's result computed with ``torch.frexp`` in float64 (exact for every float dtype), on
    the tensors' device: the fallback where gradfuse._C has no kernel, and a test oracle."""
    if not tensors:
        return torch.zeros((0, NUM_BINS), dtype=torch.int64)
    rows = []
    for t in tensors:
        x = t.detach().reshape(-1).to(torch.float64)
        _mantissa, ex = torch.frexp(x)  # x = m * 2^ex, 0.5 <= |m| < 1: floor(log2|x|) = ex - 1
        e = ex.to(torch.int64) - 1
        b = (e + EXPONENT_OFFSET).clamp(BIN_BELOW, BIN_ABOVE)
        b = torch.where(e < MIN_EXPONENT, BIN_BELOW, b)
        b = torch.where(x == 0, BIN_ZERO, b)
        b = torch.where(x == math.inf, BIN_POS_INF, b)
        b = torch.where(x == -math.inf, BIN_NEG_INF, b)
        b = torch.where(x.isnan(), BIN_NAN, b)
        rows.append(torch.bincount(b, minlength=NUM_BINS))
    return torch.stack(rows)


def multi_tensor_exponent_histogram(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64 ``[len(tensors), NUM_BINS]`` on the tensors' device, for one (device, dtype) group
    of dense float16 / bfloat16 / float32 / float64 tensors; no host synchronisation."""
    if not tensors or not _ext.use_compiled(tensors[0].device):
        first = tensors[0] if tensors else None
        for i, t in enumerate(tensors):
            if t.dtype != first.dtype or t.device != first.device:
                raise RuntimeError(f"gradfuse reference: tensors[{i}] is {t.dtype} on {t.device} but "
                                   f"tensors[0] is {first.dtype} on {first.device}")
        return reference_histogram(tensors)
    return torch.ops.gradfuse.multi_tensor_exponent_histogram(tensors)


def exponent_histogram(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Histograms of tensors of any mix of devices and dtypes: one fused pass per (device, dtype)
    group; rows in the order of ``tensors``, on the first tensor's device."""
    if not tensors:
        return torch.zeros((0, NUM_BINS), dtype=torch.int64)
    device = tensors[0].device
    try:  # the usual case, one group: the op checks that in C++
        return multi_tensor_exponent_histogram(tensors).to(device)
    except RuntimeError:
        pass
    from gradfuse.api import _groups
    out = torch.empty((len(tensors), NUM_BINS), dtype=torch.int64, device=device)
    for (_device, _dtype), idx in _groups(tensors).items():
        out[idx] = multi_tensor_exponent_histogram([tensors[i] for i in idx]).to(device)
    return out


if _ext._C is not None and hasattr(torch.ops.gradfuse, "multi_tensor_exponent_histogram"):
    @torch.library.register_fake("gradfuse::multi_tensor_exponent_histogram")
    def _histogram_fake(tensors):
        if len(tensors) == 0:
            return torch.empty((0, NUM_BINS), dtype=torch.int64)
        return tensors[0].new_empty((len(tensors), NUM_BINS), dtype=torch.int64)


def attach(s, names: list[str], tensors: list[torch.Tensor]):
    """Sets ``s.exponent_histogram`` (rows following ``s.names``) from ``tensors`` (named
    ``names``, the tensors ``s`` was taken of); returns ``s``. DTensors count their local shard."""
    from gradfuse import distributed
    if distributed.may_have_dtensors(tensors):
        tensors = [distributed.local_tensor(t) for t in tensors]
    h = exponent_histogram(tensors)
    if list(s.names) != list(names):  # several (device, dtype) groups: rows grouped in s
        position = {name: i for i, name in enumerate(names)}
        h = h[torch.tensor([position[name] for name in s.names], dtype=torch.long, device=h.device)]
    s.exponent_histogram = h.to(s._floats.device)
    return s
