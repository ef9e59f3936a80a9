"""Pure-PyTorch implementation of gradfuse's two ops: the test oracle, and the fallback where
gradfuse._C has no kernel. Same inputs, outputs and semantics as the compiled ops (see
csrc/gradfuse.cpp), computed per tensor in float64; no host synchronisation.

``tensor_rows`` is the slow path for what the kernels do not take: sparse (COO) and complex
tensors, and negative norm orders (including -inf).
"""
from __future__ import annotations

import math

import torch

# Column layout shared with csrc/common/stats_math.h.
SUM, SUMSQ, MAXABS, POWSUM = range(4)
NAN, INF, ZERO, NUMEL = range(4)

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_one_group(tensors: list[torch.Tensor]) -> None:
    # As the compiled ops do: callers rely on the error to group mixed lists.
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
    if len(tensors) == 0:
        return torch.empty((0, 4), dtype=torch.float64), torch.empty((0, 4), dtype=torch.int64)
    _check_one_group(tensors)
    _check_kernel_inputs(tensors)
    return tensor_rows(tensors, norm_type)


def tensor_rows(tensors: list[torch.Tensor], norm_type: float):
    """The rows of ``multi_tensor_stats`` for tensors of one device, of any order and of what the
    kernels do not take:

    - norm_type < 0: POWSUM holds sum |x|^p (|x|, so -0.0 is 0.0); p = -inf: min |x| (+inf for
      an empty tensor, which then leaves the minimum over several tensors alone).
    - sparse COO: the statistics of the stored values after coalescing, numel and the zero count
      of the whole tensor; sum |x|^p and min |x| are over the stored values only, as
      torch.linalg.vector_norm computes them for a sparse tensor.
    - complex: norms of |z|, NaN/Inf counts of z; SUM (hence ``mean``) is NaN.
    """
    if len(tensors) == 0:
        return torch.empty((0, 4), dtype=torch.float64), torch.empty((0, 4), dtype=torch.int64)
    device = tensors[0].device
    p = float(norm_type)
    rows_f, rows_c = [], []
    for t in tensors:
        numel = t.numel()
        t = t.detach()
        if t.layout == torch.sparse_coo:
            t = t.coalesce().values()
        if t.is_complex():
            x = t.reshape(-1).to(torch.complex128)
            a = x.abs()
            total = torch.full((), math.nan, dtype=torch.float64, device=device)
            sumsq = torch.view_as_real(x).square().sum()
        else:
            x = t.reshape(-1).to(torch.float64)
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
        rows_f.append(torch.stack([total, sumsq, maxabs, powsum]))
        rows_c.append(torch.stack([x.isnan().sum(), x.isinf().sum(),
                                   (x == 0).sum() + (numel - x.numel()),
                                   torch.tensor(numel, device=device)]))
    return torch.stack(rows_f), torch.stack(rows_c).to(torch.int64)


def multi_tensor_scale_(tensors: list[torch.Tensor], coef: torch.Tensor,
                        conditional: bool = True) -> None:
    if len(tensors) == 0:
        return
    _check_one_group(tensors)
    _check_kernel_inputs(tensors)
    coef = coef.reshape(()).to(tensors[0].device)
    # min(coef, 1) is exact when no scaling is needed, and needs no host decision.
    torch._foreach_mul_(tensors, torch.clamp(coef, max=1.0) if conditional else coef)
