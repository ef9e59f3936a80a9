"""The fused step shared by ``gradfuse.optim.SGD``, ``Adam`` and ``AdamW``: one
``multi_tensor_optim_step_`` call per (device, dtype) of the parameters with gradients, the state
made as torch makes it, the step counters advanced as torch advances them.

DTensor parameters are stepped on their local shards, one call per (sharding layout, device,
dtype); the rows of ``stats`` and the rows that ``max_update_rms`` takes its coefficients from are
summed over the layout's sharded mesh dimensions (``gradfuse.core.distributed.sum_sharded_rows``),
so they are those of the whole tensor, the same on every rank.

Layer: optim. Imports ``gradfuse.ops`` and ``gradfuse.core``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradfuse import ops
from gradfuse.core import distributed
from gradfuse.core.host_copy import HostCopy, read_host_resident
from gradfuse.core.norms import rms_limit_coefficient
from gradfuse.core.sharded import layout_key
from gradfuse.ops.layout import RULE_ADAM, RULE_SGD, UPDATE_NUMEL, UPDATE_SUMSQ
from gradfuse.optim.table import adam_row, sgd_row

_EMPTY: dict[tuple, torch.Tensor] = {}


def _empty(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``like``'s dtype and device: an absent state entry."""
    key = (like.device, like.dtype)
    t = _EMPTY.get(key)
    if t is None:
        t = _EMPTY[key] = torch.empty(0, dtype=like.dtype, device=like.device)
    return t


@dataclass
class StepRows:
    """The update-statistics rows of one (sharding layout, device, dtype) group of a fused step:
    ``floats`` / ``counts`` as ``gradfuse.ops.multi_tensor_update_stats`` returns them, one row per
    parameter of ``params``, on the parameters' device (never read by the step). The rows of a
    DTensor parameter are those of the whole tensor: summed over the mesh dimensions it is
    sharded on."""

    params: list[torch.Tensor]
    floats: torch.Tensor
    counts: torch.Tensor

    def update_rms(self) -> torch.Tensor:
        """Per parameter, the RMS of the update applied, ``sqrt(update_sumsq / numel)`` (float64, on
        the device; NaN for an empty parameter)."""
        return (self.floats[:, UPDATE_SUMSQ] / self.counts[:, UPDATE_NUMEL].to(torch.float64)).sqrt()


@dataclass
class StepCoefs:
    """The update-clipping coefficients of one (sharding layout, device, dtype) group of a fused
    step with ``max_update_rms``: per parameter of ``params``, ``min(1, max_update_rms / rms(u))``
    of its whole update (a DTensor's over all its shards), float64 on the parameters' device
    (never read by the step). Below 1: the update was rescaled by it; NaN (an empty parameter, an
    update that is not finite): left as the step made it."""

    params: list[torch.Tensor]
    coefs: torch.Tensor


def refuse_unsupported(optimizer, group: dict) -> None:
    """Raises ValueError, naming the setting, for what the fused step does not do (when the
    optimizer or a parameter group is made)."""
    name = f"gradfuse.optim.{type(optimizer).__name__}"
    if group.get("differentiable", False):
        raise ValueError(f"{name}: differentiable=True is not supported (the fused step is not recorded by "
                         f"autograd); use torch.optim.{type(optimizer).__mro__[2].__name__}")
    if group.get("fused", False):
        raise ValueError(f"{name}: fused=True selects torch's own fused kernel, whose results differ from the "
                         f"default step; {name} is fused already and gives the default step's results: leave "
                         "fused unset")
    if group.get("capturable", False):
        raise ValueError(f"{name}: capturable=True is not supported yet: its step counters live on the device, "
                         "and the fused step reads them on the host")
    for key in ("betas", "lr", "weight_decay", "momentum", "dampening", "eps"):
        value = group.get(key)
        values = value if isinstance(value, tuple) else (value,)
        if key != "lr" and any(isinstance(v, torch.Tensor) for v in values):
            raise ValueError(f"{name}: {key} as a tensor is not supported (only lr may be a tensor)")
    for i, p in enumerate(group["params"]):
        if p.is_complex():
            raise ValueError(f"{name}: parameter {i} of its group is complex ({p.dtype}); the fused step takes "
                             "float16, bfloat16, float32 and float64 parameters")
        if not p.is_floating_point():
            raise ValueError(f"{name}: parameter {i} of its group is {p.dtype}, not a floating-point tensor")


