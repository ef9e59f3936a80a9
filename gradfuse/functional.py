"""The statistics entry points, ``gradfuse.stats`` (of gradients) and ``gradfuse.tensor_stats``
(of any tensors), with the exponent histograms and headroom of ``gradfuse.numerics`` on
request.

Layer: beside the capabilities. Imports ``gradfuse.core`` and ``gradfuse.numerics``.
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

    DTensor gradients (FSDP2, tensor parallel) give the statistics of the full gradients.
    Nothing is read back to the host: the result's tensors stay on the device until you read them.

    Args:
        source: An ``nn.Module``, a tensor, an iterable of parameters, or an iterable of
            ``(name, parameter)`` pairs; parameters whose ``.grad`` is None are left out.
        norm_type: The order of the total norm (and of [`GradStats.norm`][gradfuse.GradStats.norm]).
        group: A process group of ranks holding different parameters (e.g. pipeline stages): the
            total norm and ``nonfinite`` then cover the group, and the rows this rank's parameters
            (``scope == "rank"``).
        histogram: Add a second fused pass: ``exponent_histogram`` (int64 ``[n, 283]`` on the
            device, see [`gradfuse.histogram`](gradfuse.histogram.md)) and ``headroom`` (see
            [`gradfuse.headroom`](gradfuse.headroom.md)).

    Returns:
        GradStats: Per-parameter rows (following ``names``) and totals, on the device.

    Raises:
        ValueError: ``norm_type`` is NaN or not a number.
        gradfuse.core.params.GradientTypeError: a gradient is of an integer or bool dtype, or
            sparse or complex.

    Example:
        ```python
        loss.backward()
        s = gradfuse.stats(model)
        if s.nonfinite:          # a 0-d tensor: this line syncs, the stats did not
            print(s.nonfinite_names())
        ```
    """
    p = check_norm_type(norm_type)
    if group is None and not histogram:
        return source_stats(source, p)
    names, _params, grads = named_grads(source)
    s = fused_stats(names, grads, p, group)
    return histogram_module.attach(s, names, grads) if histogram else s


def tensor_stats(tensors: torch.Tensor | Iterable[torch.Tensor] | dict[str, torch.Tensor], *,
                 norm_type: float = 2.0, histogram: bool = False) -> GradStats:
    """The same statistics as [`stats`][gradfuse.stats] for arbitrary tensors (activations, weights, ...).

    The total norm is that of all elements viewed as one vector: for ``norm_type=0`` the number
    of non-zero elements (gradient statistics count gradients with one, as torch.nn.utils).

    Args:
        tensors: A tensor, an iterable of tensors (named ``[i]``) or a dict name -> tensor.
        norm_type: The order of the total norm.
        histogram: Also the exponent histogram and headroom columns, as [`stats`][gradfuse.stats].

    Returns:
        GradStats: One row per tensor, named as above, and the totals.

    Raises:
        ValueError: ``norm_type`` is NaN or not a number.
        gradfuse.core.params.GradientTypeError: a tensor of an integer or bool dtype, sparse or
            complex.

    Example:
        ```python
        acts = {"hidden": torch.randn(8, 32), "out": torch.randn(8, 4)}
        s = gradfuse.tensor_stats(acts)
        print(s.names)           # ['hidden', 'out']
        ```
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

