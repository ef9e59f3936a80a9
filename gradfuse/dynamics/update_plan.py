"""The optimizer's update, per parameter, from the fused update op: what ``optimizer.step()`` is
about to apply, without forming it.

``plan_updates`` gathers, per optimizer, parameter group and (sharding layout, device, dtype), the
parameters that have a gradient, their gradients and the optimizer's state (an empty tensor where
the state does not exist yet), builds the table of hyper-parameters on the parameters' device and
calls ``gradfuse.ops.multi_tensor_update_stats``: one pass over the weights, the gradients and the
state, no temporaries as large as the parameters. The formulas are torch's own
(``torch/optim/sgd.py``, ``adam.py``, written once in ``csrc/common/update_math.h``), so the
result equals ``w_after - w_before`` of the real step within float rounding:

- SGD: ``d = g + wd * w`` (``g = -grad`` with ``maximize``); with momentum
  ``buf' = d`` on the first step else ``momentum * buf + (1 - dampening) * d``, and
  ``d = d + momentum * buf'`` (nesterov) or ``d = buf'``; update ``-lr * d``.
- Adam / AdamW: ``t = step + 1``, ``g`` as above (plus ``wd * w`` for Adam's L2 weight decay),
  ``m' = beta1 m + (1 - beta1) g``, ``v' = beta2 v + (1 - beta2) g^2`` (amsgrad: ``max(v_max, v')``),
  update ``-lr / (1 - beta1^t) * m' / (sqrt(v') / sqrt(1 - beta2^t) + eps)``, minus
  ``lr * wd * w`` for decoupled weight decay (AdamW, or ``Adam(decoupled_weight_decay=True)``).

Every variant torch has for these runs: ``foreach`` and ``fused``, ``capturable`` (its step
counters stay on the device and are stacked there), a tensor ``lr`` (copied on the device, never
read), the first step (no state yet). Subclasses are taken to apply their base class's update.
Nothing is read to the host but the CPU step counters of a non-capturable Adam (CPU tensors:
no wait for a device).

DTensor parameters (FSDP2 ``fully_shard``, tensor parallel): the op runs on the local shards of
the parameter, gradient and state, and the rows of each sharding layout are summed over its
sharded mesh dimensions (every column is a sum), in one collective per sharded mesh dimension
(``gradfuse.core.distributed.sum_sharded_rows``, which the fused optimizer step's rows share).

Layer: dynamics. Imports ``gradfuse.ops`` and ``gradfuse.core``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gradfuse import ops
from gradfuse.core import distributed
from gradfuse.core.sharded import layout_key
from gradfuse.ops.layout import (
    EPS_DOMINATED,
    FLAG_AMSGRAD,
    FLAG_DECOUPLED,
    FLAG_MAXIMIZE,
    FLAG_NESTEROV,
    HYPER_STEP,
    MOMENT1_SUMSQ,
    MOMENT2_SUMSQ,
    MOMENT_NONFINITE,
    NUM_UPDATE_COUNT_STATS,
    NUM_UPDATE_FLOAT_STATS,
    RULE_ADAM,
    RULE_SGD,
    UPDATE_NONFINITE,
    UPDATE_NUMEL,
    UPDATE_SUMSQ,
    WEIGHT_NONFINITE,
    WEIGHT_SUMSQ,
)

SUPPORTED = ("SGD", "Adam", "AdamW")


def unavailable_reason(optimizer) -> str | None:
    """None when the update of ``optimizer`` can be computed, else why not."""
    kind = type(optimizer)
    # AdamW is listed on its own: before torch 2.7 it is not a subclass of Adam (torch 2.6's
    # adamw.py is its own class, with the same update as Adam's plus decoupled weight decay).
    if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)):
        return (f"update ratios are not available for {kind.__name__}: gradfuse computes the update from "
                f"the optimizer's state for {', '.join(SUPPORTED)} only")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.is_complex() or (p.grad is not None and p.grad.is_sparse):
                return "update ratios are not available for complex parameters or sparse gradients"
    return None


def rule_of(optimizer) -> int:
    """The op's ``rule`` for ``optimizer``: ``RULE_SGD`` or ``RULE_ADAM`` (Adam and AdamW)."""
    return RULE_SGD if isinstance(optimizer, torch.optim.SGD) else RULE_ADAM


