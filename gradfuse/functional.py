"""The statistics entry points, ``gradfuse.stats`` (of gradients) and ``gradfuse.tensor_stats``
(of any tensors), with the exponent histograms and headroom of :mod:`gradfuse.numerics` on
request.

Layer: beside the capabilities. Imports :mod:`gradfuse.core` and :mod:`gradfuse.numerics`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from gradfuse.core.engine import fused_stats
from gradfuse.core.entry import source_stats
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.params import Source, check_norm_type, named_grads
from gradfuse.numerics import histogram as histogram_module


def stats(source: Source, *, norm_type: float = 2.0, group=None, histogram: bool = False) -> GradStats:
    """Statistics of the gradients of ``source``, in one fused pass per (device, dtype).

    ``source`` is an ``nn.Module``, a tensor, an iterable of parameters, or an iterable of
    ``(name, parameter)`` pairs; parameters whose ``.grad`` is None are left out.

    Example::

        loss.backward()
        s = gradfuse.stats(model)
        if s.nonfinite:          # a 0-d tensor: this line syncs, the stats did not
            print(s.nonfinite_names())

    DTensor gradients (FSDP2, tensor parallel) give the statistics of the full gradients. With
    ``group`` (a process group of ranks holding different parameters, e.g. pipeline stages) the
    total norm and ``nonfinite`` cover the group, and the rows this rank's parameters.

    ``histogram=True`` adds a second fused pass: ``exponent_histogram`` (int64 [n, 283] on the
    device, see :mod:`gradfuse.numerics.histogram`) and ``headroom`` (see
    :mod:`gradfuse.numerics.headroom`).
    """
    p = check_norm_type(norm_type)
    if group is None and not histogram:
        return source_stats(source, p)
    names, _params, grads = named_grads(source)
    s = fused_stats(names, grads, p, group)
    return histogram_module.attach(s, names, grads) if histogram else s


def tensor_stats(tensors: torch.Tensor | Iterable[torch.Tensor] | dict[str, torch.Tensor], *,
                 norm_type: float = 2.0, histogram: bool = False) -> GradStats:
    """The same statistics for arbitrary tensors (activations, weights, ...).

    ``tensors`` is a tensor, an iterable of tensors (named ``[i]``) or a dict name -> tensor.
    The total norm is that of all elements viewed as one vector: for ``norm_type=0`` the number
    of non-zero elements (gradient statistics count gradients with one, as torch.nn.utils).
    ``histogram=True``: also the exponent histogram and headroom columns, as :func:`stats`.
    """
    p = check_norm_type(norm_type)
    if isinstance(tensors, torch.Tensor):
        items = [("[0]", tensors)]
    elif isinstance(tensors, dict):
        items = list(tensors.items())
    else:
        items = [(f"[{i}]", t) for i, t in enumerate(tensors)]
    names, detached = [n for n, _ in items], [t.detach() for _, t in items]
    s = fused_stats(names, detached, p, what="tensor", elementwise_zero_norm=True)
    return histogram_module.attach(s, names, detached) if histogram else s

