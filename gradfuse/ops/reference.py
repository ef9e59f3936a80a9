"""The pure-PyTorch implementation of every compiled op: the test oracle, and the fallback where
gradfuse._C has no kernel. Same inputs, outputs and semantics as the compiled ops (see
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
    FLAG_AMSGRAD,
    FLAG_DECOUPLED,
    FLAG_MAXIMIZE,
    FLAG_NESTEROV,
    FLOAT_NAMES,
    HYPER_BETA1,
    HYPER_BETA2,
    HYPER_EPS,
    HYPER_FLAGS,
    HYPER_LR,
    HYPER_STEP,
    HYPER_WEIGHT_DECAY,
    M2,
    MIN_EXPONENT,
    NUM_BINS,
    NUM_COUNT_STATS,
    NUM_FLOAT_STATS,
    NUM_HYPER,
    NUM_UPDATE_COUNT_STATS,
    NUM_UPDATE_FLOAT_STATS,
    RULE_ADAM,
    RULE_SGD,
    UPDATE_COUNT_NAMES,
    UPDATE_FLOAT_NAMES,
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


def _stack_columns(columns: dict[str, torch.Tensor], names: tuple[str, ...], dim: int) -> torch.Tensor:
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
        rows_f.append(_stack_columns({"sum": total, "sumsq": sumsq, "maxabs": maxabs, "powsum": powsum},
                                     FLOAT_NAMES, 0))
        rows_c.append(_stack_columns({"nan": x.isnan().sum(), "inf": x.isinf().sum(),
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
        rows_f.append(_stack_columns({"sum": x.sum(1), "sumsq": (x * x).sum(1), "maxabs": a.amax(1),
                                      "powsum": powsum}, FLOAT_NAMES, 1))
        numel = torch.full((u,), length, dtype=torch.int64, device=device)
        rows_c.append(_stack_columns({"nan": x.isnan().sum(1), "inf": x.isinf().sum(1), "zero": (x == 0).sum(1),
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


# ---- The optimizer-update ops: the update that torch.optim.SGD / Adam / AdamW is about to apply,
# with the formulas of csrc/common/update_math.h (the same operations in the same order), here in
# float64. The hyper table stays on the device: every per-tensor constant is a 0-dim tensor and
# every choice a flag makes is a torch.where, so nothing waits for the host.

_DTYPE_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _describe(t: torch.Tensor) -> str:
    layout = "" if t.layout == torch.strided else f", layout {t.layout}"
    return (f"shape {_shape(t)}, dtype {_dtype_name(t.dtype)} on {t.device}"
            f"{'' if t.is_contiguous() else ', not contiguous'}{layout}")


def check_update_inputs(op: str, params, grads, moment1, moment2, moment2_max, hyper: torch.Tensor,
                        coefs: torch.Tensor | None = None) -> None:
    """Raises RuntimeError unless the arguments of an update op are as its contract says
    (csrc/common/update_math.h, the schemas in csrc/gradfuse.cpp): one (device, dtype) group of
    dense contiguous float tensors, state lists of the same length whose entries are empty (absent)
    or match their parameter, a float64 ``[n, NUM_HYPER]`` table and float64 ``[n]`` coefficients
    on the parameters' device."""
    n = len(params)
    for name, ts in (("grads", grads), ("moment1", moment1), ("moment2", moment2), ("moment2_max", moment2_max)):
        if len(ts) != n:
            raise RuntimeError(f"{op}: {name} has {len(ts)} tensors but params has {n}")
    device = params[0].device if n else hyper.device
    for i, p in enumerate(params):
        if p.layout != torch.strided or p.dtype not in KERNEL_DTYPES or not p.is_contiguous():
            raise RuntimeError(f"{op}: params[{i}] must be a dense contiguous float16, bfloat16, float32 or "
                               f"float64 tensor, got {_describe(p)}")
        if p.dtype != params[0].dtype or p.device != device:
            raise RuntimeError(f"{op}: params[{i}] is {_dtype_name(p.dtype)} on {p.device} but params[0] is "
                               f"{_dtype_name(params[0].dtype)} on {device}")
        for name, ts, may_be_empty in (("grads", grads, False), ("moment1", moment1, True),
                                       ("moment2", moment2, True), ("moment2_max", moment2_max, True)):
            t = ts[i]
            if may_be_empty and t.numel() == 0 and t.layout == torch.strided:
                continue
            if (t.layout != torch.strided or t.shape != p.shape or t.dtype != p.dtype or t.device != p.device
                    or not t.is_contiguous()):
                raise RuntimeError(f"{op}: {name}[{i}] must be contiguous with params[{i}]'s shape {_shape(p)} "
                                   f"and dtype {_dtype_name(p.dtype)} on {p.device}"
                                   f"{' (or empty: absent)' if may_be_empty else ''}, got {_describe(t)}")
    if (hyper.dtype != torch.float64 or tuple(hyper.shape) != (n, NUM_HYPER) or hyper.device != device
            or not hyper.is_contiguous()):
        raise RuntimeError(f"{op}: hyper must be a contiguous float64 [{n}, {NUM_HYPER}] tensor on {device}, "
                           f"got {_describe(hyper)}")
    if coefs is not None and (coefs.dtype != torch.float64 or tuple(coefs.shape) != (n,) or coefs.device != device):
        raise RuntimeError(f"{op}: coefs must be a float64 [{n}] tensor on {device}, got {_describe(coefs)}")