def _flags(optimizer, group: dict) -> int:
    flags = FLAG_MAXIMIZE if group.get("maximize", False) else 0
    if isinstance(optimizer, torch.optim.SGD):
        return flags | (FLAG_NESTEROV if group.get("nesterov", False) else 0)
    flags |= FLAG_AMSGRAD if group.get("amsgrad", False) else 0
    # torch < 2.7: AdamW has no decoupled_weight_decay key; it always decouples
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    return flags | (FLAG_DECOUPLED if decoupled else 0)


def _hyper_values(optimizer, group: dict) -> list:
    """The group's row of the hyper table but the step: numbers, or tensors (a tensor ``lr``)."""
    if isinstance(optimizer, torch.optim.SGD):
        b1, b2, eps = group["momentum"], group["dampening"], 0.0
    else:
        (b1, b2), eps = group["betas"], group["eps"]
    return [group["lr"], group["weight_decay"], b1, b2, eps, 0.0, float(_flags(optimizer, group))]


def _hyper_table(optimizer, group: dict, states: list[dict], device: torch.device) -> torch.Tensor:
    """float64 ``[n, NUM_HYPER]`` on ``device`` for parameters whose state is ``states``, built
    without reading a device tensor: tensor values are copied on the device."""
    values = _hyper_values(optimizer, group)
    n = len(states)
    on_device = {}
    row = []
    for k, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            on_device[k] = v
            row.append(0.0)
        else:
            row.append(float(v))
    steps_here = None
    if isinstance(optimizer, torch.optim.SGD):
        steps = [0.0] * n
    else:
        counters = [st.get("step") for st in states]
        if all(c is None or not isinstance(c, torch.Tensor) or c.device.type == "cpu" for c in counters):
            # non-capturable Adam: CPU step counters, read without waiting for a device
            steps = [(0.0 if c is None else float(c)) + 1.0 for c in counters]
        else:  # capturable or fused: the counters are on the device, stacked there
            steps = [0.0] * n
            steps_here = torch.stack([torch.zeros((), dtype=torch.float64, device=device) if c is None
                                      else torch.as_tensor(c).reshape(()).to(device, torch.float64)
                                      for c in counters]) + 1.0
    table = torch.tensor(row, dtype=torch.float64).repeat(n, 1)
    table[:, HYPER_STEP] = torch.tensor(steps, dtype=torch.float64)
    table = table.to(device)
    for k, v in on_device.items():
        table[:, k] = v.detach().reshape(()).to(device, torch.float64)
    if steps_here is not None:
        table[:, HYPER_STEP] = steps_here
    return table


_STATE_KEYS = {RULE_SGD: ("momentum_buffer", None, None), RULE_ADAM: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}


