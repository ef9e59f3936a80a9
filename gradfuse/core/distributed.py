"""Statistics of gradients spread over ranks.

- DTensor gradients (FSDP2 ``fully_shard``, tensor parallel): each rank reduces its local shard
  in the fused pass; then the per-parameter rows are reduced over the mesh dimensions where the
  gradient is sharded (sums, sums of squares, counts and numel by SUM, max |x| by MAX), all
  parameters of one sharding layout packed into two collectives per sharded mesh dimension, in
  float64. Replicated mesh dimensions are not reduced (no double counting).
- ``group=`` (pipeline stages: ranks holding different parameters): the total norm's accumulator
  and the non-finite count are reduced over the group in one collective; per-parameter rows stay
  with the rank that owns them.
- DDP needs nothing: its gradients are already all-reduced, the same on every rank.
- The total norm of DTensor gradients is returned as a DTensor, as torch.nn.utils returns it
  (``total_norm_spec``): every rank holds the full value locally, so wrapping it communicates
  nothing.

Collectives are issued with ``async_op=True`` and waited on together; on NCCL a wait orders the
current stream and does not block the host.
"""
from __future__ import annotations

import math
import sys

import torch

from gradfuse.ops.layout import MAX_FLOAT_COLUMNS, NAN, POWSUM, SUMMED_FLOAT_COLUMNS

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain ``torch.Tensor`` or ``nn.Parameter``, not a subclass such as a
    DTensor (a DTensor parameter's type is DTensor's): one type check, on every parameter of a
    step."""
    return type(t) in _PLAIN_TYPES


def may_have_dtensors(tensors: list[torch.Tensor]) -> bool:
    """False without a per-tensor look when DTensor was never imported (no DTensor can exist)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    return not all(is_plain(t) for t in tensors)


def _dtensor_class():
    from torch.distributed.tensor import DTensor
    return DTensor


