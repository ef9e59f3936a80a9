"""Pure-PyTorch implementation of gradfuse's two ops: the test oracle, and the fallback where
gradfuse._C has no kernel. Same inputs, outputs and semantics as the compiled ops (see
csrc/gradfuse.cpp), computed per tensor in float64; no host synchronisation.
"""
from __future__ import annotations

import math

import torch

# Column layout shared with csrc/common/stats_math.h.
SUM, SUMSQ, MAXABS, POWSUM = range(4)
NAN, INF, ZERO, NUMEL = range(4)


def _check_one_group(tensors: list[torch.Tensor]) -> None:
    # As the compiled ops do: callers rely on the error to group mixed lists.
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype or t.device != first.device:
            raise RuntimeError(f"gradfuse reference: tensors[{i}] is {t.dtype} on {t.device} but "
                               f"tensors[0] is {first.dtype} on {first.device}")


def multi_tensor_stats(tensors: list[torch.Tensor], norm_type: float):
    if len(tensors) == 0:
        return torch.empty((0, 4), dtype=torch.float64), torch.empty((0, 4), dtype=torch.int64)
    _check_one_group(tensors)
    device = tensors[0].device
    p = float(norm_type)
    rows_f, rows_c = [], []
    for t in tensors:
        x = t.detach().reshape(-1).to(torch.float64)
        a = x.abs()
        if p in (0.0, 2.0) or math.isinf(p):
            powsum = x.new_zeros(())
        elif p == 1.0:
            powsum = a.sum()
        else:
            powsum = a.pow(p).sum()
        maxabs = a.amax() if x.numel() else x.new_zeros(())
        rows_f.append(torch.stack([x.sum(), (x * x).sum(), maxabs, powsum]))
        rows_c.append(torch.stack([x.isnan().sum(), x.isinf().sum(), (x == 0).sum(),
                                   torch.tensor(x.numel(), device=device)]))
    return torch.stack(rows_f), torch.stack(rows_c).to(torch.int64)


def multi_tensor_scale_(tensors: list[torch.Tensor], coef: torch.Tensor,
                        conditional: bool = True) -> None:
    if len(tensors) == 0:
        return
    _check_one_group(tensors)
    coef = coef.reshape(()).to(tensors[0].device)
    # min(coef, 1) is exact when no scaling is needed, and needs no host decision.
    torch._foreach_mul_(tensors, torch.clamp(coef, max=1.0) if conditional else coef)
