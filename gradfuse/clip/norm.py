"""Clipping by total norm: the drop-ins for ``torch.nn.utils.clip_grad_norm_``,
``get_total_norm`` and ``clip_grads_with_norm_``, and ``gradfuse.clip_``, which returns the
statistics too and leads to every other mode (per parameter or layer, by value).

Layer: clip (a capability). Imports ``gradfuse.core`` and ``gradfuse.clip.modes``.
"""
from __future__ import annotations

import types
import warnings

import torch

from gradfuse.clip.modes import clip_modes_
from gradfuse.core import distributed
from gradfuse.core.engine import fused_stats, raise_if_nonfinite, scale_
from gradfuse.core.entry import clip_parameters_, clip_source_
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.norms import clip_coefficient
from gradfuse.core.params import ParametersTypeError, Source, as_tensor_list, check_max_norm, check_norm_type, grads_of


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Drop-in for `torch.nn.utils.clip_grad_norm_`: same arguments, same in-place effect, same returned total norm.

    The norm is one fused pass per (device, dtype) group; the gradients are scaled by
    ``min(max_norm / (total_norm + 1e-6), 1)`` in a second pass that runs only when that
    coefficient is below 1 (decided on the device, without a host sync). Negative orders, -inf,
    sparse and complex gradients take a slower per-tensor path. ``foreach`` is accepted for
    compatibility; gradfuse always uses its fused kernels. From its second call on a list of
    parameters, the call is served by a cached plan in C++ (bitwise the same result).

    Args:
        parameters: A tensor, or an iterable of parameters (or of ``(name, parameter)`` pairs,
            whose names then appear in errors). Parameters whose ``.grad`` is None are left out.
        max_norm: The largest total norm the gradients keep; a non-negative number.
        norm_type: The order of the norm: any real number, ``inf``, ``-inf``, also as ``'inf'``
            or a tensor.
        error_if_nonfinite: Raise when the total norm is NaN or Inf (the error also names the
            parameters holding NaN/Inf) instead of scaling by it.
        foreach: Accepted and ignored.

    Returns:
        The total norm of the gradients (viewed as one vector), a 0-d tensor in the gradients'
            dtype on their device; a DTensor for DTensor gradients, placed as torch places it.

    Raises:
        RuntimeError: ``error_if_nonfinite=True`` and the total norm is NaN or Inf.
        ValueError: ``max_norm`` is negative or NaN, or ``norm_type`` is NaN or not a number.
        gradfuse.core.params.ParametersTypeError: ``parameters`` holds something that is not a
            tensor (None, a number, a module); also an ``AttributeError``, as torch raises.
        gradfuse.core.params.GradientTypeError: a gradient is of an integer or bool dtype; also a
            ``RuntimeError``, as torch raises.

    Example:
        ```python
        loss.backward()
        total = gradfuse.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        ```
    """
    del foreach
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = as_tensor_list(parameters, "clip_grad_norm_")
        if is_generator and len(parameters) == 0:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                          stacklevel=3)
    s = clip_parameters_(parameters, max_norm, norm_type, error_if_nonfinite)
    return s.total_norm


@torch.no_grad()
def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None) -> torch.Tensor:
    """Drop-in for `torch.nn.utils.get_total_norm`: the norm of ``tensors`` viewed as one vector.

    With [`clip_grads_with_norm_`][gradfuse.clip_grads_with_norm_] it splits
    ``clip_grad_norm_`` in two (see the example).

    Args:
        tensors: A tensor or an iterable of tensors, e.g. gradients.
        norm_type: The order of the norm, as for ``clip_grad_norm_``.
        error_if_nonfinite: Raise when the norm is NaN or Inf.
        foreach: Accepted and ignored.

    Returns:
        The total norm, a 0-d tensor in the tensors' dtype (a DTensor for DTensors).

    Raises:
        RuntimeError: ``error_if_nonfinite=True`` and the norm is NaN or Inf.
        ValueError: ``norm_type`` is NaN or not a number.
        gradfuse.core.params.ParametersTypeError: an item of ``tensors`` is not a tensor.
        gradfuse.core.params.GradientTypeError: a tensor of an integer or bool dtype.

    Example:
        ```python
        total = gradfuse.get_total_norm([p.grad for p in model.parameters()])
        gradfuse.clip_grads_with_norm_(model.parameters(), max_norm=1.0, total_norm=total)
        ```
    """
    del foreach
    tensors = as_tensor_list(tensors, "get_total_norm")
    names = [f"[{i}]" for i in range(len(tensors))]
    try:
        s = fused_stats(names, tensors, check_norm_type(norm_type), slow_path=True, rows=False)
    except (AttributeError, TypeError, RuntimeError):
        bad = next((i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)), None)
        if bad is None:
            raise
        raise ParametersTypeError(f"gradfuse.get_total_norm: tensors[{bad}] is "
                                  f"{type(tensors[bad]).__name__}, not a tensor") from None
    if tensors and error_if_nonfinite:
        raise_if_nonfinite(s)
    return s.total_norm


@torch.no_grad()
def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor,
                          foreach: bool | None = None) -> None:
    """Drop-in for `torch.nn.utils.clip_grads_with_norm_`: scales the gradients by a given total norm.

    The gradients of ``parameters`` are scaled in place by
    ``min(max_norm / (total_norm + 1e-6), 1)``, and touched only when that is below 1 (decided on
    the device).

    Args:
        parameters: A tensor or an iterable of parameters; those without ``.grad`` are left out.
        max_norm: The largest total norm; a non-negative number.
        total_norm: The total norm, e.g. from [`get_total_norm`][gradfuse.get_total_norm]; may be
            a DTensor.
        foreach: Accepted and ignored.

    Returns:
        None; the gradients are scaled in place.

    Raises:
        ValueError: ``max_norm`` is negative or NaN.
        gradfuse.core.params.ParametersTypeError: ``parameters`` holds something that is not a
            tensor.

    Example:
        ```python
        total = gradfuse.get_total_norm([p.grad for p in model.parameters()])
        gradfuse.clip_grads_with_norm_(model.parameters(), max_norm=1.0, total_norm=total)
        ```
    """
    del foreach
    parameters = as_tensor_list(parameters, "clip_grads_with_norm_")
    _names, _params, grads = grads_of(parameters, "clip_grads_with_norm_")
    max_norm = check_max_norm(max_norm)
    if not grads:
        return
    total_norm = total_norm if distributed.is_plain(total_norm) else distributed.full_value(total_norm)
    scale_(grads, clip_coefficient(total_norm, max_norm))


@torch.no_grad()
def clip_(source: Source, max_norm: float | None, norm_type: float = 2.0,
          error_if_nonfinite: bool = False, *, group=None, per: str | None = None,
          value: float | None = None, layer_depth: int | None = None) -> GradStats:
    """Clip the gradients of ``source`` in place and return their statistics from before clipping.

    By default by total norm, like ``clip_grad_norm_``: one fused stats pass, plus a scale pass
    only on steps that need clipping (decided on the device). The result carries ``clip_coef``
    and ``clipped``.

    ``per="param"`` / ``per="layer"``: each parameter / layer (as
    [`GradStats.layers`][gradfuse.GradStats.layers] groups them, or by ``layer_depth``) clipped by
    its own norm, from the same single stats pass; ``clip_coef`` is then one entry per row.
    ``value=v`` (with ``max_norm=None``): clamps to ``[-v, v]`` as ``clip_grad_value_``,
    statistics from before clamping and ``clamped``, the number of elements changed per row. See
    [`gradfuse.clip`](gradfuse.clip.md).

    Args:
        source: An ``nn.Module``, a tensor, an iterable of parameters or of ``(name, parameter)``
            pairs; parameters whose ``.grad`` is None are left out.
        max_norm: The largest norm (of the whole set, of each layer or of each parameter); None
            only with ``value=``.
        norm_type: The order of the norm.
        error_if_nonfinite: Raise when the total norm is NaN or Inf, naming the parameters.
        group: A process group whose ranks hold different parameters (pipeline stages): the total
            norm and ``nonfinite`` cover the group; the rows are this rank's parameters.
        per: ``"param"`` or ``"layer"`` to clip each parameter or layer by its own norm.
        value: Clamp every element to ``[-value, value]`` instead (with ``max_norm=None``).
        layer_depth: With ``per="layer"``, a layer is the first ``layer_depth`` name parts.

    Returns:
        GradStats: The statistics from before clipping, with ``clip_coef`` and ``clipped`` (and
            ``clamped``, ``clip_value`` after ``value=``; ``clip_per`` after ``per=``).

    Raises:
        RuntimeError: ``error_if_nonfinite=True`` and the total norm is NaN or Inf.
        ValueError: ``max_norm`` is negative or NaN (or None without ``value=``), ``norm_type`` is
            NaN, or ``value=`` is combined with ``max_norm``, ``per=`` or ``group=``.
        gradfuse.core.params.GradientTypeError: a gradient is of an integer or bool dtype, or
            sparse or complex (statistics are of dense real tensors).

    Example:
        ```python
        loss.backward()
        s = gradfuse.clip_(model, max_norm=1.0)
        if step % 100 == 0:
            print(s.table(top=10))   # the only host transfer
        optimizer.step()
        ```
    """
    if per is not None or value is not None:
        return clip_modes_(source, max_norm, norm_type, error_if_nonfinite, group=group,
                                    per=per, value=value, layer_depth=layer_depth)
    return clip_source_(source, check_max_norm(max_norm), check_norm_type(norm_type),
                        error_if_nonfinite, group)

