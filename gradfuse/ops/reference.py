"""The pure-PyTorch implementation of every compiled op (the optimizer-update ops' is in
``gradfuse.ops.update_reference``): the test oracle, and the fallback where gradfuse._C has no
kernel. Same inputs, outputs and semantics as the compiled ops (see
csrc/gradfuse.cpp), computed per tensor in float64; no host synchronisation.

On a device without float64 (``library.NO_FLOAT64``: Apple's MPS) the rows are computed and
returned in float32: sums of squares and power sums then carry float32's relative rounding of
about 1e-7 per addition, so norms over n elements are within about n * 1e-7 relative (much less
in practice: torch's float32 reductions are pairwise); counts are exact.

Layer: ops (the bottom). Imports ``gradfuse.ops.layout`` and ``gradfuse.ops.library``.

``tensor_rows`` is the slow path for what the kernels do not take: sparse (COO) and complex
tensors, and negative norm orders (including -inf).
"""
from __future__ import annotations

import math

import torch

from gradfuse.ops.layout import (
    BIN_ABOVE,
    BIN_BELOW,
    BIN_NAN,
    BIN_NEG_INF,
    BIN_POS_INF,
    BIN_ZERO,
    COUNT_NAMES,
    EXPONENT_OFFSET,
    FLOAT_NAMES,
    M2,
    MIN_EXPONENT,
    NUM_BINS,
    NUM_COUNT_STATS,
    NUM_FLOAT_STATS,
)
from gradfuse.ops.library import stats_dtype

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_one_group(tensors: list[torch.Tensor]) -> None:
    """Raises RuntimeError unless every tensor has the first one's dtype and device.

    As the compiled ops do: callers rely on the error to group mixed lists.
    """
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype or t.device != first.device:
            raise RuntimeError(f"gradfuse reference: tensors[{i}] is {t.dtype} on {t.device} but "
                               f"tensors[0] is {first.dtype} on {first.device}")


def _check_kernel_inputs(tensors: list[torch.Tensor]) -> None:
    # What the compiled ops refuse, refused here too: callers rely on the error to find them.
    for i, t in enumerate(tensors):
        if t.layout != torch.strided or t.dtype not in KERNEL_DTYPES:
            raise RuntimeError(f"gradfuse reference: tensors[{i}] is {t.dtype}, {t.layout}; "
                               "expected dense float16, bfloat16, float32 or float64")


def multi_tensor_stats(tensors: list[torch.Tensor], norm_type: float):
    """The rows of ``gradfuse::multi_tensor_stats`` for one (device, dtype) group of dense tensors."""
    if len(tensors) == 0:
        return _empty_rows()
    check_one_group(tensors)
    _check_kernel_inputs(tensors)
    return tensor_rows(tensors, norm_type)


def multi_tensor_moments(tensors: list[torch.Tensor]):
    """The rows of ``multi_tensor_stats(tensors, 2)`` with ``M2`` (the sum of squared deviations
    from the mean) in the power sum's column, by two passes: the mean, then the deviations
    ``d``, as ``sum d^2 - (sum d)^2 / n`` (the correction term takes off the rounding of the
    mean, which matters on the float32 path)."""
    if len(tensors) == 0:
        return _empty_rows()
    check_one_group(tensors)
    _check_kernel_inputs(tensors)
    floats, counts = tensor_rows(tensors, 2.0)
    acc = floats.dtype
    m2 = []
    for t in tensors:
        x = t.detach().reshape(-1).to(acc)
        d = x - x.mean() if x.numel() else x
        m2.append((d.square().sum() - d.sum() ** 2 / max(x.numel(), 1)).clamp(min=0))  # NaN stays
    floats[:, M2] = torch.stack(m2)
    return floats, counts


def _empty_rows(device=None):
    device = torch.device("cpu") if device is None else device
    return (torch.empty((0, NUM_FLOAT_STATS), dtype=stats_dtype(device), device=device),
            torch.empty((0, NUM_COUNT_STATS), dtype=torch.int64, device=device))


