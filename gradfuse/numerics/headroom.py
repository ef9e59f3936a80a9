"""Numeric headroom: from a tensor's exponent histogram (``gradfuse.numerics.histogram``) and its
largest magnitude, the fraction of its elements that a cast to a narrower float format would
flush to zero, make subnormal, or overflow; without scaling, and with the per-tensor amax
scaling of TransformerEngine.

Formats (``FORMATS``): ``fp16``, ``bf16``, ``fp8_e4m3`` (OCP E4M3FN, as ``torch.float8_e4m3fn``:
max 448, no infinity) and ``fp8_e5m2`` (max 57344). Each has a smallest subnormal 2^s, smallest
normal 2^m and largest binade 2^M (fp16: -24, -14, 15; bf16: -133, -126, 127; e4m3: -9, -6, 8;
e5m2: -16, -14, 15).

Columns (fractions of all elements of the tensor, NaN and Inf included in the count):
  ``<fmt>_underflow``   finite non-zero elements whose binade lies below 2^(s-1): they round to 0
  ``<fmt>_subnormal``   finite elements in binades 2^(s-1) .. 2^(m-1): they become subnormal
  ``<fmt>_overflow``    finite elements in binades from 2^(M+1) up: they become Inf (or NaN /
                        saturate, for formats without Inf)
  and the same with ``_scaled``: after multiplying the tensor by TransformerEngine's scale
  ``scale = fmt_max / amax`` (``transformer_engine.pytorch.fp8._default_sf_compute`` with
  margin 0: ``sf = (fp8_max / amax) / 2**margin``, and the previous scale, 1 here, when amax is 0
  or not finite). ``amax`` is the tensor's own max |x| (current scaling; delayed scaling uses
  the max over an amax history, which can only be larger). fp16 and bf16 are scaled by the same
  rule with their own maximum.

What the exponent alone decides, and what it does not: the thresholds 2^(s-1), 2^m and
2^(M+1) are binade edges, so without scaling each binade is classified whole and exactly,
except for values within half a unit in the last place of a threshold, which a cast rounds
across it (|x| exactly 2^(s-1) rounds to 0; the top of the largest subnormal binade rounds up to
the smallest normal; values above the format's maximum but below 2^(M+1), e.g. (448, 512) for
e4m3, overflow). A scale that is not a power of two moves the thresholds inside a binade: that
binade is split in proportion to the distance in log2 (as if its values were spread evenly in
log2); every binade's upper edge is capped at log2(amax), so that the scaled maximum never
counts as overflow. Bin 0 of float64 tensors (|x| < 2^-149) is taken as the binade 2^-150 and
bin 279 (finite |x| >= 2^128) as the binade 2^128.

Layer: numerics (a capability). Imports ``gradfuse.ops.layout`` and the core's GradStats
helpers.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from gradfuse.core.layers import columns_to_host, exponents_entry, layer_of, sum_by_key
from gradfuse.ops import layout as H

__all__ = ["COLUMNS", "FORMATS", "KINDS", "Format", "amax_scale", "headroom_columns", "layer_record",
           "table", "to_host"]


@dataclasses.dataclass(frozen=True)
class Format:
    """A floating-point format's exponent range, as the headroom columns read it.

    Attributes:
        name: The format's name in the column names (``fp16``, ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``).
        min_subnormal_exponent: s: the smallest subnormal is 2^s.
        min_normal_exponent: m: the smallest normal is 2^m.
        max_exponent: M: the largest finite value lies in [2^M, 2^(M+1)).
        max_value: The largest finite value.
    """

    name: str
    min_subnormal_exponent: int
    min_normal_exponent: int
    max_exponent: int
    max_value: float


FORMATS = {f.name: f for f in (
    Format("fp16", -24, -14, 15, 65504.0),
    Format("bf16", -133, -126, 127, float(torch.finfo(torch.bfloat16).max)),
    Format("fp8_e4m3", -9, -6, 8, 448.0),
    Format("fp8_e5m2", -16, -14, 15, 57344.0),
)}
KINDS = ("underflow", "subnormal", "overflow")
COLUMNS = tuple(f"{fmt}_{kind}{suffix}" for suffix in ("", "_scaled") for fmt in FORMATS for kind in KINDS)


def _binade_edges(device) -> tuple[torch.Tensor, torch.Tensor]:
    """log2 of each bin's lower edge, and a mask of the bins of finite non-zero values."""
    lo = torch.zeros(H.NUM_BINS, dtype=torch.float64, device=device)
    lo[2:H.BIN_ABOVE] = torch.arange(H.MIN_EXPONENT, H.MAX_EXPONENT + 1, dtype=torch.float64, device=device)
    lo[H.BIN_BELOW] = H.MIN_EXPONENT - 1
    lo[H.BIN_ABOVE] = H.MAX_EXPONENT + 1
    finite = torch.zeros(H.NUM_BINS, dtype=torch.bool, device=device)
    finite[2:H.BIN_ABOVE + 1] = True
    finite[H.BIN_BELOW] = True
    return lo, finite


