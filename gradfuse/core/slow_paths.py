"""The per-tensor PyTorch paths that the fused kernels do not serve: negative orders and -inf
(the kernels keep no minimum and take |x|^p with a sign-preserving abs), sparse (COO) and
complex gradients. Each is warned about once, naming the user's line; the rows they produce
have the layout of the fused op's (gradfuse.ops.layout)."""
from __future__ import annotations

import torch

from gradfuse import ops
from gradfuse.core.norms import kernel_takes_order
from gradfuse.core.params import check_tensors
from gradfuse.ops import reference
from gradfuse.utils import warn

_warned: set[str] = set()


def warn_slow_once(kind: str) -> None:
    """Warns, once per ``kind`` (e.g. ``"sparse gradients"``), that those take the per-tensor path."""
    if kind not in _warned:
        _warned.add(kind)
        warn(f"gradfuse: {kind} take a slower per-tensor PyTorch path, not the fused kernels "
             "(this warning is shown once)", UserWarning)


def group_stats(names, idx, tensors, p: float, what: str, slow_path: bool):
    """(floats, counts) of one (device, dtype) group: the compiled op, and the per-tensor path for
    what it does not take (negative orders, sparse and complex tensors)."""
    if not kernel_takes_order(p) or tensors[0].dtype.is_complex:
        check_tensors([names[i] for i in idx], tensors, what, slow_path)
        _warn_if_sparse_or_complex(tensors)
        return reference.tensor_rows(tensors, p)
    try:
        return ops.multi_tensor_stats(tensors, p)
    except RuntimeError:  # e.g. a sparse gradient: say which parameter, if it is that
        check_tensors([names[i] for i in idx], tensors, what, slow_path)
        dense = [i for i, t in enumerate(tensors) if t.layout == torch.strided]
        if len(dense) == len(tensors):
            raise
    # Sparse gradients among dense ones of the same dtype: rows of each kind, back in order.
    warn_slow_once("sparse gradients")
    sparse = [i for i, t in enumerate(tensors) if t.layout != torch.strided]
    f, c = reference.tensor_rows([tensors[i] for i in sparse], p)
    floats = f.new_empty((len(tensors), f.shape[1]))
    counts = c.new_empty((len(tensors), c.shape[1]))
    floats[sparse], counts[sparse] = f, c
    if dense:
        floats[dense], counts[dense] = (
            x.to(f.device) for x in ops.multi_tensor_stats([tensors[i] for i in dense], p))
    return floats, counts


def _warn_if_sparse_or_complex(tensors) -> None:
    if tensors[0].dtype.is_complex:
        warn_slow_once("complex gradients")
    if any(t.layout != torch.strided for t in tensors):
        warn_slow_once("sparse gradients")
