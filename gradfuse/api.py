"""The public entry points: stats, tensor_stats, clip_grad_norm_, clip_."""
from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from gradfuse import distributed, ops
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


def _check_tensors(names: list[str], tensors: list[torch.Tensor], what: str) -> None:
    for name, t in zip(names, tensors):
        _check_tensor(name, t, what)


def _check_tensor(name: str, t: torch.Tensor, what: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"gradfuse: the {what} of {name!r} is {t.layout}; only dense tensors are "
                        "supported (for sparse gradients use torch.nn.utils.clip_grad_norm_)")
    if t.dtype not in SUPPORTED_DTYPES:
        kind = "complex" if t.dtype.is_complex else "not floating point"
        raise TypeError(f"gradfuse: the {what} of {name!r} has dtype {t.dtype} ({kind}); "
                        "supported: float16, bfloat16, float32, float64")


def _check_norm_type(norm_type) -> float:
    p = float(norm_type)
    if math.isnan(p) or p == -math.inf:
        raise ValueError(f"gradfuse: norm_type must be a number >= 0 or inf, got {norm_type!r}")
    if p < 0:
        raise ValueError(f"gradfuse: norm_type must be >= 0 or inf, got {p}")
    return p


def _groups(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` per (device, dtype), grouped in C++ (no per-tensor Python)."""
    if not tensors:
        return {}
    grouped = _group_tensors_by_device_and_dtype([tensors], with_indices=True)
    return {key: idx for key, (_, idx) in grouped.items()}


def _fused_stats(names: list[str], tensors: list[torch.Tensor], norm_type: float,
                 group=None, what: str = "gradient") -> GradStats:
    """One fused pass per (sharding layout, device, dtype) group; rows of the result follow the
    returned names (grouped: the order of ``tensors`` when there is one group). DTensor rows are
    reduced over their sharded mesh dimensions; with ``group`` the total norm and the non-finite
    flag are reduced over that process group (see gradfuse.distributed)."""
    locals_, layouts = tensors, [None] * len(tensors)
    if distributed.may_have_dtensors(tensors):
        pairs = [distributed.local_and_layout(n, t) for n, t in zip(names, tensors)]
        locals_, layouts = [p[0] for p in pairs], [p[1] for p in pairs]
    if not tensors and group is None:
        return GradStats([], torch.empty((0, 4), dtype=torch.float64),
                         torch.empty((0, 4), dtype=torch.int64), norm_type, torch.tensor(0.0))
    device = locals_[0].device if tensors else torch.device("cpu")
    whole_result = None
    if locals_ and not any(layouts):
        # The common case is one (device, dtype) group: hand the whole list to the op, which
        # checks that in C++; grouping first costs another pass over every tensor.
        try:
            whole_result = ops.multi_tensor_stats(locals_, norm_type)
            groups = {(0, device, locals_[0].dtype): range(len(locals_))}
        except RuntimeError:  # mixed dtypes or devices, or a bad tensor: group, name it
            pass
    if whole_result is None:
        groups = _layout_groups(names, locals_, layouts, what)
    out_names, floats, counts, segments = [], [], [], []
    row = 0
    for key in sorted(groups, key=lambda k: k[0]):  # stable: first-seen order within a layout
        idx = groups[key]
        whole = len(idx) == len(locals_)
        group_tensors = locals_ if whole else [locals_[i] for i in idx]
        try:
            f, c = whole_result or ops.multi_tensor_stats(group_tensors, norm_type)
        except RuntimeError:  # e.g. a sparse gradient: say which parameter, if it is that
            _check_tensors([names[i] for i in idx], group_tensors, what)
            raise
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
    if any(layout is not None for layout, _, _ in segments):
        floats, counts = _reduce_sharded(floats, counts, segments)
    acc = _norm_accumulator(floats, counts, norm_type)
    group_nonfinite = None
    if group is not None:
        nonfinite_count = (counts[:, NAN] + counts[:, INF]).sum()
        acc, group_nonfinite = distributed.reduce_over_group(acc, nonfinite_count, norm_type, group)
    total = _root(acc, norm_type)
    # The dtype clip_grad_norm_ returns: that of its stacked per-tensor norms.
    out_dtype = tensors[0].dtype if tensors else torch.float32
    for _order, _device, dtype in groups:
        out_dtype = torch.promote_types(out_dtype, dtype)
    return GradStats(out_names, floats, counts, norm_type, total.to(out_dtype),
                     group_nonfinite=group_nonfinite)


def _layout_groups(names, tensors, layouts, what) -> dict[tuple, list[int]]:
    """Indices per (layout order, device, dtype); rows of one sharding layout stay adjacent, so
    each layout is reduced as one block. Raises TypeError naming a parameter of a dtype the
    kernels do not take."""
    if not tensors:
        return {}
    if not any(layouts):
        # Every Python-level look at 10 000 tensors costs milliseconds: group them in C++ (as
        # clip_grad_norm_ does) and check the dtypes per group.
        grouped = _groups(tensors)
        if any(dtype not in SUPPORTED_DTYPES for _, dtype in grouped):
            _check_tensors(names, tensors, what)
        return {(0, device, dtype): idx for (device, dtype), idx in grouped.items()}
    _check_tensors(names, tensors, what)
    layout_order: dict = {}
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        order = layout_order.setdefault(_layout_key(layouts[i]), len(layout_order))
        groups.setdefault((order, t.device, t.dtype), []).append(i)
    return groups


def _layout_key(layout):
    return None if layout is None else (id(layout[0]), layout[1])


def _reduce_sharded(floats, counts, segments):
    """Replaces the rows of sharded gradients with those of the full gradients; consecutive
    segments of one layout (several dtypes) are reduced together."""
    merged = []
    for layout, a, b in segments:
        if merged and merged[-1][0] is not None and layout is not None \
                and _layout_key(merged[-1][0]) == _layout_key(layout):
            merged[-1] = (layout, merged[-1][1], b)
        else:
            merged.append((layout, a, b))
    f_parts, c_parts = [], []
    for layout, a, b in merged:
        if layout is None:
            f_parts.append(floats[a:b])
            c_parts.append(counts[a:b])
        else:
            f, c = distributed.reduce_sharded_rows(floats, counts, layout, a, b)
            f_parts.append(f)
            c_parts.append(c)
    return torch.cat(f_parts), torch.cat(c_parts)


def _norm_accumulator(floats: torch.Tensor, counts: torch.Tensor, p: float) -> torch.Tensor:
    """What the total norm of order p is a root of (or the max, for inf), in float64; these
    add (or max) across ranks."""
    if p == 2.0:
        return floats[:, SUMSQ].sum()
    if math.isinf(p):
        # amax propagates NaN; an empty set of rows has norm 0
        return floats[:, MAXABS].amax() if floats.shape[0] else floats.new_zeros(())
    if p == 0.0:
        return (counts[:, NUMEL] - counts[:, ZERO]).sum().to(torch.float64)
    return floats[:, POWSUM].sum()


def _root(acc: torch.Tensor, p: float) -> torch.Tensor:
    if p == 2.0:
        return acc.sqrt()
    if math.isinf(p) or p in (0.0, 1.0):
        return acc
    return acc.pow(1.0 / p)


def stats(source: Source, *, norm_type: float = 2.0, group=None) -> GradStats:
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
    """
    p = _check_norm_type(norm_type)
    names, _params, grads = _named_grads(source)
    return _fused_stats(names, grads, p, group)


def tensor_stats(tensors: torch.Tensor | Iterable[torch.Tensor] | dict[str, torch.Tensor], *,
                 norm_type: float = 2.0) -> GradStats:
    """The same statistics for arbitrary tensors (activations, weights, ...).

    ``tensors`` is a tensor, an iterable of tensors (named ``[i]``) or a dict name -> tensor.
    """
    p = _check_norm_type(norm_type)
    if isinstance(tensors, torch.Tensor):
        items = [("[0]", tensors)]
    elif isinstance(tensors, dict):
        items = list(tensors.items())
    else:
        items = [(f"[{i}]", t) for i, t in enumerate(tensors)]
    return _fused_stats([n for n, _ in items], [t.detach() for _, t in items], p, what="tensor")


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
        detail = " No gradient holds NaN or Inf: the norm overflowed."
    raise RuntimeError(
        f"The total norm of order {s.norm_type} for gradients from `parameters` is non-finite, "
        "so it cannot be clipped. To disable this error and scale the gradients by the "
        "non-finite norm anyway, set `error_if_nonfinite=False`." + detail)


def _scale_to_max_norm(s: GradStats, grads: list[torch.Tensor], max_norm: float) -> GradStats:
    """Scales ``grads`` (those ``s`` was taken of) so their total norm is at most ``max_norm``;
    returns ``s`` with ``clip_coef`` set. The scale pass runs only where the coefficient is < 1."""
    # The same arithmetic as torch.nn.utils.clip_grad_norm_, in the dtype of its total norm.
    # (A rank without gradients still gets the group's coefficient.)
    clip_coef = torch.clamp(max_norm / (s.total_norm + 1e-6), max=1.0)
    try:  # one (device, dtype) group, checked by the op in C++, as in _fused_stats
        if grads:
            ops.multi_tensor_scale_(grads, clip_coef.to(grads[0].device))
    except RuntimeError:
        for (device, _dtype), idx in _groups(grads).items():
            ops.multi_tensor_scale_([grads[i] for i in idx], clip_coef.to(device))
    return s._replace(clip_coef=clip_coef, max_norm=max_norm)


def _clip(names, grads, max_norm: float, norm_type: float, error_if_nonfinite: bool,
          group=None) -> GradStats:
    s = _fused_stats(names, grads, norm_type, group)
    if distributed.may_have_dtensors(grads):  # DTensor: scale this rank's shard
        grads = [distributed.local_tensor(g) for g in grads]
    total = s.total_norm
    if grads and error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):  # syncs, as torch
        _raise_nonfinite(s)
    return _scale_to_max_norm(s, grads, max_norm)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Drop-in for :func:`torch.nn.utils.clip_grad_norm_`: same arguments, same in-place effect,
    same returned total norm (a 0-d tensor in the gradients' dtype).

    The norm is one fused pass per (device, dtype) group; the gradients are scaled by
    ``min(max_norm / (total_norm + 1e-6), 1)`` in a second pass that runs only when that
    coefficient is below 1 (decided on the device, without a host sync). ``foreach`` is
    accepted for compatibility; gradfuse always uses its fused kernels.
    """
    del foreach
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and len(parameters) == 0:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                          stacklevel=3)
    names, _params, grads = _named_grads(parameters)
    return _clip(names, grads, _check_max_norm(max_norm), _check_norm_type(norm_type),
                 error_if_nonfinite).total_norm


@torch.no_grad()
def clip_(source: Source, max_norm: float, norm_type: float = 2.0,
          error_if_nonfinite: bool = False, *, group=None) -> GradStats:
    """Clip the gradients of ``source`` by total norm in place, like ``clip_grad_norm_``, and
    return their statistics from before clipping, with ``clip_coef`` and ``clipped``.

    One fused stats pass, plus a scale pass only on steps that need clipping::

        loss.backward()
        s = gradfuse.clip_(model, max_norm=1.0)
        if step % 100 == 0:
            print(s.table(top=10))   # the only host transfer
        optimizer.step()
    """
    max_norm = _check_max_norm(max_norm)
    p = _check_norm_type(norm_type)
    names, _params, grads = _named_grads(source)
    return _clip(names, grads, max_norm, p, error_if_nonfinite, group)