def stack_columns(columns: dict[str, torch.Tensor], names: tuple[str, ...], dim: int) -> torch.Tensor:
    """The columns of a row (or of rows, along ``dim``) in the order of the layout; every column of
    the layout must be there."""
    if set(columns) != set(names):
        raise AssertionError(f"the reference computes {sorted(columns)}, the layout has {sorted(names)}")
    return torch.stack([columns[n] for n in names], dim)


def tensor_rows(tensors: list[torch.Tensor], norm_type: float):
    """The rows of ``multi_tensor_stats`` for tensors of one device, of any order and kind.

    This covers what the kernels do not take:

    - norm_type < 0: POWSUM holds sum |x|^p (|x|, so -0.0 is 0.0); p = -inf: min |x| (+inf for
      an empty tensor, which then leaves the minimum over several tensors alone).
    - sparse COO: the statistics of the stored values after coalescing, numel and the zero count
      of the whole tensor; sum |x|^p and min |x| are over the stored values only, as
      torch.linalg.vector_norm computes them for a sparse tensor.
    - complex: norms of |z|, NaN/Inf counts of z; SUM (hence ``mean``) is NaN.
    """
    if len(tensors) == 0:
        return _empty_rows()
    device = tensors[0].device
    acc = stats_dtype(device)
    p = float(norm_type)
    rows_f, rows_c = [], []
    for t in tensors:
        numel = t.numel()
        t = t.detach()
        if t.layout == torch.sparse_coo:
            t = t.coalesce().values()
        if t.is_complex():
            x = t.reshape(-1).to(torch.complex128 if acc == torch.float64 else torch.complex64)
            a = x.abs()
            total = torch.full((), math.nan, dtype=acc, device=device)
            sumsq = torch.view_as_real(x).square().sum()
        else:
            x = t.reshape(-1).to(acc)
            a = x.abs()
            total = x.sum()
            sumsq = (x * x).sum()
        if p == -math.inf:
            powsum = a.amin() if x.numel() else a.new_full((), math.inf)
        elif p in (0.0, 2.0) or math.isinf(p):
            powsum = a.new_zeros(())
        elif p == 1.0:
            powsum = a.sum()
        else:
            powsum = a.pow(p).sum()
        maxabs = a.amax() if x.numel() else a.new_zeros(())
        rows_f.append(stack_columns({"sum": total, "sumsq": sumsq, "maxabs": maxabs, "powsum": powsum},
                                     FLOAT_NAMES, 0))
        rows_c.append(stack_columns({"nan": x.isnan().sum(), "inf": x.isinf().sum(),
                                      "zero": (x == 0).sum() + (numel - x.numel()),
                                      "numel": torch.tensor(numel, device=device)}, COUNT_NAMES, 0))
    return torch.stack(rows_f), torch.stack(rows_c).to(torch.int64)


def multi_tensor_scale_(tensors: list[torch.Tensor], coef: torch.Tensor,
                        conditional: bool = True) -> None:
    """Every tensor times ``coef`` in place; with ``conditional``, only when ``coef < 1`` or NaN."""
    if len(tensors) == 0:
        return
    check_one_group(tensors)
    _check_kernel_inputs(tensors)
    coef = coef.reshape(()).to(tensors[0].device)
    # min(coef, 1) is exact when no scaling is needed, and needs no host decision.
    torch._foreach_mul_(tensors, torch.clamp(coef, max=1.0) if conditional else coef)


# ---- Clipping beyond one global norm: per-tensor / per-unit scale, unit statistics, clamp by
# value. Same contract as the compiled ops (csrc/gradfuse.cpp); arithmetic in the
# kernels' accumulation type (float32, float64 for float64 data) where the result is rounded back
# to the data's dtype, so that the compiled ops match these bit for bit.

