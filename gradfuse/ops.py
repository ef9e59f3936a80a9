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
