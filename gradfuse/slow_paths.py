"""The per-tensor PyTorch paths that the fused kernels do not serve: negative orders and -inf
(the kernels keep no minimum and take |x|^p with a sign-preserving abs), sparse (COO) and
complex gradients. Each is warned about once, naming the user's line; the rows they produce
have the layout of the fused op's (gradfuse.reference)."""
from __future__ import annotations

import os
import sys
import warnings

import torch

from gradfuse import api, ops, reference

_warned: set[str] = set()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn_slow_once(kind: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"gradfuse: {kind} take a slower per-tensor PyTorch path, not the fused "
                      "kernels (this warning is shown once)", stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The stacklevel, for a warning issued by the caller, of the first frame outside gradfuse
    and torch's no_grad wrapper: the warning then names the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE_DIR)
                                 or frame.f_code.co_filename.endswith("_contextlib.py")):
        frame, level = frame.f_back, level + 1
    return level


def group_stats(names, idx, tensors, p: float, what: str, slow_path: bool):
    """(floats, counts) of one (device, dtype) group: the compiled op, and the per-tensor path for
    what it does not take (negative orders, sparse and complex tensors)."""
    if not api._kernel_takes_order(p) or tensors[0].dtype.is_complex:
        api._check_tensors([names[i] for i in idx], tensors, what, slow_path)
        _warn_if_sparse_or_complex(tensors)
        return reference.tensor_rows(tensors, p)
    try:
        return ops.multi_tensor_stats(tensors, p)
    except RuntimeError:  # e.g. a sparse gradient: say which parameter, if it is that
        api._check_tensors([names[i] for i in idx], tensors, what, slow_path)
        dense = [i for i, t in enumerate(tensors) if t.layout == torch.strided]
        if len(dense) == len(tensors):
            raise
    # Sparse gradients among dense ones of the same dtype: rows of each kind, back in order.
    warn_slow_once("sparse gradients")
    sparse = [i for i, t in enumerate(tensors) if t.layout != torch.strided]
    f, c = reference.tensor_rows([tensors[i] for i in sparse], p)
    floats = f.new_empty((len(tensors), 4))
    counts = c.new_empty((len(tensors), 4))
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