def _check_rule(op: str, rule: int) -> int:
    rule = int(rule)
    if rule not in (RULE_SGD, RULE_ADAM):
        raise RuntimeError(f"{op}: rule must be {RULE_SGD} (SGD) or {RULE_ADAM} (Adam, AdamW), got {rule}")
    return rule


class _UpdateParams:
    """One tensor's constants from its row of the hyper table (``UpdateParams::from_row``), as
    float64 0-dim tensors and boolean 0-dim tensors on the table's device."""

    def __init__(self, row: torch.Tensor, rule: int):
        self.adam = rule == RULE_ADAM
        flags = row[HYPER_FLAGS].to(torch.int64)
        self.maximize = (flags & FLAG_MAXIMIZE) != 0
        self.nesterov = (flags & FLAG_NESTEROV) != 0
        self.amsgrad = (flags & FLAG_AMSGRAD) != 0
        self.decoupled = (flags & FLAG_DECOUPLED) != 0
        self.lr, self.weight_decay = row[HYPER_LR], row[HYPER_WEIGHT_DECAY]
        self.beta1, self.beta2, self.eps, t = row[HYPER_BETA1], row[HYPER_BETA2], row[HYPER_EPS], row[HYPER_STEP]
        self.one_minus_beta1 = 1.0 - self.beta1
        self.one_minus_beta2 = 1.0 - self.beta2
        self.one_minus_dampening = 1.0 - self.beta2
        self.step_size = self.lr / (1.0 - self.beta1 ** t)
        self.bias_correction2_sqrt = torch.sqrt(1.0 - self.beta2 ** t)
        self.decay_factor = 1.0 - self.lr * self.weight_decay
        # Where the decay sits outside the state: AdamW's decoupled decay, and SGD's when the
        # update is not the momentum buffer itself (no momentum, or nesterov).
        outside = self.decoupled if self.adam else (self.beta1 == 0) | self.nesterov
        self.decay = torch.where(outside, -self.lr * self.weight_decay, torch.zeros_like(self.lr))


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # torch.lerp's formula (aten/src/ATen/native/Lerp.h): exact at both ends
    return torch.where(weight < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight))


def _update_element(h: _UpdateParams, w, g, m, v, v_max, has_buffer: bool):
    """``update_element``: (update, moment1, root, moment2) of every element, before the step."""
    g = torch.where(h.maximize, -g, g)
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    if h.adam:
        g = torch.where((h.weight_decay != 0) & ~h.decoupled, g + h.weight_decay * w, g)
        moment1 = _lerp(m, g, h.one_minus_beta1)
        v_new = v * h.beta2 + h.one_minus_beta2 * g * g
        # torch.maximum: a NaN on either side propagates
        v_new = torch.where(h.amsgrad, torch.where((v_max > v_new) | v_max.isnan(), v_max, v_new), v_new)
        root = torch.sqrt(v_new) / h.bias_correction2_sqrt
        adam = -h.step_size * (moment1 / (root + h.eps))
        update = torch.where(h.decoupled, (w * h.decay_factor - w) + adam, adam)
        return update, moment1, root, v_new
    d = torch.where(h.weight_decay != 0, g + h.weight_decay * w, g)
    buf = m * h.beta1 + h.one_minus_dampening * d if has_buffer else d
    momentum = h.beta1 != 0
    moment1 = torch.where(momentum, buf, zero)
    d = torch.where(momentum, torch.where(h.nesterov, d + h.beta1 * buf, buf), d)
    return -h.lr * d, moment1, zero.expand_as(w), zero.expand_as(w)


def _applied_update_part(h: _UpdateParams, g, m_after, v_after):
    """``applied_update_part``: the part of the update just applied that does not depend on the weight."""
    if h.adam:
        root = torch.sqrt(v_after) / h.bias_correction2_sqrt
        return -h.step_size * (m_after / (root + h.eps))
    momentum = h.beta1 != 0
    g = torch.where(h.maximize, -g, g)
    other = -h.lr * torch.where(momentum, g + h.beta1 * m_after, g)
    return torch.where(momentum & ~h.nesterov, -h.lr * m_after, other)  # the buffer holds the decay


