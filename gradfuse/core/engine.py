"""The fused-statistics engine: one fused pass per (sharding layout, device, dtype) group giving
a ``GradStats``, the in-place scale to a clip coefficient, and the error for a non-finite
total. The arithmetic of norms and coefficients is ``gradfuse.core.norms``.

Layer: core. Imports ``gradfuse.ops`` and the core modules below it (params, grouping,
norms, distributed, sharded, slow_paths, grad_stats).
"""
from __future__ import annotations

import torch

from gradfuse import ops
from gradfuse.core import distributed, grouping, sharded, slow_paths
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.norms import clip_coefficient, kernel_takes_order, norm_accumulator, norm_dtype, root
from gradfuse.core.params import SUPPORTED_DTYPES, check_tensors
from gradfuse.ops.layout import INF, NAN, NUM_COUNT_STATS, NUM_FLOAT_STATS


def fused_stats(names: list[str], tensors: list[torch.Tensor], norm_type: float,
                group=None, what: str = "gradient", *, slow_path: bool = False,
                elementwise_zero_norm: bool = False, rows: bool = True) -> GradStats:
    """One fused pass per (sharding layout, device, dtype) group; rows of the result follow the
    returned names (grouped: the order of ``tensors`` when there is one group). DTensor rows are
    reduced over their sharded mesh dimensions; with ``group`` the total norm and the non-finite
    flag are reduced over that process group (see gradfuse.core.distributed). ``slow_path``: also
    take sparse and complex tensors (per tensor, in PyTorch). ``elementwise_zero_norm``: the
    total 0-norm counts non-zero elements, not tensors with one (see norm_accumulator).
    ``rows=False``, when only the total is needed: DTensor gradients then cost one functional
    scalar all-reduce per sharded mesh dimension, as in torch, and their rows are reduced only
    when read (gradfuse.core.sharded)."""
    locals_, layouts = tensors, [None] * len(tensors)
    dtensor_spec = None
    if distributed.may_have_dtensors(tensors):
        locals_, layouts, dtensor_spec = sharded.split_dtensors(names, tensors, norm_type)
    if not tensors and group is None:
        return GradStats([], torch.empty((0, NUM_FLOAT_STATS), dtype=ops.stats_dtype("cpu")),
                         torch.empty((0, NUM_COUNT_STATS), dtype=torch.int64), norm_type, torch.tensor(0.0))
    device = locals_[0].device if tensors else torch.device("cpu")
    whole_result = None
    if locals_ and not any(layouts) and kernel_takes_order(norm_type):
        # The common case is one (device, dtype) group: hand the whole list to the op, which
        # checks that in C++; grouping first costs another pass over every tensor.
        try:
            whole_result = ops.multi_tensor_stats(locals_, norm_type)
            groups = {(0, device, locals_[0].dtype): range(len(locals_))}
        except RuntimeError:  # mixed dtypes or devices, or a bad tensor: group, name it
            pass
    if whole_result is None:
        groups = layout_groups(names, locals_, layouts, what, slow_path)
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
        floats = torch.zeros((0, NUM_FLOAT_STATS), dtype=ops.stats_dtype(device), device=device)
        counts = torch.zeros((0, NUM_COUNT_STATS), dtype=torch.int64, device=device)
    pending_rows = None
    if any(layout is not None for layout, _, _ in segments):
        if rows or group is not None or not sharded.total_only_takes(norm_type):
            floats, counts = sharded.reduce_rows(floats, counts, segments, norm_type)
        else:
            pending_rows = sharded.PendingRows(floats, counts, segments, norm_type)
    if pending_rows is None:
        acc = norm_accumulator(floats, counts, norm_type, elementwise_zero_norm)
    else:
        acc = sharded.reduce_total(floats, counts, segments, norm_type)
    group_nonfinite = None
    if group is not None:
        nonfinite_count = (counts[:, NAN] + counts[:, INF]).sum()
        acc, group_nonfinite = distributed.reduce_over_group(acc, nonfinite_count, norm_type, group)
    total = root(acc, norm_type)
    # The dtype clip_grad_norm_ returns: that of its stacked per-tensor norms (real for complex).
    out_dtype = norm_dtype(tensors[0].dtype) if tensors else torch.float32
    for _order, _device, dtype in groups:
        out_dtype = torch.promote_types(out_dtype, norm_dtype(dtype))
    return GradStats(out_names, floats, counts, norm_type, total.to(out_dtype),
                     group_nonfinite=group_nonfinite, dtensor_spec=dtensor_spec,
                     pending_rows=pending_rows)