def amax_scale(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """TransformerEngine's scale for ``fmt`` (margin 0): ``fmt.max_value / amax``, or 1 where
    amax is 0 or not finite (TE keeps the previous scale; a first step's is 1)."""
    amax = amax.to(torch.float64)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, fmt.max_value / torch.where(ok, amax, 1.0), 1.0)


def headroom_columns(hist: torch.Tensor, amax: torch.Tensor) -> dict[str, torch.Tensor]:
    """{column: float64 [n] on the histograms' device} for ``hist`` (int64 [n, NUM_BINS]) and
    each tensor's max |x| ``amax`` ([n]); see the module docstring for the columns."""
    hist = hist.to(torch.float64)
    n = hist.shape[0]
    numel = hist.sum(1).clamp(min=1)
    lo, finite = _binade_edges(hist.device)
    amax = amax.to(hist.device, torch.float64).reshape(n)
    usable = torch.isfinite(amax) & (amax > 0)
    log_amax = torch.where(usable, torch.log2(torch.where(usable, amax, 1.0)), math.inf)[:, None]
    # each binade as [lo, hi] in log2, its top capped at the tensor's max |x|
    lo = lo[None, :].expand(n, -1)
    hi = torch.minimum(lo + 1, torch.maximum(log_amax, lo))
    width = (hi - lo).clamp(min=1e-300)
    weights = hist * finite[None, :]

    def below(threshold: float, shift: torch.Tensor) -> torch.Tensor:
        # the part of each (shifted) binade below 2^threshold, per element of it
        return ((threshold - (lo + shift)) / width).clamp(0.0, 1.0)

    out = {}
    for scaled in (False, True):
        suffix = "_scaled" if scaled else ""
        for fmt in FORMATS.values():
            shift = torch.log2(amax_scale(amax, fmt))[:, None] if scaled else torch.zeros((n, 1), dtype=torch.float64,
                                                                                          device=hist.device)
            under = below(fmt.min_subnormal_exponent - 1, shift)
            normal = below(fmt.min_normal_exponent, shift)
            finite_top = below(fmt.max_exponent + 1, shift)
            out[f"{fmt.name}_underflow{suffix}"] = (weights * under).sum(1) / numel
            out[f"{fmt.name}_subnormal{suffix}"] = (weights * (normal - under)).sum(1) / numel
            out[f"{fmt.name}_overflow{suffix}"] = (weights * (1.0 - finite_top)).sum(1) / numel
    return out


def to_host(names: list[str], columns: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """{name: {column: value}} with one device-to-host transfer."""
    return columns_to_host(names, columns)


def table(names: list[str], columns: dict[str, torch.Tensor], scaled: bool = False) -> str:
    """A fixed-width table: per tensor and format, underflow / subnormal / overflow in percent."""
    rows = to_host(names, columns)
    suffix = "_scaled" if scaled else ""
    width = max([len("tensor")] + [len(n) for n in names])
    head = f"{'tensor':<{width}}" + "".join(f"  {fmt + ' u/s/o %':>24}" for fmt in FORMATS)
    lines = [head + ("   (amax-scaled)" if scaled else ""), "-" * len(head)]
    for name in names:
        r = rows[name]
        cells = []
        for fmt in FORMATS:
            u, s, o = (100 * r[f"{fmt}_{k}{suffix}"] for k in KINDS)
            cells.append(f"  {f'{u:.2f}/{s:.2f}/{o:.2f}':>24}")
        lines.append(f"{name:<{width}}" + "".join(cells))
    return "\n".join(lines)


def layer_record(names: list[str], hist: torch.Tensor, columns: dict[str, torch.Tensor],
                 depth: int | None = None) -> tuple[dict, dict]:
    """Per layer (``gradfuse.core.grad_stats.layer_of``): ({layer: {column: fraction}} weighted by
    element counts, {layer: {"first_bin": b, "counts": [...]}}, the summed exponent histogram
    without its empty ends, ``gradfuse.core.grad_stats.exponents_entry``), for a monitor record;
    one device-to-host transfer."""
    if not names:
        return {}, {}
    keys, packed = packed_rows(hist, columns)
    return layer_record_of_rows(names, keys, packed, depth)


def packed_rows(hist: torch.Tensor, columns: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    """(the column names, per tensor one float64 row on the histograms' device: its histogram,
    its element count, and each column times that count): what ``layer_record_of_rows`` sums,
    made without a transfer."""
    keys = list(columns)
    numel = hist.sum(1, keepdim=True).to(torch.float64)
    return keys, torch.cat([hist.to(torch.float64), numel, torch.stack([columns[k] for k in keys], 1) * numel], 1)


def layer_record_of_rows(names: list[str], keys: list[str], packed: torch.Tensor,
                         depth: int | None = None) -> tuple[dict, dict]:
    """``layer_record`` from ``packed_rows``'s rows (a device tensor: one transfer; or a host copy
    of them)."""
    if not names:
        return {}, {}
    sums = sum_by_key([layer_of(name, depth) for name in names], packed)
    frac, exps = {}, {}
    nb = H.NUM_BINS
    for layer, acc in sums.items():
        n = max(acc[nb], 1.0)
        frac[layer] = {k: acc[nb + 1 + i] / n for i, k in enumerate(keys)}
        exps[layer] = exponents_entry(acc[:nb])
    return frac, exps