def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type the kernels compute in for data of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_units(tensors: list[torch.Tensor], units, op: str) -> list[int]:
    """``units`` as a list of ints, checked against ``tensors`` as the compiled ops check them."""
    units = [int(u) for u in units]
    if len(units) != len(tensors):
        raise RuntimeError(f"{op}: got {len(tensors)} tensors but {len(units)} unit counts")
    for i, (t, u) in enumerate(zip(tensors, units)):
        n = t.numel()
        if u < 0 or (u == 0 and n != 0) or (u > 0 and n % u != 0):
            raise RuntimeError(f"{op}: units[{i}] = {u} does not divide tensors[{i}]'s {n} "
                               "elements into equal blocks (expected a divisor of numel, >= 1; "
                               "0 only for an empty tensor)")
    return units


def check_coefs(coefs: torch.Tensor, count: int, device: torch.device, op: str) -> None:
    """Raises RuntimeError unless ``coefs`` is a 1-D floating tensor of ``count`` entries on ``device``."""
    if not isinstance(coefs, torch.Tensor) or coefs.dim() != 1 or coefs.numel() != count:
        shape = tuple(coefs.shape) if isinstance(coefs, torch.Tensor) else type(coefs).__name__
        raise RuntimeError(f"{op}: coefs must be a 1-D tensor of {count} coefficients (one per "
                           f"tensor or unit), got {shape}")
    if not coefs.is_floating_point():
        raise RuntimeError(f"{op}: coefs must be floating point, got {coefs.dtype}")
    if coefs.device != device:
        raise RuntimeError(f"{op}: coefs is on {coefs.device} but the tensors are on {device}")


def check_clip_value(clip_value: float, op: str) -> float:
    """``clip_value`` as a float; raises RuntimeError unless it is a number >= 0 (NaN refused)."""
    v = float(clip_value)
    if not v >= 0.0:  # also NaN
        raise RuntimeError(f"{op}: clip_value must be >= 0 and not NaN, got {v}")
    return v


def multi_tensor_unit_stats(tensors: list[torch.Tensor], units, norm_type: float = 2.0):
    """Rows of ``multi_tensor_stats`` for every unit: tensor i (in logical, row-major order) cut
    into ``units[i]`` equal consecutive blocks; rows concatenated in order, ``sum(units)`` rows.
    As the kernels do, norm orders 0, 2 and +-inf leave POWSUM at 0 and p < 0 sums |x|^p."""
    op = "gradfuse.multi_tensor_unit_stats"
    units = check_units(tensors, units, op)
    if len(tensors) == 0:
        return _empty_rows()
    check_one_group(tensors)
    _check_kernel_inputs(tensors)
    device = tensors[0].device
    p = float(norm_type)
    rows_f, rows_c = [], []
    for t, u in zip(tensors, units):
        if u == 0:
            continue
        x = t.detach().reshape(u, -1).to(stats_dtype(device))
        length = x.shape[1]
        a = x.abs()
        if length == 0:
            rows_f.append(x.new_zeros((u, NUM_FLOAT_STATS)))
            rows_c.append(torch.zeros((u, NUM_COUNT_STATS), dtype=torch.int64, device=device))
            continue
        if p in (0.0, 2.0) or math.isinf(p):
            powsum = a.new_zeros(u)
        elif p == 1.0:
            powsum = a.sum(1)
        else:
            powsum = a.pow(p).sum(1)
        rows_f.append(stack_columns({"sum": x.sum(1), "sumsq": (x * x).sum(1), "maxabs": a.amax(1),
                                      "powsum": powsum}, FLOAT_NAMES, 1))
        numel = torch.full((u,), length, dtype=torch.int64, device=device)
        rows_c.append(stack_columns({"nan": x.isnan().sum(1), "inf": x.isinf().sum(1), "zero": (x == 0).sum(1),
                                      "numel": numel}, COUNT_NAMES, 1))
    if not rows_f:
        return _empty_rows(device)
    return torch.cat(rows_f), torch.cat(rows_c).to(torch.int64)