def _clipped_weight(h: _UpdateParams, w_after, a, c):
    """``clipped_weight``: w_before + c * u, from w_after = w_before * (1 + k) + a."""
    w_before = (w_after - a) / (1.0 + h.decay)
    return w_before + c * (a + h.decay * w_before)


def _state(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # an absent state (empty tensor) reads as zeros, as Adam's moments start
    return t.detach().reshape(-1).to(torch.float64) if t.numel() else torch.zeros_like(like)


def multi_tensor_update_stats(params, grads, moment1, moment2, moment2_max, hyper: torch.Tensor, rule: int):
    """The rows of ``gradfuse::multi_tensor_update_stats``: per parameter, the statistics of the
    update that the optimizer's step (``rule``: 0 SGD, 1 Adam / AdamW) is about to apply, from the
    weight, the gradient and the state before the step (an empty state tensor: absent).

    Returns:
        ``(floats, counts)``: float64 ``[n, NUM_UPDATE_FLOAT_STATS]`` and int64
        ``[n, NUM_UPDATE_COUNT_STATS]``, columns as ``UPDATE_FLOAT_COLUMNS`` / ``UPDATE_COUNT_COLUMNS``.
    """
    op = "multi_tensor_update_stats"
    rule = _check_rule(op, rule)
    check_update_inputs(op, params, grads, moment1, moment2, moment2_max, hyper)
    device = params[0].device if params else hyper.device
    if not params:
        return (torch.empty((0, NUM_UPDATE_FLOAT_STATS), dtype=torch.float64, device=device),
                torch.empty((0, NUM_UPDATE_COUNT_STATS), dtype=torch.int64, device=device))
    rows_f, rows_c = [], []
    for i, p in enumerate(params):
        h = _UpdateParams(hyper[i], rule)
        w = p.detach().reshape(-1).to(torch.float64)
        g = grads[i].detach().reshape(-1).to(torch.float64)
        u, m1, root, m2 = _update_element(h, w, g, _state(moment1[i], w), _state(moment2[i], w),
                                          _state(moment2_max[i], w), moment1[i].numel() > 0)
        eps_dominated = (root < h.eps).sum() if h.adam else torch.zeros((), dtype=torch.int64, device=device)
        rows_f.append(_stack_columns({"update_sumsq": (u * u).sum(), "weight_sumsq": (w * w).sum(),
                                      "moment1_sumsq": (m1 * m1).sum(), "moment2_sumsq": (root * root).sum()},
                                     UPDATE_FLOAT_NAMES, 0))
        rows_c.append(_stack_columns({"update_nonfinite": (~u.isfinite()).sum(),
                                      "weight_nonfinite": (~w.isfinite()).sum(),
                                      "moment_nonfinite": (~(m1 + m2).isfinite()).sum(),
                                      "eps_dominated": eps_dominated,
                                      "numel": torch.tensor(w.numel(), device=device)}, UPDATE_COUNT_NAMES, 0))
    return torch.stack(rows_f), torch.stack(rows_c).to(torch.int64)


def multi_tensor_update_clip_(params, grads, moment1, moment2, moment2_max, hyper: torch.Tensor,
                              coefs: torch.Tensor, rule: int) -> None:
    """``gradfuse::multi_tensor_update_clip_``: after ``optimizer.step()``, rescales the update
    just applied to ``params[i]`` by ``coefs[i]`` where it is below 1 (a coefficient >= 1 or NaN
    leaves the tensor as the step left it): ``w = w_before + c * u``, with ``w_before`` formed
    again from the weight, the gradient and the state the step left (``moment2_max`` with amsgrad,
    else ``moment2``), without a copy of the weights."""
    op = "multi_tensor_update_clip_"
    rule = _check_rule(op, rule)
    check_update_inputs(op, params, grads, moment1, moment2, moment2_max, hyper, coefs)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        h = _UpdateParams(hyper[i], rule)
        w = p.detach().reshape(-1).to(torch.float64)
        g = grads[i].detach().reshape(-1).to(torch.float64)
        v_after = _state(moment2[i], w)
        if h.adam and moment2_max[i].numel():
            v_after = torch.where(h.amsgrad, _state(moment2_max[i], w), v_after)
        c = coefs[i]
        a = _applied_update_part(h, g, _state(moment1[i], w), v_after)
        clipped = torch.where(c < 1, _clipped_weight(h, w, a, c), w)
        p.detach().copy_(clipped.reshape(p.shape))
