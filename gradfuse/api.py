"""The public entry points: stats, tensor_stats, clip_grad_norm_, get_total_norm,
clip_grads_with_norm_, clip_."""
from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from gradfuse import distributed, ops, sharded, slow_paths, walk_cache
from gradfuse import histogram as histogram_module
from gradfuse.grad_stats import GradStats
from gradfuse.reference import INF, MAXABS, NAN, NUMEL, POWSUM, SUMSQ, ZERO

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

Source = nn.Module | torch.Tensor | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _named_grads(source: Source) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """(names, parameters, gradients) of the parameters in ``source`` that have a gradient."""
    return _with_grads(*_named_params(source))


def _with_grads(names: list[str], params: list[torch.Tensor]):
    """(names, parameters, gradients) of those ``params`` that have a gradient. Called every
    training step with up to 10 000s of parameters: a few list comprehensions, no per-parameter
    tuples (allocating them wakes the garbage collector, which then walks every tensor)."""
    grads = [p.grad for p in params]  # .grad is a slow property: read it once
    if any(g is None for g in grads):
        keep = [i for i, g in enumerate(grads) if g is not None]
        names, params, grads = ([x[i] for i in keep] for x in (names, params, grads))
    return names, params, grads  # checked in _fused_stats, without another per-tensor pass


def _named_params(source: Source) -> tuple[list[str], list[torch.Tensor]]:
    """(names, parameters) of every parameter of ``source``, with or without a gradient: the
    module's names, or ``[i]`` for the i-th item of an iterable that does not name it."""
    if isinstance(source, torch.Tensor):
        return ["[0]"], [source]
    if isinstance(source, nn.Module):
        return _module_parameters(source)
    items = list(source)
    if all(isinstance(item, torch.Tensor) for item in items):  # clip_grad_norm_'s usual input
        return [f"[{i}]" for i in range(len(items))], items
    if not all(isinstance(item, tuple) for item in items):
        items = [_as_named(i, item) for i, item in enumerate(items)]
    return [n for n, _ in items], [p for _, p in items]


def _as_named(i: int, item) -> tuple[str, torch.Tensor]:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        return item
    if isinstance(item, torch.Tensor):
        return (f"[{i}]", item)
    raise TypeError(f"gradfuse: expected parameters or (name, parameter) pairs, "
                    f"item {i} is {type(item).__name__}")


