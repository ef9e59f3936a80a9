"""The calls behind the public entry points: statistics, and clipping by total norm, of a source
of parameters. A list seen before, and the parameters of a module whose walk gives the names of
the planned call, are served in C++ by ``gradfuse.core.walk_cache``; anything else, and any list the walk
refuses, takes the functional path of ``gradfuse.core.engine``, which then plans the list for
the walk.

Layer: core, at its top. Imports the core modules below it.
"""
from __future__ import annotations

from torch import nn

from gradfuse.core import walk_cache
from gradfuse.core.engine import clip_total_norm_, fused_stats, raise_if_nonfinite, scale_to_max_norm
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.params import (
    ParametersTypeError,
    Source,
    check_max_norm,
    check_norm_type,
    named_grads,
    named_params,
    with_grads,
)


def source_stats(source: Source, p: float) -> GradStats:
    """Statistics of the gradients of ``source`` (``p`` checked), without ``group=`` or
    histograms (those take ``gradfuse.core.engine.fused_stats`` directly)."""
    s = walk_cache.stats(source, p)
    if s is not None:
        return s
    all_names, params = named_params(source)
    module = isinstance(source, nn.Module)
    if module:
        s = walk_cache.stats(params, p, all_names)
        if s is not None:
            return s
    names, _params, grads = with_grads(all_names, params)
    s = fused_stats(names, grads, p)
    _plan(source, module, p, all_names, params, grads, s)
    return s


def _plan(source, module: bool, p: float, all_names: list, params: list, grads: list, s: GradStats) -> None:
    """A plan for the next calls on ``source`` (for a module: on its parameters, by their names)."""
    if module:
        walk_cache.planned(params, p, all_names, params, grads, s, module=True)
    else:
        walk_cache.planned(source, p, all_names, params, grads, s)


def clip_source_(source: Source, max_norm: float, p: float, error_if_nonfinite: bool,
                 group=None) -> GradStats:
    """Clips the gradients of ``source`` in place by total norm (arguments checked); returns
    their statistics from before clipping with ``clip_coef``."""
    if group is None:
        s = _walk_clip(source, max_norm, p, error_if_nonfinite)
        if s is not None:
            return s
    all_names, params = named_params(source)
    module = group is None and isinstance(source, nn.Module)
    if module:
        s = _walk_clip(params, max_norm, p, error_if_nonfinite, all_names)
        if s is not None:
            return s
    names, _params, grads = with_grads(all_names, params)
    s = clip_total_norm_(names, grads, max_norm, p, error_if_nonfinite, group)
    if group is None:
        _plan(source, module, p, all_names, params, grads, s)
    return s


def clip_parameters_(parameters: list, max_norm, norm_type, error_if_nonfinite: bool) -> GradStats:
    """``clip_grad_norm_`` on a list of parameters: the total norm only (no per-parameter rows
    are reduced), sparse and complex gradients taken, errors in torch's order."""
    try:  # a list served in C++ (walk_cache)
        s = _walk_clip(parameters, check_max_norm(max_norm), check_norm_type(norm_type),
                       error_if_nonfinite)
    except (TypeError, ValueError):
        s = None
    if s is not None:
        return s
    try:
        all_names, params = named_params(parameters)
        names, _params, grads = with_grads(all_names, params)
    except TypeError as e:  # an item that is not a tensor: torch fails reading its .grad
        raise ParametersTypeError(f"gradfuse.clip_grad_norm_: {e}") from None
    max_norm, p = check_max_norm(max_norm), check_norm_type(norm_type)
    s = clip_total_norm_(names, grads, max_norm, p, error_if_nonfinite, slow_path=True, rows=False)
    walk_cache.planned(parameters, p, all_names, params, grads, s)
    return s


def _walk_clip(source, max_norm: float, p: float, error_if_nonfinite: bool,
               names: list | None = None) -> GradStats | None:
    """Clipping by total norm on a list served in C++ (walk_cache), or None with nothing touched.
    ``names``: ``source`` is a module's parameters, walked with these names."""
    if not error_if_nonfinite:
        return walk_cache.clip(source, p, max_norm, names)
    s = walk_cache.stats(source, p, names)
    if s is None:
        return None
    if len(s):
        raise_if_nonfinite(s)
    clipped = walk_cache.clip_to(source, s, max_norm, names)
    if clipped is None:  # not expected (nothing changed since the stats): scale in Python
        _names, _params, grads = named_grads(source)
        clipped = scale_to_max_norm(s, grads, max_norm)
    return clipped