def multi_tensor_unit_scale_(tensors: list[torch.Tensor], units, coefs: torch.Tensor,
                             conditional: bool = True) -> None:
    """Multiplies unit j of tensor i (units as in ``multi_tensor_unit_stats``) in place by its
    coefficient (``coefs``: one per unit, concatenated in order). ``conditional``: by min(coef, 1)
    (NaN stays NaN), which is exact where the compiled op leaves a unit untouched."""
    op = "gradfuse.multi_tensor_unit_scale_"
    units = check_units(tensors, units, op)
    if len(tensors) == 0:
        return
    check_one_group(tensors)
    _check_kernel_inputs(tensors)
    check_coefs(coefs, sum(units), tensors[0].device, op)
    acc = acc_dtype(tensors[0].dtype)
    c = coefs.to(acc)
    if conditional:
        c = torch.clamp(c, max=1.0)
    start = 0
    for t, u in zip(tensors, units):
        cu = c[start:start + u]
        start += u
        if u == 0 or t.numel() == 0:
            continue
        scaled = t.detach().reshape(u, -1).to(acc) * cu[:, None]
        t.detach().copy_(scaled.reshape(t.shape))


def multi_tensor_scale_per_tensor_(tensors: list[torch.Tensor], coefs: torch.Tensor,
                                   conditional: bool = True) -> None:
    """Tensor i multiplied in place by coefs[i] (``multi_tensor_unit_scale_`` with units of 1)."""
    multi_tensor_unit_scale_(tensors, [1] * len(tensors), coefs, conditional)


def multi_tensor_clamp_(tensors: list[torch.Tensor], clip_value: float):
    """Clamps every element to [-clip_value, clip_value] in place as
    ``torch.nn.utils.clip_grad_value_`` does (NaN stays NaN, -0.0 stays -0.0) and returns
    ``(floats, counts, clamped)``: the ``multi_tensor_stats`` rows (norm_type 2) of the values
    before clamping, and int64 ``[n]``, the elements clamping changed per tensor (|x| above
    clip_value as rounded to the tensors' dtype; NaN never counts)."""
    v = check_clip_value(clip_value, "gradfuse.multi_tensor_clamp_")
    floats, counts = multi_tensor_stats(tensors, 2.0)
    if len(tensors) == 0:
        return floats, counts, torch.empty(0, dtype=torch.int64)
    # clip_value rounded to the dtype, as torch rounds the scalar; one that overflows it (which
    # torch refuses for float16) clamps nothing.
    limit = torch.tensor(v, dtype=tensors[0].dtype)  # rounded once, to the data's dtype
    clamped = torch.stack([(t.detach().abs() > limit.to(t.device)).sum() for t in tensors])
    if not math.isinf(limit.item()):
        ts = [t.detach() for t in tensors]
        torch._foreach_clamp_min_(ts, -v)
        torch._foreach_clamp_max_(ts, v)
    return floats, counts, clamped.to(torch.int64)


def exponent_histogram(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The histogram op's result computed with ``torch.frexp`` in float64 (exact for every float
    dtype), on the tensors' device: the fallback where gradfuse._C has no kernel, and a test
    oracle. Bins as ``gradfuse.ops.layout``."""
    if not tensors:
        return torch.zeros((0, NUM_BINS), dtype=torch.int64)
    rows = []
    for t in tensors:
        # exact in float64 for every dtype; in float32 for float32 and narrower data (the only
        # data on a device without float64)
        x = t.detach().reshape(-1)
        x = x.to(torch.float64 if x.dtype == torch.float64 or stats_dtype(x.device) == torch.float64
                 else torch.float32)
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
    """The histogram op's contract: one (device, dtype) group, else a RuntimeError."""
    if tensors:
        check_one_group(tensors)
    return exponent_histogram(tensors)