def _module_parameters(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """``module.named_parameters()`` as two lists, walked at half its cost: that generator
    hashes every parameter with the Python-level ``Tensor.__hash__`` and yields one tuple per
    parameter. Same modules (from ``named_modules()``), order, names and de-duplication; a
    module class that overrides ``named_parameters`` gets its own, and so does torch.compile
    (which traces named_parameters as it is)."""
    if (type(module).named_parameters is not nn.Module.named_parameters
            or type(module)._named_members is not nn.Module._named_members
            or torch.compiler.is_compiling()):
        named = list(module.named_parameters())
        return [n for n, _ in named], [p for _, p in named]
    names, params, seen = [], [], set()
    for prefix, mod in module.named_modules():
        dot = prefix + "." if prefix else ""
        for key, p in mod._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            names.append(dot + key)
            params.append(p)
    return names, params


class GradientTypeError(TypeError, RuntimeError):
    """A gradient (or tensor) of a dtype or layout that gradfuse does not take, e.g. an integer
    one. Also a RuntimeError, which torch.nn.utils.clip_grad_norm_ raises for these."""


class ParametersTypeError(TypeError, AttributeError):
    """``parameters`` holds something that is not a tensor (None, a number, a module). Also an
    AttributeError, which torch.nn.utils.clip_grad_norm_ raises for these (``.grad``)."""


def _check_tensors(names: list[str], tensors: list[torch.Tensor], what: str,
                   slow_path: bool = False) -> None:
    for name, t in zip(names, tensors):
        _check_tensor(name, t, what, slow_path)


def _check_tensor(name: str, t: torch.Tensor, what: str, slow_path: bool = False) -> None:
    """Raises GradientTypeError naming ``name`` if no path takes ``t``. ``slow_path``: sparse
    (COO) and complex tensors are taken (the drop-ins for torch.nn.utils take them)."""
    takers = "gradfuse.clip_grad_norm_ and get_total_norm take them too"
    if t.layout != torch.strided and not (slow_path and t.layout == torch.sparse_coo):
        hint = f" ({takers})" if t.layout == torch.sparse_coo else ""
        raise GradientTypeError(f"gradfuse: the {what} of {name!r} is {t.layout}; statistics "
                                f"take dense tensors{hint}")
    if t.dtype in SUPPORTED_DTYPES or (slow_path and t.dtype.is_complex):
        return
    kind = "complex" if t.dtype.is_complex else "not floating point"
    hint = f" ({takers})" if t.dtype.is_complex else ""
    raise GradientTypeError(f"gradfuse: the {what} of {name!r} has dtype {t.dtype} ({kind}); "
                            f"supported: float16, bfloat16, float32, float64{hint}")


def _check_norm_type(norm_type) -> float:
    p = float(norm_type)
    if math.isnan(p):
        # torch returns NaN and scales every gradient to NaN: refuse instead
        raise ValueError(f"gradfuse: norm_type must be a number or +-inf, got {norm_type!r}")
    return p


def _kernel_takes_order(p: float) -> bool:
    # The kernels compute |x|^p with a sign-preserving abs (pow(-0.0, p) < 0 for odd p < 0) and
    # keep no minimum: negative orders and -inf take the per-tensor path.
    return p >= 0


def _groups(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` per (device, dtype), grouped in C++ (no per-tensor Python)."""
    if not tensors:
        return {}
    grouped = _group_tensors_by_device_and_dtype([tensors], with_indices=True)
    return {key: idx for key, (_, idx) in grouped.items()}


def _fused_stats(names: list[str], tensors: list[torch.Tensor], norm_type: float,
                 group=None, what: str = "gradient", *, slow_path: bool = False,
                 elementwise_zero_norm: bool = False, rows: bool = True) -> GradStats:
    """One fused pass per (sharding layout, device, dtype) group; rows of the result follow the
    returned names (grouped: the order of ``tensors`` when there is one group). DTensor rows are
    reduced over their sharded mesh dimensions; with ``group`` the total norm and the non-finite
    flag are reduced over that process group (see gradfuse.distributed). ``slow_path``: also
    take sparse and complex tensors (per tensor, in PyTorch). ``elementwise_zero_norm``: the
    total 0-norm counts non-zero elements, not tensors with one (see _norm_accumulator).
    ``rows=False``, when only the total is needed: DTensor gradients then cost one functional
    scalar all-reduce per sharded mesh dimension, as in torch, and their rows are reduced only
    when read (gradfuse.sharded)."""
    locals_, layouts = tensors, [None] * len(tensors)
    dtensor_spec = None
    if distributed.may_have_dtensors(tensors):
        locals_, layouts, dtensor_spec = sharded.split_dtensors(names, tensors, norm_type)
    if not tensors and group is None:
        return GradStats([], torch.empty((0, 4), dtype=torch.float64),
                         torch.empty((0, 4), dtype=torch.int64), norm_type, torch.tensor(0.0))
    device = locals_[0].device if tensors else torch.device("cpu")
    whole_result = None
    if locals_ and not any(layouts) and _kernel_takes_order(norm_type):
        # The common case is one (device, dtype) group: hand the whole list to the op, which
        # checks that in C++; grouping first costs another pass over every tensor.
        try:
            whole_result = ops.multi_tensor_stats(locals_, norm_type)
            groups = {(0, device, locals_[0].dtype): range(len(locals_))}
        except RuntimeError:  # mixed dtypes or devices, or a bad tensor: group, name it
            pass
    if whole_result is None:
        groups = _layout_groups(names, locals_, layouts, what, slow_path)
    out_names, floats, counts, segments = [], [], [], []
    row = 0
    for key in sorted(groups, key=lambda k: k[0]):  # stable: first-seen order within a layout
        idx = groups[key]
        whole = len(idx) == len(locals_)
        group_tensors = locals_ if whole else [locals_[i] for i in idx]
        f, c = whole_result or slow_paths.group_stats(names, idx, group_tensors, norm_type, what, slow_path)
        out_names += names if whole else [names[i] for i in idx]
        floats.append(f.to(device))
        counts.append(c.to(device))
        segments.append((layouts[idx[0]], row, row + len(idx)))
        row += len(idx)
    if floats:
        floats = floats[0] if len(floats) == 1 else torch.cat(floats)
        counts = counts[0] if len(counts) == 1 else torch.cat(counts)
    else:  # a rank with no gradients still joins the group's collective
        floats = torch.zeros((0, 4), dtype=torch.float64, device=device)
        counts = torch.zeros((0, 4), dtype=torch.int64, device=device)
    pending_rows = None
    if any(layout is not None for layout, _, _ in segments):
        if rows or group is not None or not sharded.total_only_takes(norm_type):
            floats, counts = sharded.reduce_rows(floats, counts, segments, norm_type)
        else:
            pending_rows = sharded.PendingRows(floats, counts, segments, norm_type)
    if pending_rows is None:
        acc = _norm_accumulator(floats, counts, norm_type, elementwise_zero_norm)
    else:
        acc = sharded.reduce_total(floats, counts, segments, norm_type)
    group_nonfinite = None
    if group is not None:
        nonfinite_count = (counts[:, NAN] + counts[:, INF]).sum()
        acc, group_nonfinite = distributed.reduce_over_group(acc, nonfinite_count, norm_type, group)
    total = _root(acc, norm_type)
    # The dtype clip_grad_norm_ returns: that of its stacked per-tensor norms (real for complex).
    out_dtype = _norm_dtype(tensors[0].dtype) if tensors else torch.float32
    for _order, _device, dtype in groups:
        out_dtype = torch.promote_types(out_dtype, _norm_dtype(dtype))
    return GradStats(out_names, floats, counts, norm_type, total.to(out_dtype),
                     group_nonfinite=group_nonfinite, dtensor_spec=dtensor_spec,
                     pending_rows=pending_rows)


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def _layout_groups(names, tensors, layouts, what, slow_path=False) -> dict[tuple, list[int]]:
    """Indices per (layout order, device, dtype) (DTensors: gradfuse.sharded). Raises
    GradientTypeError naming a parameter of a dtype no path takes."""
    if not tensors:
        return {}
    if not any(layouts):
        # Every Python-level look at 10 000 tensors costs milliseconds: group them in C++ (as
        # clip_grad_norm_ does) and check the dtypes per group.
        grouped = _groups(tensors)
        if any(dtype not in SUPPORTED_DTYPES for _, dtype in grouped):
            _check_tensors(names, tensors, what, slow_path)
        return {(0, device, dtype): idx for (device, dtype), idx in grouped.items()}
    return sharded.layout_groups(names, tensors, layouts, what, slow_path)


def _norm_accumulator(floats: torch.Tensor, counts: torch.Tensor, p: float,
                      elementwise_zero_norm: bool = False) -> torch.Tensor:
    """What the total norm of order p is a root of (or the max / min, for inf / -inf), in
    float64; these add (or max / min) across ranks. As torch.nn.utils, the total is the norm of
    the per-tensor norms; for p != 0 that equals the norm of all elements viewed as one vector,
    for p = 0 it counts tensors with a non-zero element (``elementwise_zero_norm``: counts the
    non-zero elements, the 0-norm of the one vector)."""
    if p == 2.0:
        return floats[:, SUMSQ].sum()
    if p == math.inf:
        # amax propagates NaN; an empty set of rows has norm 0
        return floats[:, MAXABS].amax() if floats.shape[0] else floats.new_zeros(())
    if p == -math.inf:  # POWSUM holds min |x| (+inf for an empty tensor)
        return floats[:, POWSUM].amin() if floats.shape[0] else floats.new_zeros(())
    if p == 0.0:  # NaN counts as non-zero
        nonzero = counts[:, NUMEL] - counts[:, ZERO]
        return (nonzero if elementwise_zero_norm else nonzero > 0).sum().to(torch.float64)
    return floats[:, POWSUM].sum()


def _root(acc: torch.Tensor, p: float) -> torch.Tensor:
    if p == 2.0:
        return acc.sqrt()
    if math.isinf(p) or p in (0.0, 1.0):
        return acc
    return acc.pow(1.0 / p)


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
    device, see :mod:`gradfuse.histogram`) and ``headroom`` (see :mod:`gradfuse.headroom`).
    """
    p = _check_norm_type(norm_type)
    if group is None and not histogram:  # issue 18: a list served in C++ (gradfuse.walk_cache)
        s = walk_cache.stats(source, p)
        if s is not None:
            return s
    all_names, params = _named_params(source)
    names, _params, grads = _with_grads(all_names, params)
    s = _fused_stats(names, grads, p, group)
    if group is None and not histogram:
        walk_cache.planned(source, p, all_names, params, grads, s)
    return histogram_module.attach(s, names, grads) if histogram else s


def tensor_stats(tensors: torch.Tensor | Iterable[torch.Tensor] | dict[str, torch.Tensor], *,
                 norm_type: float = 2.0, histogram: bool = False) -> GradStats:
    """The same statistics for arbitrary tensors (activations, weights, ...).

    ``tensors`` is a tensor, an iterable of tensors (named ``[i]``) or a dict name -> tensor.
    The total norm is that of all elements viewed as one vector: for ``norm_type=0`` the number
    of non-zero elements (gradient statistics count gradients with one, as torch.nn.utils).
    ``histogram=True``: also the exponent histogram and headroom columns, as :func:`stats`.
    """
    p = _check_norm_type(norm_type)
    if isinstance(tensors, torch.Tensor):
        items = [("[0]", tensors)]
    elif isinstance(tensors, dict):
        items = list(tensors.items())
    else:
        items = [(f"[{i}]", t) for i, t in enumerate(tensors)]
    names, detached = [n for n, _ in items], [t.detach() for _, t in items]
    s = _fused_stats(names, detached, p, what="tensor", elementwise_zero_norm=True)
    return histogram_module.attach(s, names, detached) if histogram else s


def _check_max_norm(max_norm) -> float:
    m = float(max_norm)
    if math.isnan(m) or m < 0:
        raise ValueError(f"gradfuse: max_norm must be a non-negative number, got {max_norm!r}")
    return m


def _raise_nonfinite(s: GradStats) -> None:
    bad = s.nonfinite_names()
    detail = ""
    if bad:
        rows = s.to_dict()["params"]
        detail = " Non-finite gradients: " + ", ".join(
            f"{n} (nan={rows[n]['nan_count']}, inf={rows[n]['inf_count']})" for n in bad[:20])
        if len(bad) > 20:
            detail += f", ... {len(bad) - 20} more"
    else:
        detail = (" No gradient holds NaN or Inf: the norm overflowed"
                  + (" (for a negative order: every |x|^p underflowed to 0)." if s.norm_type < 0
                     else "."))
    raise RuntimeError(
        f"The total norm of order {s.norm_type} for gradients from `parameters` is non-finite, "
        "so it cannot be clipped. To disable this error and scale the gradients by the "
        "non-finite norm anyway, set `error_if_nonfinite=False`." + detail)


def _scale_(grads: list[torch.Tensor], clip_coef: torch.Tensor) -> None:
    """Multiplies ``grads`` in place by ``clip_coef`` (0-d, at most 1: the kernels skip a
    coefficient of 1); DTensors by their local shards."""
    if distributed.may_have_dtensors(grads):
        grads = [distributed.local_tensor(g) for g in grads]
    try:  # one (device, dtype) group, checked by the op in C++, as in _fused_stats
        if grads:
            ops.multi_tensor_scale_(grads, clip_coef.to(grads[0].device))
    except RuntimeError:
        for (device, _dtype), idx in _groups(grads).items():
            group = [grads[i] for i in idx]
            coef = clip_coef.to(device)
            try:
                ops.multi_tensor_scale_(group, coef)
            except RuntimeError:  # sparse or complex: multiplied as torch does
                for g in group:
                    g.mul_(coef)


def _scale_to_max_norm(s: GradStats, grads: list[torch.Tensor], max_norm: float) -> GradStats:
    """Scales ``grads`` (those ``s`` was taken of) so their total norm is at most ``max_norm``;
    returns ``s`` with ``clip_coef`` set. The scale pass runs only where the coefficient is < 1."""
    # The same arithmetic as torch.nn.utils.clip_grad_norm_, in the dtype of its total norm.
    # (A rank without gradients still gets the group's coefficient.)
    clip_coef = torch.clamp(max_norm / (s._total + 1e-6), max=1.0)
    _scale_(grads, clip_coef)
    return s._replace(clip_coef=clip_coef, max_norm=max_norm)


def _raise_if_nonfinite(s: GradStats) -> None:
    total = s._total
    if torch.logical_or(total.isnan(), total.isinf()):  # syncs, as torch
        _raise_nonfinite(s)


def _clip(names, grads, max_norm: float, norm_type: float, error_if_nonfinite: bool,
          group=None, slow_path: bool = False, rows: bool = True) -> GradStats:
    s = _fused_stats(names, grads, norm_type, group, slow_path=slow_path, rows=rows)
    if grads and error_if_nonfinite:
        _raise_if_nonfinite(s)
    return _scale_to_max_norm(s, grads, max_norm)


def _as_tensor_list(tensors, fn: str) -> list:
    """``tensors`` as a list, as torch.nn.utils takes it: a tensor or an iterable; a module is
    refused (it would be iterated as submodules, or not at all)."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, nn.Module):
        raise ParametersTypeError(f"gradfuse.{fn}: got a module ({type(tensors).__name__}); pass "
                                  "model.parameters() (gradfuse.clip_ and stats take a module)")
    return list(tensors)


def _grads_of(parameters: list, fn: str):
    try:
        return _named_grads(parameters)
    except TypeError as e:  # an item that is not a tensor: torch fails reading its .grad
        raise ParametersTypeError(f"gradfuse.{fn}: {e}") from None


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Drop-in for :func:`torch.nn.utils.clip_grad_norm_`: same arguments, same in-place effect,
    same returned total norm (a 0-d tensor in the gradients' dtype; a DTensor for DTensor
    gradients, placed as torch places it).

    The norm is one fused pass per (device, dtype) group; the gradients are scaled by
    ``min(max_norm / (total_norm + 1e-6), 1)`` in a second pass that runs only when that
    coefficient is below 1 (decided on the device, without a host sync). Negative orders, -inf,
    sparse and complex gradients take a slower per-tensor path. ``foreach`` is accepted for
    compatibility; gradfuse always uses its fused kernels.
    """
    del foreach
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = _as_tensor_list(parameters, "clip_grad_norm_")
        if is_generator and len(parameters) == 0:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                          stacklevel=3)
    try:  # issue 18: a list served in C++ (gradfuse.walk_cache); else errors in torch's order
        s = _walk_clip(parameters, _check_max_norm(max_norm), _check_norm_type(norm_type),
                       error_if_nonfinite)
    except (TypeError, ValueError):
        s = None
    if s is not None:
        return s.total_norm
    try:
        all_names, params = _named_params(parameters)
        names, _params, grads = _with_grads(all_names, params)
    except TypeError as e:  # an item that is not a tensor: torch fails reading its .grad
        raise ParametersTypeError(f"gradfuse.clip_grad_norm_: {e}") from None
    max_norm, p = _check_max_norm(max_norm), _check_norm_type(norm_type)
    s = _clip(names, grads, max_norm, p, error_if_nonfinite, slow_path=True, rows=False)
    walk_cache.planned(parameters, p, all_names, params, grads, s)
    return s.total_norm


@torch.no_grad()
def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None) -> torch.Tensor:
    """Drop-in for :func:`torch.nn.utils.get_total_norm`: the norm of ``tensors`` (a tensor or
    an iterable of them, e.g. gradients), viewed as one vector; a 0-d tensor in their dtype (a
    DTensor for DTensors). With :func:`clip_grads_with_norm_` it splits ``clip_grad_norm_``::

        total = gradfuse.get_total_norm([p.grad for p in model.parameters()])
        gradfuse.clip_grads_with_norm_(model.parameters(), max_norm=1.0, total_norm=total)
    """
    del foreach
    tensors = _as_tensor_list(tensors, "get_total_norm")
    names = [f"[{i}]" for i in range(len(tensors))]
    try:
        s = _fused_stats(names, tensors, _check_norm_type(norm_type), slow_path=True, rows=False)
    except (AttributeError, TypeError, RuntimeError):
        bad = next((i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)), None)
        if bad is None:
            raise
        raise ParametersTypeError(f"gradfuse.get_total_norm: tensors[{bad}] is "
                                  f"{type(tensors[bad]).__name__}, not a tensor") from None
    if tensors and error_if_nonfinite:
        _raise_if_nonfinite(s)
    return s.total_norm


@torch.no_grad()
def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor,
                          foreach: bool | None = None) -> None:
    """Drop-in for :func:`torch.nn.utils.clip_grads_with_norm_`: scales the gradients of
    ``parameters`` in place by ``min(max_norm / (total_norm + 1e-6), 1)``, touching them only
    when that is below 1. ``total_norm`` may be a DTensor (from :func:`get_total_norm`)."""
    del foreach
    parameters = _as_tensor_list(parameters, "clip_grads_with_norm_")
    _names, _params, grads = _grads_of(parameters, "clip_grads_with_norm_")
    max_norm = _check_max_norm(max_norm)
    if not grads:
        return
    total_norm = total_norm if distributed.is_plain(total_norm) else distributed.full_value(total_norm)
    _scale_(grads, torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))


@torch.no_grad()
def clip_(source: Source, max_norm: float | None, norm_type: float = 2.0,
          error_if_nonfinite: bool = False, *, group=None, per: str | None = None,
          value: float | None = None, layer_depth: int | None = None) -> GradStats:
    """Clip the gradients of ``source`` by total norm in place, like ``clip_grad_norm_``, and
    return their statistics from before clipping, with ``clip_coef`` and ``clipped``.

    One fused stats pass, plus a scale pass only on steps that need clipping::

        loss.backward()
        s = gradfuse.clip_(model, max_norm=1.0)
        if step % 100 == 0:
            print(s.table(top=10))   # the only host transfer
        optimizer.step()

    ``per="param"`` / ``per="layer"``: each parameter / layer (as :meth:`GradStats.layers`
    groups them, or by ``layer_depth``) clipped by its own norm, from the same single stats pass;
    ``clip_coef`` is then one entry per row. ``value=v`` (with ``max_norm=None``): clamps to
    ``[-v, v]`` as ``clip_grad_value_``, statistics from before clamping and ``clamped``, the
    number of elements changed per row. See :mod:`gradfuse.clipping`.
    """
    if per is not None or value is not None:  # issue 17: see gradfuse.clipping
        from gradfuse import clipping
        return clipping.clip_modes_(source, max_norm, norm_type, error_if_nonfinite, group=group,
                                    per=per, value=value, layer_depth=layer_depth)
    max_norm = _check_max_norm(max_norm)
    p = _check_norm_type(norm_type)
    if group is None:  # issue 18: a list served in C++ (gradfuse.walk_cache)
        s = _walk_clip(source, max_norm, p, error_if_nonfinite)
        if s is not None:
            return s
    all_names, params = _named_params(source)
    names, _params, grads = _with_grads(all_names, params)
    s = _clip(names, grads, max_norm, p, error_if_nonfinite, group)
    if group is None:
        walk_cache.planned(source, p, all_names, params, grads, s)
    return s


def _walk_clip(source, max_norm: float, p: float, error_if_nonfinite: bool) -> GradStats | None:
    """_clip on a list served in C++ (gradfuse.walk_cache), or None with nothing touched."""
    if not error_if_nonfinite:
        return walk_cache.clip(source, p, max_norm)
    s = walk_cache.stats(source, p)
    if s is None:
        return None
    if len(s):
        _raise_if_nonfinite(s)
    clipped = walk_cache.clip_to(source, s, max_norm)
    if clipped is None:  # not expected (nothing changed since the stats): scale in Python
        _names, _params, grads = _named_grads(source)
        clipped = _scale_to_max_norm(s, grads, max_norm)
    return clipped