class _Lists:
    """The op's arguments for one (device, dtype) group, gathered parameter by parameter."""

    def __init__(self):
        self.params, self.grads, self.m, self.v, self.v_max, self.rows = [], [], [], [], [], []
        self.users: list[torch.Tensor] = []  # the parameters as the user holds them (DTensor or not)
        self.originals: list[torch.Tensor] = []  # a copied parameter's own weight and state
        self.layout = None  # the sharding layout of a DTensor group (mesh, sharded mesh dims)


def _is_kernel_layout(p: torch.Tensor, tensors) -> bool:
    """Whether the kernels can take ``p`` with ``tensors`` (its gradient and state): dense,
    contiguous, all of one shape."""
    if not p.is_contiguous():
        return False
    shape = p.shape
    for t in tensors:  # a loop, not all(): this runs for every parameter at every step
        if t.numel() and not (t.is_contiguous() and t.shape == shape):
            return False
    return True


class _Made:
    """What a step changed on the host before the device decides on its skip flag: the state
    entries it made (a first step) and the step counters it advanced; undone by ``settle_skip``
    when the flag said skip."""

    def __init__(self):
        self.entries: list[tuple[torch.Tensor, tuple[str, ...]]] = []  # (parameter, keys made)
        self.steps: list[torch.Tensor] = []


def _sgd_lists(optimizer, groups: dict, slow: list, made: _Made):
    for group in optimizer.param_groups:
        momentum = group["momentum"]
        rows = {first: sgd_row(group, first) for first in (False, True)}  # one list per row: one table row
        for p in group["params"]:
            if p.grad is None:
                continue
            g = _grad_of(optimizer, p)
            buf = None
            first = False
            if momentum != 0:
                state = optimizer.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    first = True
                    buf = state["momentum_buffer"] = torch.empty_like(p, memory_format=torch.preserve_format)
                    made.entries.append((p, ("momentum_buffer",)))
            _add(groups, slow, p, g, buf, None, None, rows[first])