def layout_groups(names, tensors, layouts, what, slow_path=False) -> dict[tuple, list[int]]:
    """Indices per (layout order, device, dtype) (DTensors: gradfuse.core.sharded). Raises
    GradientTypeError naming a parameter of a dtype no path takes."""
    if not tensors:
        return {}
    if not any(layouts):
        # Every Python-level look at 10 000 tensors costs milliseconds: group them in C++ (as
        # clip_grad_norm_ does) and check the dtypes per group.
        grouped = grouping.groups(tensors)
        if any(dtype not in SUPPORTED_DTYPES for _, dtype in grouped):
            check_tensors(names, tensors, what, slow_path)
        return {(0, device, dtype): idx for (device, dtype), idx in grouped.items()}
    return sharded.layout_groups(names, tensors, layouts, what, slow_path)


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


def scale_(grads: list[torch.Tensor], clip_coef: torch.Tensor) -> None:
    """Multiplies ``grads`` in place by ``clip_coef`` (0-d, at most 1: the kernels skip a
    coefficient of 1); DTensors by their local shards."""
    if distributed.may_have_dtensors(grads):
        grads = [distributed.local_tensor(g) for g in grads]

    def fused(group, _idx):
        ops.multi_tensor_scale_(group, clip_coef.to(group[0].device))

    def per_tensor(group, _idx):  # sparse or complex: multiplied as torch does
        coef = clip_coef.to(group[0].device)
        for g in group:
            g.mul_(coef)

    grouping.whole_or_grouped(grads, fused, per_tensor)


def scale_to_max_norm(s: GradStats, grads: list[torch.Tensor], max_norm: float) -> GradStats:
    """Scales ``grads`` (those ``s`` was taken of) so their total norm is at most ``max_norm``;
    returns ``s`` with ``clip_coef`` set. The scale pass runs only where the coefficient is < 1."""
    s = with_clip_coefficient(s, max_norm)
    scale_(grads, s.clip_coef)
    return s


def with_clip_coefficient(s: GradStats, max_norm: float) -> GradStats:
    """``s`` with the ``clip_coef`` that clipping to ``max_norm`` applies (nothing scaled: for a
    step that applies it as it reads the gradients, ``gradfuse.optim``'s ``grad_scale``)."""
    # The same arithmetic as torch.nn.utils.clip_grad_norm_, in the dtype of its total norm.
    # (A rank without gradients still gets the group's coefficient.)
    return s.replace(clip_coef=clip_coefficient(s.plain_total_norm, max_norm), max_norm=max_norm)


def raise_if_nonfinite(s: GradStats) -> None:
    """torch.nn.utils' error for a non-finite total norm, naming the parameters whose gradient
    holds NaN or Inf (or saying the norm overflowed). Reads the total: one host sync, as torch."""
    total = s.plain_total_norm
    if torch.logical_or(total.isnan(), total.isinf()):
        _raise_nonfinite(s)


def clip_total_norm_(names, grads, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                     group=None, slow_path: bool = False, rows: bool = True) -> GradStats:
    """Clipping by total norm on the functional path: the fused statistics of ``grads``, the
    error for a non-finite total when asked, then the conditional scale; returns the statistics
    from before clipping with ``clip_coef``."""
    s = fused_stats(names, grads, norm_type, group, slow_path=slow_path, rows=rows)
    if grads and error_if_nonfinite:
        raise_if_nonfinite(s)
    return scale_to_max_norm(s, grads, max_norm)