def _dense(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` as the op takes it: a contiguous tensor of ``like``'s dtype (torch's own state and
    gradients already are; a copy only for those that are not)."""
    t = distributed.local_tensor(t).detach()
    if t.dtype != like.dtype:
        t = t.to(like.dtype)
    return t if t.is_contiguous() else t.contiguous()


@dataclass
class _Call:
    """One call of the op: an optimizer's parameter group, one (layout, device, dtype)."""
    optimizer: torch.optim.Optimizer
    rule: int
    params: list
    hyper: torch.Tensor
    layout: object
    start: int
    stop: int


def _state_lists(call: _Call, locals_: list[torch.Tensor]):
    """(moment1, moment2, moment2_max) lists of ``call``'s parameters, as the optimizer's state
    holds them now (an empty tensor where a state is absent)."""
    empty = locals_[0].new_empty(0)
    out = ([], [], [])
    for p, w in zip(call.params, locals_):
        st = call.optimizer.state.get(p, {})
        for lst, key in zip(out, _STATE_KEYS[call.rule]):
            t = st.get(key) if key is not None else None
            lst.append(empty if t is None else _dense(t, w))
    return out


def _tensors(call: _Call):
    """(params, grads) of ``call`` as local contiguous tensors."""
    params = [distributed.local_tensor(p).detach() for p in call.params]
    grads = [_dense(p.grad, w) for p, w in zip(call.params, params)]
    return params, grads


@dataclass
class UpdateRows:
    """The update statistics of every parameter an optimizer's step will change now.

    Attributes:
        params (list): The parameters, in the order of the rows (those with a gradient).
        floats (torch.Tensor): float64 ``[n, NUM_UPDATE_FLOAT_STATS]`` (``UPDATE_FLOAT_COLUMNS``),
            on the first parameter's device.
        counts (torch.Tensor): int64 ``[n, NUM_UPDATE_COUNT_STATS]`` (``UPDATE_COUNT_COLUMNS``).
        adam (list[bool]): Whether each row's optimizer is Adam / AdamW (second moment, eps).
        moment1 (list[bool]): Whether each row has a first moment (Adam, SGD with momentum).
        calls (list): The op calls that took the rows (optimizer, parameter group, sharding
            layout, device and dtype, with their hyper table): ``clip_applied_updates_`` makes the
            same calls after the step.
    """
    params: list = field(default_factory=list)
    floats: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    adam: list = field(default_factory=list)
    moment1: list = field(default_factory=list)
    calls: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.params)

    def rms(self) -> torch.Tensor:
        """Per row, the update's RMS ``sqrt(update_sumsq / numel)`` (float64, on the rows'
        device; NaN for an empty parameter)."""
        return (self.floats[:, UPDATE_SUMSQ] / self.counts[:, UPDATE_NUMEL].to(torch.float64)).sqrt()


def plan_updates(optimizers) -> UpdateRows:
    """The update statistics of what ``optimizer.step()`` of each of ``optimizers`` is about to
    apply (module docstring), per parameter with a gradient; a parameter in several optimizers
    counts once (its first). Call it right before the step (after any clipping).

    Raises:
        NotImplementedError: an optimizer it does not know (``unavailable_reason``).
    """
    out = UpdateRows()
    seen: set[int] = set()
    floats, counts = [], []
    device = None
    with torch.no_grad():
        for opt in optimizers:
            reason = unavailable_reason(opt)
            if reason:
                raise NotImplementedError(reason)
            rule = rule_of(opt)
            for group in opt.param_groups:
                groups: dict[tuple, list] = {}
                for p in group["params"]:
                    if p.grad is None or id(p) in seen:
                        continue
                    seen.add(id(p))
                    local, layout = distributed.local_and_layout("parameter", p)
                    groups.setdefault((layout_key(layout), local.device, local.dtype), (layout, []))[1].append(p)
                for (_key, dev, _dtype), (layout, params) in groups.items():
                    device = dev if device is None else device
                    states = [opt.state.get(p, {}) for p in params]
                    hyper = _hyper_table(opt, group, states, dev)
                    call = _Call(opt, rule, params, hyper, layout, len(out.params), len(out.params) + len(params))
                    locals_, grads = _tensors(call)
                    m1, m2, m2max = _state_lists(call, locals_)
                    f, c = ops.multi_tensor_update_stats(locals_, grads, m1, m2, m2max, hyper, rule)
                    if layout is not None:
                        f, c = distributed.sum_sharded_rows(f, c, layout)
                    floats.append(f.to(device))
                    counts.append(c.to(device))
                    out.params += params
                    out.calls.append(call)
                    momentum = rule == RULE_ADAM or group["momentum"] != 0
                    out.adam += [rule == RULE_ADAM] * len(params)
                    out.moment1 += [momentum] * len(params)
    if floats:
        out.floats = floats[0] if len(floats) == 1 else torch.cat(floats)
        out.counts = counts[0] if len(counts) == 1 else torch.cat(counts)
    else:
        out.floats = torch.zeros((0, NUM_UPDATE_FLOAT_STATS), dtype=torch.float64)
        out.counts = torch.zeros((0, NUM_UPDATE_COUNT_STATS), dtype=torch.int64)
    return out


def clip_applied_updates_(rows: UpdateRows, coefs: torch.Tensor, optimizer=None) -> None:
    """After the step that ``rows`` planned: rescales the update just applied to parameter i by
    ``coefs[i]`` where it is below 1 (``w = w_before + c * u``; NaN or >= 1: untouched, decided
    on the device), from the state the step left, with ``gradfuse.ops.multi_tensor_update_clip_``:
    one more pass over the weights, gradients and state of each group, no copy of the weights.
    ``optimizer``: only the parameters of that optimizer (the one that just stepped)."""
    with torch.no_grad():
        for call in rows.calls:
            if optimizer is not None and call.optimizer is not optimizer:
                continue
            locals_, grads = _tensors(call)
            m1, m2, m2max = _state_lists(call, locals_)
            c = coefs[call.start:call.stop].to(call.hyper.device, torch.float64)
            targets = [w if w.is_contiguous() else w.contiguous() for w in locals_]
            ops.multi_tensor_update_clip_(targets, grads, m1, m2, m2max, call.hyper, c, call.rule)
            for w, t in zip(locals_, targets):
                if t is not w:
                    w.copy_(t)


# ---- Per layer: the one place the rows become the per-layer values.

LAYER_FIELDS = ("update_ratio", "weight_norm", "update_norm", "update_rms", "moment1_rms", "moment2_rms",
                "eps_dominated", "update_nonfinite", "moment_nonfinite", "weight_nonfinite")


def layer_values(rows: UpdateRows, ids: torch.Tensor, num_layers: int,
                 applied: bool | torch.Tensor = True) -> torch.Tensor:
    """float64 ``[num_layers, len(LAYER_FIELDS)]`` on the rows' device: per layer (``ids``: the
    layer index of each row, ``num_layers`` for a row outside the layers), no host read.

    - ``update_ratio`` = |u| / |w| (inf for zero weights, 0 when the update is 0 too),
      ``weight_norm``, ``update_norm`` (L2 over the layer's parameters), ``update_rms`` =
      sqrt(sum u^2 / numel);
    - ``moment1_rms``: RMS of the first moment after the step (Adam's ``exp_avg``, SGD's momentum
      buffer), over the layer's parameters that have one; ``moment2_rms``: RMS of Adam's
      bias-corrected root sqrt(v') / sqrt(1 - beta2^t); ``eps_dominated``: the fraction of Adam's
      elements whose root is below ``eps``;
    - ``update_nonfinite``, ``moment_nonfinite``, ``weight_nonfinite``: NaN / Inf element counts.

    NaN where a value does not apply (no parameter with that state in the layer). ``applied``
    False (the step is skipped): the update is 0 and the moments NaN; a 0-d bool tensor: the
    same, decided on the device (a step whose skip the host has not read).
    """
    dev = rows.floats.device
    f, c = rows.floats, rows.counts.to(torch.float64)
    numel = c[:, UPDATE_NUMEL]
    m1_mask = torch.tensor(rows.moment1, dtype=torch.float64).to(dev)
    adam_mask = torch.tensor(rows.adam, dtype=torch.float64).to(dev)
    on = applied.to(dev) if isinstance(applied, torch.Tensor) else None
    u2, bad_u = f[:, UPDATE_SUMSQ], c[:, UPDATE_NONFINITE]
    if on is not None:
        u2, bad_u = torch.where(on, u2, 0.0), torch.where(on, bad_u, 0.0)
    elif not applied:
        u2, bad_u = torch.zeros_like(numel), torch.zeros_like(numel)
    cols = torch.stack([u2, f[:, WEIGHT_SUMSQ], f[:, MOMENT1_SUMSQ] * m1_mask, f[:, MOMENT2_SUMSQ] * adam_mask,
                        numel, numel * m1_mask, numel * adam_mask, c[:, EPS_DOMINATED] * adam_mask,
                        bad_u, c[:, MOMENT_NONFINITE], c[:, WEIGHT_NONFINITE]], 1)
    sums = torch.zeros((num_layers + 1, cols.shape[1]), dtype=torch.float64, device=dev)
    sums = sums.index_add_(0, ids.to(dev), cols)[:-1]
    lu2, lw2, lm1, lm2, n, n1, na, eps, bad_u, bad_m, bad_w = sums.unbind(1)
    u, w = lu2.sqrt(), lw2.sqrt()
    nan = torch.full_like(u, math.nan)
    ratio = torch.where(w > 0, u / w, torch.where(u == 0, 0.0, math.inf))
    moments = (torch.where(n1 > 0, (lm1 / n1).sqrt(), nan), torch.where(na > 0, (lm2 / na).sqrt(), nan),
               torch.where(na > 0, eps / na, nan))
    if on is not None:
        moments = tuple(torch.where(on, m, nan) for m in moments)
    elif not applied:
        moments = (nan, nan, nan)
    return torch.stack([ratio, w, u, torch.where(n > 0, (lu2 / n).sqrt(), nan), *moments, bad_u, bad_m, bad_w], 1)