def _adam_lists(optimizer, groups: dict, slow: list, made: _Made):
    decoupled_default = isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        decoupled = group.get("decoupled_weight_decay", decoupled_default)
        steps, members = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            g = _grad_of(optimizer, p)
            state = optimizer.state[p]
            if len(state) == 0:  # as torch's Adam._init_group
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                made.entries.append((p, tuple(state)))
            steps.append(state["step"])
            members.append((p, g, state))
        if not members:
            continue
        torch._foreach_add_(steps, 1)  # step_t += 1, on the counters' own device (the CPU: no wait)
        made.steps += steps
        values = read_host_resident(steps)
        rows: dict[float, list[float]] = {}
        for (p, g, state), step in zip(members, values):
            row = rows.get(step)
            if row is None:
                row = rows[step] = adam_row(group, step, decoupled)
            _add(groups, slow, p, g, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq"), row)


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _grad_of(optimizer, p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    if g.is_sparse:
        raise RuntimeError(f"gradfuse.optim.{type(optimizer).__name__}: a parameter of shape {tuple(p.shape)} has "
                           "a sparse gradient; the fused step takes dense gradients (torch.optim.SparseAdam takes "
                           "sparse ones)")
    return g


def _add(groups: dict, slow: list, p, g, m, v, v_max, row) -> None:
    lp, layout = distributed.local_and_layout("parameter", p)
    lg = distributed.local_tensor(g)
    state = [distributed.local_tensor(t) if t is not None else _empty(lp) for t in (m, v, v_max)]
    entry = (p, lp, lg, state, row, layout)
    if not _is_kernel_layout(lp, [lg, *state]):
        slow.append(entry)
        return
    # one group per sharding layout too: its rows are reduced over the layout's mesh in one block
    key = (layout_key(layout), lp.device, lp.dtype)
    lists = groups.get(key)
    if lists is None:
        lists = groups[key] = _Lists()
        lists.layout = layout
    lists.users.append(p)
    lists.params.append(lp)
    lists.grads.append(lg)
    lists.m.append(state[0])
    lists.v.append(state[1])
    lists.v_max.append(state[2])
    lists.rows.append(row)


def fused_step(optimizer, *, grad_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None,
               max_update_rms: float | None = None,
               stats: bool = False) -> tuple[list[StepRows], list[StepCoefs]]:
    """The step of ``optimizer`` (a ``gradfuse.optim`` optimizer), in place. Returns the rows of
    each (sharding layout, device, dtype) group when ``stats``, and the coefficients of each group
    with ``max_update_rms``. See ``gradfuse.optim.SGD.step``."""
    settle_skip(optimizer)
    rule = RULE_SGD if isinstance(optimizer, torch.optim.SGD) else RULE_ADAM
    groups: dict[tuple, _Lists] = {}
    slow: list = []
    made = _Made()
    (_sgd_lists if rule == RULE_SGD else _adam_lists)(optimizer, groups, slow, made)
    for entry in slow:  # a layout the kernels do not take: contiguous copies, written back below
        p, lp, lg, state, row, layout = entry
        lists = groups[("copy", id(p))] = _Lists()
        lists.layout = layout
        lists.users, lists.params, lists.grads = [p], [lp.contiguous()], [lg.contiguous()]
        lists.m, lists.v, lists.v_max = ([t.contiguous()] for t in state)
        lists.rows = [row]
        lists.originals = [lp, *state]
    threads = torch.get_num_threads()
    positions = per_parameter_positions(optimizer, grad_scale)
    out, out_coefs = [], []
    for lists in groups.values():
        device = lists.params[0].device
        coefs = _table(lists.rows)
        if device.type != "cpu":
            coefs = coefs.pin_memory().to(device, non_blocking=True)
        scale = None if grad_scale is None else grad_scale.to(device, non_blocking=True)
        if positions is not None:  # this group's scales, in its order
            where = torch.tensor([positions[id(p)] for p in lists.users])
            if device.type != "cpu":
                where = where.pin_memory().to(device, non_blocking=True)
            scale = scale.index_select(0, where)
        args = (lists.params, lists.grads, lists.m, lists.v, lists.v_max, coefs, rule,
                threads if device.type == "cpu" else 0)
        update_coefs = None
        if max_update_rms is not None:  # a first pass for each tensor's update RMS, then the step
            f, c = _whole(ops.multi_tensor_optim_step_(*args, grad_scale=scale, stats=True, write=False), lists)
            update_coefs = rms_limit_coefficient(f[:, UPDATE_SUMSQ], c[:, UPDATE_NUMEL], max_update_rms)
            out_coefs.append(StepCoefs(lists.users, update_coefs))
        flag = None if skip is None else skip.to(device, non_blocking=True)
        f, c = ops.multi_tensor_optim_step_(*args, grad_scale=scale, skip=flag, update_coefs=update_coefs,
                                            stats=stats)
        for original, copy in zip(lists.originals, (lists.params[0], lists.m[0], lists.v[0],
                                                                     lists.v_max[0])):
            if copy is not original and copy.numel():
                original.copy_(copy)
        if stats:
            out.append(StepRows(lists.users, *_whole((f, c), lists)))
    if skip is not None and (made.entries or made.steps):  # the host hears of the flag at the next step
        optimizer._pending_skip = (HostCopy([skip.reshape(())]), made)
    return out, out_coefs


def per_parameter_positions(optimizer, grad_scale: torch.Tensor | None) -> dict[int, int] | None:
    """Each parameter's index in ``grad_scale`` when it holds one scale per parameter (float64
    ``[N]``, in ``param_groups`` order); None for one scale for all."""
    if grad_scale is None or grad_scale.numel() == 1:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not (grad_scale.dtype == torch.float64 and grad_scale.dim() == 1 and grad_scale.shape[0] == len(params)):
        raise ValueError(f"grad_scale must be one element or float64 [{len(params)}] (one per parameter, in "
                         f"param_groups order), got {grad_scale.dtype} {list(grad_scale.shape)}")
    return {id(p): i for i, p in enumerate(params)}


def _table(rows: list[list[float]]) -> torch.Tensor:
    """The step's table, one row per tensor (float64, on the CPU). Tensors of one group at one
    step share one row list: one row built, repeated."""
    first = rows[0]
    if all(r is first for r in rows):
        return torch.tensor(first, dtype=torch.float64).expand(len(rows), -1).contiguous()
    return torch.tensor(rows, dtype=torch.float64)


def _whole(rows: tuple[torch.Tensor, torch.Tensor], lists: _Lists) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a group as those of the whole parameters: a DTensor group's summed over its
    sharded mesh dimensions (every column of the update rows is a sum)."""
    if lists.layout is None:
        return rows
    return distributed.sum_sharded_rows(*rows, lists.layout)


def with_amp_scaling(optimizer, grad_scale: torch.Tensor | None, skip: torch.Tensor | None):
    """The step's ``grad_scale`` and ``skip`` with what a ``GradScaler`` handed ``optimizer``
    (``scaler.step(optimizer)`` sets ``optimizer.grad_scale``, its scale while the gradients are
    still scaled, and ``optimizer.found_inf`` for an optimizer with ``_step_supports_amp_scaling``):
    the gradients are unscaled as the step reads them, by the inverse scale ``unscale_`` would
    multiply them by, and a step with an Inf / NaN is skipped on the device. No host read."""
    scale, found_inf = optimizer.__dict__.get("grad_scale"), optimizer.__dict__.get("found_inf")
    if scale is not None:
        inv = scale.double().reciprocal().float()  # GradScaler.unscale_'s inverse scale
        grad_scale = inv if grad_scale is None else grad_scale * inv.to(grad_scale.device)
    if found_inf is not None:
        flag = found_inf.reshape(()) != 0
        skip = flag if skip is None else skip.reshape(()).to(flag.device).bool() | flag
    return grad_scale, skip


def settle_skip(optimizer) -> None:
    """Applies the skip flag of ``optimizer``'s latest step to what the host changed for it: when
    the flag said skip, the step counters go back and the state a first step made is removed, so
    that weights, state and counters are those of a run that did not take the step. Reads the
    flag's host copy (made without blocking at that step); does nothing when there is none.
    The next step, ``state_dict`` and ``settle_skip`` itself call it."""
    pending = optimizer.__dict__.pop("_pending_skip", None)
    if pending is None:
        return
    copy, made = pending
    if not copy.get()[0].item():
        return
    if made.steps:
        torch._foreach_sub_(made.steps, 1)
    for p, keys in made.entries:
        state = optimizer.state.get(p)
        if state is None:
            continue
        for key in keys:
            state.pop(key, None)
        if not state:
            del optimizer.state[p]


def check_max_update_rms(name: str, max_update_rms) -> float | None:
    """``max_update_rms`` as a float (None stays None); ValueError unless a finite number > 0."""
    if max_update_rms is None:
        return None
    if not (isinstance(max_update_rms, (int, float)) and not isinstance(max_update_rms, bool) and max_update_rms > 0
            and math.isfinite(max_update_rms)):
        raise ValueError(f"{name}: max_update_rms must be a finite number > 0, got {max_update_rms!r}")
    return float(max_update_rms)
