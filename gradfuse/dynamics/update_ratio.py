"""Update-to-weight ratios per layer: |w_after - w_before| / |w_before|, and the weight norms.

Taken right before ``optimizer.step()`` (where the monitor runs), from what the step is about to
apply: the gradients after clipping, the optimizer's hyper-parameters and its state. The formulas
are torch's own (``torch/optim/sgd.py``, ``adam.py``), so the result equals the applied update
within float rounding (its fp32/bf16 rounding when added to the weights):

- SGD: ``d = g + wd * w`` (``g = -grad`` with ``maximize``); with momentum
  ``buf' = d`` on the first step else ``momentum * buf + (1 - dampening) * d``, and
  ``d = d + momentum * buf'`` (nesterov) or ``d = buf'``; update ``-lr * d``.
- Adam / AdamW: ``t = step + 1``, ``g`` as above (plus ``wd * w`` for Adam's L2 weight decay),
  ``m' = beta1 m + (1 - beta1) g``, ``v' = beta2 v + (1 - beta2) g^2`` (amsgrad: ``max(v_max, v')``),
  update ``-lr / (1 - beta1^t) * m' / (sqrt(v') / sqrt(1 - beta2^t) + eps)``, minus
  ``lr * wd * w`` for decoupled weight decay (AdamW, or ``Adam(decoupled_weight_decay=True)``).

Subclasses of these are taken to apply their base class's update (e.g. one that records
something and calls ``super().step()``). Other optimizers: "not available", said once.

Cost, on logging steps only: two fused stats passes (the weights, the updates), plus the
elementwise work that forms the updates (``torch._foreach_*``: none beyond the update itself for
plain SGD, a handful of foreach ops for momentum and Adam) in temporaries freed right after.
"""
from __future__ import annotations

import math

import torch

from gradfuse.core.engine import fused_stats
from gradfuse.core.layers import layer_of
from gradfuse.ops.layout import SUMSQ

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


def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _sgd_updates(group: dict, state: dict, params, grads) -> list[torch.Tensor]:
    lr, wd = _scalar(group["lr"]), _scalar(group["weight_decay"])
    momentum, dampening = _scalar(group["momentum"]), _scalar(group["dampening"])
    if group.get("maximize", False):
        grads = torch._foreach_neg(grads)
    d = torch._foreach_add(grads, params, alpha=wd) if wd != 0 else list(grads)
    if momentum != 0:
        bufs = [state.get(p, {}).get("momentum_buffer") for p in params]
        if all(b is not None for b in bufs):  # one foreach op each, not one op per tensor
            new = torch._foreach_mul(bufs, momentum)
            torch._foreach_add_(new, d, alpha=1 - dampening)
        else:  # the first step: the buffer starts as the gradient
            new = [di.clone() if b is None else b.mul(momentum).add_(di, alpha=1 - dampening)
                   for b, di in zip(bufs, d)]
        d = torch._foreach_add(d, new, alpha=momentum) if group.get("nesterov", False) else new
    return list(torch._foreach_mul(d, -lr))


