"""The two fused ops, routed to gradfuse._C or to the pure-PyTorch reference per device."""
from __future__ import annotations

import torch

from gradfuse import _ext, reference


def multi_tensor_stats(tensors: list[torch.Tensor], norm_type: float = 2.0):
    """Per-tensor statistics of one (device, dtype) group in one pass.

    Returns ``(floats, counts)``: float64 ``[n, 4]`` (sum, sum of squares, max |x|, sum |x|^p
    when p is not 0, 2 or inf) and int64 ``[n, 4]`` (NaN, Inf and zero counts, numel), on the
    tensors' device.
    """
    if not tensors or not _ext.use_compiled(tensors[0].device):
        return reference.multi_tensor_stats(tensors, norm_type)
    return torch.ops.gradfuse.multi_tensor_stats(tensors, float(norm_type))


def multi_tensor_scale_(tensors: list[torch.Tensor], coef: torch.Tensor,
                        conditional: bool = True) -> None:
    """Multiplies every tensor of one (device, dtype) group in place by ``coef`` (a one-element
    tensor on their device). ``conditional``: only when ``coef < 1`` or NaN, reading and writing
    nothing otherwise; else always."""
    if not tensors or not _ext.use_compiled(tensors[0].device):
        return reference.multi_tensor_scale_(tensors, coef, conditional)
    torch.ops.gradfuse.multi_tensor_scale_(tensors, coef, conditional)


# ---- Clipping beyond one global norm (issue 17). All for ONE (device, dtype) group of dense
# float tensors; nothing waits for the host.

# Looked up once (a plain dict keeps the calls traceable): a gradfuse._C built before these ops
# existed serves the two ops above and leaves these to the reference.
def _registered(name: str, key: str) -> bool:
    return (_ext._C is not None and hasattr(torch.ops.gradfuse, name)
            and torch._C._dispatch_has_kernel_for_dispatch_key(f"gradfuse::{name}", key))


_CLIP_OPS = {(name, device_type): _registered(name, key)
             for name in ("multi_tensor_unit_stats", "multi_tensor_unit_scale_", "multi_tensor_clamp_")
             for device_type, key in (("cpu", "CPU"), ("cuda", "CUDA"))}


def _compiled(name: str, device: torch.device) -> bool:
    if device.type == "meta":
        return True
    return _CLIP_OPS.get((name, device.type), False) and _ext.use_compiled(device)


def multi_tensor_unit_stats(tensors: list[torch.Tensor], units: list[int], norm_type: float = 2.0):
    """Statistics per *unit*: tensor i, in its logical (row-major) order, cut into ``units[i]``
    equal consecutive blocks (``units[i] = w.size(0)``: one row per output unit, the norm over
    dims 1.. as timm's AGC takes it; ``1``: the whole tensor; ``0`` only for an empty tensor).

    Returns ``(floats, counts)``: float64 and int64 ``[sum(units), 4]``, the rows of every unit
    of every tensor in order, columns as :func:`multi_tensor_stats`. A tensor that is not
    contiguous (with units > 1) is copied to a contiguous one first.
    """
    if not tensors or not _compiled("multi_tensor_unit_stats", tensors[0].device):
        return reference.multi_tensor_unit_stats(tensors, units, norm_type)
    return torch.ops.gradfuse.multi_tensor_unit_stats(tensors, [int(u) for u in units], float(norm_type))


def multi_tensor_unit_scale_(tensors: list[torch.Tensor], units: list[int], coefs: torch.Tensor,
                             conditional: bool = True) -> None:
    """Multiplies unit j of tensor i (units as :func:`multi_tensor_unit_stats`) in place by its
    coefficient: ``coefs`` is 1-D with ``sum(units)`` entries on the tensors' device (any float
    dtype; the kernels compute in float32, float64 for float64 data). ``conditional``: a unit
    whose coefficient is >= 1 is not touched at all (decided on the device); NaN scales."""
    if not tensors or not _compiled("multi_tensor_unit_scale_", tensors[0].device):
        return reference.multi_tensor_unit_scale_(tensors, units, coefs, conditional)
    torch.ops.gradfuse.multi_tensor_unit_scale_(tensors, [int(u) for u in units], coefs, conditional)


def multi_tensor_scale_per_tensor_(tensors: list[torch.Tensor], coefs: torch.Tensor,
                                   conditional: bool = True) -> None:
    """Multiplies tensor i in place by ``coefs[i]`` (1-D, ``len(tensors)`` entries, on their
    device). ``conditional``: a tensor whose coefficient is >= 1 is not read nor written (decided
    on the device); a NaN coefficient scales, as the scalar op does."""
    if tensors and _compiled("multi_tensor_unit_scale_", tensors[0].device):
        # units of 1 are ints already: no per-tensor int() (10 000 parameters: ~0.5 ms)
        torch.ops.gradfuse.multi_tensor_unit_scale_(tensors, [1] * len(tensors), coefs, conditional)
        return
    multi_tensor_unit_scale_(tensors, [1] * len(tensors), coefs, conditional)


def multi_tensor_clamp_(tensors: list[torch.Tensor], clip_value: float):
    """Clamps every element to ``[-clip_value, clip_value]`` in place in one pass, exactly as
    ``torch.nn.utils.clip_grad_value_`` (NaN stays NaN, -0.0 stays), and returns
    ``(floats, counts, clamped)``: the :func:`multi_tensor_stats` rows (norm_type 2) of the values
    *before* clamping, and int64 ``[n]`` with the number of elements clamping changed per tensor
    (|x| > clip_value as rounded to the dtype; NaN not counted). ``clip_value`` must be >= 0."""
    reference.check_clip_value(clip_value, "gradfuse.multi_tensor_clamp_")
    if not tensors or not _compiled("multi_tensor_clamp_", tensors[0].device):
        return reference.multi_tensor_clamp_(tensors, clip_value)
    return torch.ops.gradfuse.multi_tensor_clamp_(tensors, float(clip_value))