def local_and_layout(name: str, t: torch.Tensor):
    """(local tensor, sharding layout or None). The layout is (mesh, sharded mesh dims); it is
    None for a plain tensor or a fully replicated DTensor."""
    if is_plain(t) or not isinstance(t, _dtensor_class()):
        return t, None
    for pl in t.placements:
        if pl.is_partial():
            raise TypeError(f"gradfuse: the gradient of {name!r} is a DTensor with a Partial "
                            f"placement {t.placements}; reduce it first (redistribute to Shard or "
                            "Replicate), as its local values are not its elements")
    shard_dims = tuple(i for i, pl in enumerate(t.placements) if pl.is_shard())
    return t.to_local(), ((t.device_mesh, shard_dims) if shard_dims else None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (``to_local()``), else ``t`` itself."""
    return t if is_plain(t) or not isinstance(t, _dtensor_class()) else t.to_local()


def full_value(t) -> torch.Tensor:
    """A plain tensor holding the whole of ``t`` (a DTensor: ``full_tensor()``, which
    communicates only for Shard or Partial placements)."""
    if isinstance(t, torch.Tensor) and not is_plain(t) and isinstance(t, _dtensor_class()):
        return t.full_tensor()
    return torch.as_tensor(t)


def reduce_sharded_rows(floats: torch.Tensor, counts: torch.Tensor, layout, start: int, stop: int,
                        norm_type: float = 2.0):
    """Rows [start, stop) belong to gradients sharded by ``layout``: returns them reduced over
    the sharded mesh dimensions, as (floats, counts) of the full gradients. For norm_type -inf
    the POWSUM column is a minimum: it travels negated with the maxima (no third collective)."""
    import torch.distributed as dist

    mesh, dims = layout
    f, c = floats[start:stop], counts[start:stop]
    min_column = norm_type == -math.inf
    summed, maxed = list(SUMMED_FLOAT_COLUMNS), list(MAX_FLOAT_COLUMNS)  # as the layout combines them
    sums = torch.cat([f[:, summed], c.to(f.dtype)], dim=1)
    maxes = torch.cat([f[:, maxed], -f[:, POWSUM:POWSUM + 1]], dim=1) if min_column else f[:, maxed]
    for d in dims:  # reducing over each sharded dimension in turn reduces over their product
        group = mesh.get_group(mesh_dim=d)
        works = [dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group, async_op=True),
                 dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group, async_op=True)]
        for w in works:
            w.wait()
    c_out = sums[:, len(summed):].round().to(torch.int64)
    # A backend's MAX may drop NaN; the summed NaN count puts it back.
    has_nan = c_out[:, NAN:NAN + 1] > 0
    f_out = torch.empty_like(f)
    f_out[:, summed] = sums[:, :len(summed)]
    f_out[:, maxed] = torch.where(has_nan, math.nan, maxes[:, :len(maxed)])
    if min_column:
        f_out[:, POWSUM] = torch.where(has_nan[:, 0], math.nan, -maxes[:, -1])
    return f_out, c_out


def sum_sharded_rows(floats: torch.Tensor, counts: torch.Tensor, layout):
    """Rows whose every column is a sum (the optimizer-update rows, ``UPDATE_FLOAT_COLUMNS`` /
    ``UPDATE_COUNT_COLUMNS``), of tensors sharded by ``layout`` (mesh, sharded mesh dims): returns
    them summed over the sharded mesh dimensions, the rows of the whole tensors. One collective per
    sharded mesh dimension, the counts travelling as float64 beside the sums (exact below 2^53)."""
    import torch.distributed as dist

    mesh, dims = layout
    packed = torch.cat([floats, counts.to(floats.dtype)], dim=1)
    for d in dims:  # reducing over each sharded dimension in turn reduces over their product
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=mesh.get_group(mesh_dim=d))
    return packed[:, :floats.shape[1]].contiguous(), packed[:, floats.shape[1]:].round().to(torch.int64)


def all_reduce_accumulator(acc: torch.Tensor, layout, norm_type: float) -> torch.Tensor:
    """The total norm's accumulator of gradients sharded by ``layout`` (mesh, sharded mesh
    dims), from this rank's: as torch.nn.utils reduces its Partial total norm to Replicate, one
    functional all-reduce (``c10d_functional.all_reduce``, which CommDebugMode, torch.compile and
    NCCL overlap see) per sharded mesh dimension, of one scalar (a sum of |x|^p). For inf the
    maximum travels with a NaN flag beside it (a backend's MAX may drop NaN)."""
    from torch.distributed import _functional_collectives as funcol

    mesh, dims = layout
    if math.isinf(norm_type):
        x, op = torch.stack([acc, torch.isnan(acc).to(acc.dtype)]), "max"
    else:
        x, op = acc.reshape(1), "sum"
    for d in dims:  # reducing over each sharded dimension in turn reduces over their product
        x = funcol.all_reduce(x, op, (mesh, d))
    x = funcol.wait_tensor(x) if hasattr(funcol, "wait_tensor") else x * 1
    if math.isinf(norm_type):
        return torch.where(x[1] > 0, torch.full_like(x[0], math.nan), x[0])
    return x[0]


def reduce_over_group(acc: torch.Tensor, nonfinite_count: torch.Tensor, norm_type: float, group):
    """The total norm's accumulator and whether any element is non-finite, over ``group``,
    in one collective."""
    import torch.distributed as dist

    # -inf: the accumulator is a minimum; reduce it negated with MAX.
    sign = -1.0 if norm_type == -math.inf else 1.0
    # A backend's MAX may drop NaN: carry "this rank's accumulator is NaN" beside it.
    packed = torch.stack([acc * sign, torch.isnan(acc).to(acc.dtype), nonfinite_count.to(acc.dtype)])
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    dist.all_reduce(packed, op=op, group=group, async_op=True).wait()
    acc = torch.where(packed[1] > 0, torch.full_like(packed[0], math.nan), packed[0] * sign)
    return acc, packed[2] > 0


def total_norm_spec(tensors: list[torch.Tensor], layouts: list, norm_type: float):
    """(mesh, placements) of the total norm as torch.nn.utils returns it for DTensor gradients,
    or None when there is none: on the first DTensor gradient's mesh, Replicate on every mesh
    dimension, except Partial(max) / Partial(min) for norm_type inf / -inf on the dimensions
    where some gradient is sharded (torch leaves those unreduced until someone asks)."""
    from torch.distributed.tensor import Partial, Replicate
    dtensor = _dtensor_class()
    first = next((t for t in tensors if isinstance(t, dtensor)), None)
    if first is None:
        return None
    mesh = first.device_mesh
    sharded = set()
    if math.isinf(norm_type):
        for layout in layouts:
            if layout is not None and layout[0] == mesh:
                sharded.update(layout[1])
    partial = Partial("max" if norm_type > 0 else "min")
    return mesh, tuple(partial if d in sharded else Replicate() for d in range(mesh.ndim))


def as_dtensor(total: torch.Tensor, spec) -> torch.Tensor:
    """``total`` (the full value, the same on every rank) as the DTensor ``spec`` describes; no
    communication."""
    mesh, placements = spec
    return _dtensor_class().from_local(total, mesh, placements, run_check=False)