def _adam_updates(group: dict, state: dict, params, grads, decoupled_default: bool) -> list[torch.Tensor]:
    lr, wd, eps = _scalar(group["lr"]), _scalar(group["weight_decay"]), _scalar(group["eps"])
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    decoupled = group.get("decoupled_weight_decay", decoupled_default)
    if group.get("maximize", False):
        grads = torch._foreach_neg(grads)
    if wd != 0 and not decoupled:
        grads = torch._foreach_add(grads, params, alpha=wd)
    states = [state.get(p, {}) for p in params]
    steps = [(_scalar(st["step"]) if "step" in st else 0.0) + 1.0 for st in states]
    if all("exp_avg" in st and "exp_avg_sq" in st for st in states):  # foreach: a few ops in all
        m = torch._foreach_lerp([st["exp_avg"] for st in states], grads, 1 - beta1)
        v = torch._foreach_mul([st["exp_avg_sq"] for st in states], beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    else:  # the first step: moments start at zero
        m = [g.mul(1 - beta1) if "exp_avg" not in st else st["exp_avg"].lerp(g, 1 - beta1)
             for st, g in zip(states, grads)]
        v = [g.square().mul_(1 - beta2) if "exp_avg_sq" not in st
             else st["exp_avg_sq"].mul(beta2).addcmul_(g, g, value=1 - beta2) for st, g in zip(states, grads)]
    m, v = list(m), list(v)
    if group.get("amsgrad", False):
        for i, st in enumerate(states):
            if st.get("max_exp_avg_sq") is not None:
                v[i] = torch.maximum(st["max_exp_avg_sq"], v[i])
    torch._foreach_sqrt_(v)
    torch._foreach_div_(v, [math.sqrt(1 - beta2 ** t) for t in steps])
    torch._foreach_add_(v, eps)
    torch._foreach_div_(m, v)
    torch._foreach_mul_(m, [-lr / (1 - beta1 ** t) for t in steps])
    if wd != 0 and decoupled:
        torch._foreach_add_(m, params, alpha=-lr * wd)
    return m


def planned_updates(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, update)`` for every parameter ``optimizer.step()`` will change now (those
    with a gradient), the update computed as the step computes it (module docstring). Raises
    ``NotImplementedError`` for optimizers it does not know (``unavailable_reason``)."""
    reason = unavailable_reason(optimizer)
    if reason:
        raise NotImplementedError(reason)
    out = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if isinstance(optimizer, torch.optim.SGD):
                ups = _sgd_updates(group, optimizer.state, params, grads)
            else:
                ups = _adam_updates(group, optimizer.state, params, grads,
                                    isinstance(optimizer, torch.optim.AdamW))
            out.extend(zip(params, ups))
    return out


def _sumsq_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor sum of squares (float64, on the first tensor's device): one fused stats pass per
    (device, dtype) group, in the order of ``tensors``."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    keys = [str(i) for i in range(len(tensors))]
    s = fused_stats(keys, [t.detach() for t in tensors], 2.0, what="tensor", elementwise_zero_norm=True)
    sumsq = s.floats[:, SUMSQ]
    if s.names != keys:  # several (device, dtype) groups: rows come group by group
        order = torch.tensor([int(n) for n in s.names], device=sumsq.device)
        sumsq = torch.empty_like(sumsq).index_copy_(0, order, sumsq)
    return sumsq.to(tensors[0].device)


class UpdateRatios:
    """Per-layer update and weight norms of the parameters of ``optimizers``, named through
    ``names_by_param`` (id -> name; others ``group{g}.{i}``) and grouped into layers as
    ``GradStats.layers`` groups them (``layer_depth``)."""

    def __init__(self, optimizers, names_by_param: dict[int, str] | None = None,
                 layer_depth: int | None = None):
        self.optimizers = list(optimizers)
        self.layer_depth = layer_depth
        self.names_by_param = dict(names_by_param or {})
        reasons = [r for r in (unavailable_reason(o) for o in self.optimizers) if r]
        self.unavailable = reasons[0] if reasons else None
        self.passes = 0  # fused stats passes taken (2 per capture)

    def _name(self, k: int, g: int, i: int, p) -> str:
        prefix = f"opt{k}." if len(self.optimizers) > 1 else ""
        return self.names_by_param.get(id(p)) or f"{prefix}group{g}.{i}"

    def capture(self, applied: bool = True) -> dict | None:
        """Device tensors of this step, before ``optimizer.step()``: ``names``, per parameter
        ``weight_sumsq`` and ``update_sumsq`` (float64). ``applied=False``: the step will be
        skipped, the updates are 0. None when not available."""
        if self.unavailable:
            return None
        names, weights, seen = [], [], set()
        index = {}
        for k, opt in enumerate(self.optimizers):
            for g, group in enumerate(opt.param_groups):
                for i, p in enumerate(group["params"]):
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    index[id(p)] = len(names)
                    names.append(self._name(k, g, i, p))
                    weights.append(p.detach())
        if not weights:
            return None
        weight_sumsq = _sumsq_rows(weights)
        self.passes += 1
        update_sumsq = torch.zeros_like(weight_sumsq)
        if applied:
            pairs = [pu for opt in self.optimizers for pu in planned_updates(opt)]
            if pairs:
                rows = _sumsq_rows([u for _, u in pairs])
                self.passes += 1
                where = torch.tensor([index[id(p)] for p, _ in pairs], device=update_sumsq.device)
                update_sumsq.index_copy_(0, where, rows.to(update_sumsq.device))
        return {"names": names, "weight_sumsq": weight_sumsq, "update_sumsq": update_sumsq}

    def layers(self, captured: dict) -> dict[str, dict[str, float]]:
        """``{"update_ratio": {layer: |u| / |w|}, "weight_norm": {layer: |w|}, "update_norm":
        {layer: |u|}}`` (one transfer). A layer of zero weights has ratio inf (0 when its update
        is 0 too)."""
        host = torch.stack([captured["weight_sumsq"], captured["update_sumsq"]]).cpu().tolist()
        w2: dict[str, float] = {}
        u2: dict[str, float] = {}
        for name, w, u in zip(captured["names"], host[0], host[1]):
            key = layer_of(name, self.layer_depth)
            w2[key] = w2.get(key, 0.0) + w
            u2[key] = u2.get(key, 0.0) + u
        out = {"update_ratio": {}, "weight_norm": {}, "update_norm": {}}
        for key in w2:
            w, u = math.sqrt(w2[key]), math.sqrt(u2[key])
            out["weight_norm"][key] = w
            out["update_norm"][key] = u
            out["update_ratio"][key] = u / w if w > 0 else (0.0 if u == 0 else math.inf)
        return out
