"""The reference of the fused optimizer step (``multi_tensor_optim_step_``): torch's own SGD /
Adam / AdamW step, operation by operation as ``torch/optim/sgd.py`` and ``adam.py`` write it (the
for-loop form), with the gradient scale, the skip flag, update coefficients and the
update-statistics rows the op adds. It is the tests' yardstick for the kernels (bit for bit on the
CPU) and the fallback where the extension has no kernel. Unlike the kernels it reads the table,
the scale and the flag to the host, and it makes the temporaries torch's step makes.

Layer: ops. Imports ``gradfuse.ops.layout``, ``gradfuse.ops.update_reference``.
"""
from __future__ import annotations

import torch

from gradfuse.ops.layout import (
    NUM_STEP_COEFS,
    NUM_UPDATE_COUNT_STATS,
    NUM_UPDATE_FLOAT_STATS,
    RULE_ADAM,
    STEP_AMSGRAD,
    STEP_COLUMNS,
    STEP_DECOUPLED,
    STEP_FIRST,
    STEP_MAXIMIZE,
    STEP_NESTEROV,
    UPDATE_COUNT_NAMES,
    UPDATE_FLOAT_NAMES,
)
from gradfuse.ops.update_reference import check_rule, check_update_inputs, describe


def check_step_inputs(op: str, params, grads, moment1, moment2, moment2_max, coefs: torch.Tensor, rule: int,
                      grad_scale, skip, update_coefs) -> None:
    """Raises RuntimeError unless the arguments are as the op's contract says (the compiled op's
    checks, ``csrc/common/engine.h`` ``check_step_args``, with the same messages)."""
    check_rule(op, rule)
    check_update_inputs(op, params, grads, moment1, moment2, moment2_max, coefs, table=("coefs", NUM_STEP_COEFS))
    n = len(params)
    device = params[0].device if n else coefs.device
    if rule == RULE_ADAM:
        for i in range(n):
            if params[i].numel() and not (moment1[i].numel() and moment2[i].numel()):
                raise RuntimeError(f"{op}: Adam's step needs moment1[{i}] and moment2[{i}] (exp_avg, exp_avg_sq), "
                                   f"got {describe(moment1[i])} and {describe(moment2[i])}")
    if grad_scale is not None and not ((grad_scale.numel() == 1 or grad_scale_per_tensor(grad_scale, n))
                                       and grad_scale.device == device):
        raise RuntimeError(f"{op}: grad_scale must be a one-element tensor or a float64 [{n}] tensor on {device}, "
                           f"got {describe(grad_scale)}")
    if skip is not None and not (skip.numel() == 1 and skip.device == device):
        raise RuntimeError(f"{op}: skip must be a one-element tensor on {device}, got {describe(skip)}")
    if grad_scale is not None and not grad_scale.is_floating_point():
        raise RuntimeError(f"{op}: grad_scale must be a floating-point tensor, got {describe(grad_scale)}")
    if update_coefs is not None and not (update_coefs.dtype == torch.float64 and update_coefs.dim() == 1
                                         and update_coefs.shape[0] == n and update_coefs.device == device):
        raise RuntimeError(f"{op}: update_coefs must be a float64 [{n}] tensor on {device}, got "
                           f"{describe(update_coefs)}")


def grad_scale_per_tensor(grad_scale: torch.Tensor | None, n: int) -> bool:
    """Whether the step's ``grad_scale`` is one per tensor (float64 ``[n]``, n > 1) rather than one
    for all."""
    return (grad_scale is not None and n > 1 and grad_scale.dtype == torch.float64 and grad_scale.dim() == 1
            and grad_scale.shape[0] == n)


def _step_one(rule: int, row: dict, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
              v_max: torch.Tensor):
    """Torch's step of one parameter, in place. Returns ``(m', root)``: the first moment (or
    momentum buffer) after the step, and Adam's bias-corrected root (None for SGD)."""
    flags = int(row["flags"])
    if flags & STEP_MAXIMIZE:
        g = -g
    wd = row["weight_decay"]
    if rule == RULE_ADAM:
        if wd != 0:
            if flags & STEP_DECOUPLED:
                p.mul_(row["decay_factor"])
            else:
                g = g.add(p, alpha=wd)
        m.lerp_(g, row["lerp_weight"])
        v.mul_(row["beta2"]).addcmul_(g, g, value=row["one_minus_beta2"])
        used = v
        if flags & STEP_AMSGRAD:
            torch.maximum(v_max, v, out=v_max)
            used = v_max
        root = used.sqrt() / row["bc2_sqrt"]
        denom = root.clone().add_(row["eps"])
        p.addcdiv_(m, denom, value=row["neg_step_size"])
        return m, root
    if wd != 0:
        g = g.add(p, alpha=wd)
    buf = None
    if row["momentum"] != 0:
        if flags & STEP_FIRST:
            m.copy_(g)
        else:
            m.mul_(row["momentum"]).add_(g, alpha=row["damp_alpha"])
        buf = m
        g = g.add(m, alpha=row["momentum"]) if flags & STEP_NESTEROV else m
    p.add_(g, alpha=row["neg_lr"])
    return buf, None


def multi_tensor_optim_step_(params, grads, moment1, moment2, moment2_max, coefs: torch.Tensor, rule: int,
                             torch_threads: int = 0, grad_scale=None, skip=None, update_coefs=None,
                             stats: bool = False, write: bool = True):
    """The op (``gradfuse.ops.multi_tensor_optim_step_``) with torch's own operations."""
    check_step_inputs("multi_tensor_optim_step_", params, grads, moment1, moment2, moment2_max, coefs, rule,
                      grad_scale, skip, update_coefs)
    n = len(params)
    device = params[0].device if n else coefs.device
    floats = torch.zeros((n if stats else 0, NUM_UPDATE_FLOAT_STATS), dtype=torch.float64, device=device)
    counts = torch.zeros((n if stats else 0, NUM_UPDATE_COUNT_STATS), dtype=torch.int64, device=device)
    if skip is not None and bool(skip.reshape(()).item()):
        write = False
    if n == 0 or not (write or stats):
        return floats, counts
    table = coefs.tolist()
    scales = (None if grad_scale is None else grad_scale.tolist() if grad_scale_per_tensor(grad_scale, n)
              else [float(grad_scale.reshape(()).item())] * n)
    ucoefs = None if update_coefs is None else update_coefs.tolist()
    for i in range(n):
        row = dict(zip(STEP_COLUMNS, table[i]))
        p, g = params[i], grads[i]
        # the step runs on copies when nothing is written, or when its update is to be rescaled
        w = p if write else p.clone()
        m = moment1[i] if write else moment1[i].clone()
        v = moment2[i] if write else moment2[i].clone()
        x = moment2_max[i] if write else moment2_max[i].clone()
        acc = torch.float64 if p.dtype == torch.float64 else torch.float32  # the kernels' arithmetic
        if scales is not None:
            g = (g.to(acc) * torch.tensor(scales[i], dtype=acc)).to(g.dtype)
        before = w.clone()
        buf, root = _step_one(rule, row, w, g, m, v, x)
        if ucoefs is not None and ucoefs[i] < 1:
            wb = before.to(acc)
            w.copy_(wb + (w.to(acc) - wb) * torch.tensor(ucoefs[i], dtype=acc))
        if stats:
            floats[i], counts[i] = _stats_row(rule, row, before, w, buf, v if not int(row["flags"]) & STEP_AMSGRAD
                                              else x, root)
    return floats, counts


def _stats_row(rule: int, row: dict, before: torch.Tensor, after: torch.Tensor, buf, v, root):
    """The update-statistics row of one parameter (columns of ``multi_tensor_update_stats``), in
    float64."""
    u = after.double() - before.double()
    w = before.double()
    m = buf.double() if buf is not None else torch.zeros_like(w)
    r = root.double() if root is not None else torch.zeros_like(w)
    vv = v.double() if rule == RULE_ADAM else torch.zeros_like(w)
    eps = float(torch.tensor(row["eps"], dtype=torch.float64).to(before.dtype))
    f = {"update_sumsq": u.square().sum(), "weight_sumsq": w.square().sum(), "moment1_sumsq": m.square().sum(),
         "moment2_sumsq": r.square().sum()}
    c = {"update_nonfinite": (~u.isfinite()).sum(), "weight_nonfinite": (~w.isfinite()).sum(),
         "moment_nonfinite": (~(m.isfinite() & vv.isfinite())).sum(),
         "eps_dominated": (r < eps).sum() if rule == RULE_ADAM else torch.zeros((), dtype=torch.int64),
         "numel": torch.tensor(before.numel())}
    return (torch.stack([f[k] for k in UPDATE_FLOAT_NAMES]).to(torch.float64),
            torch.stack([c[k].to(torch.int64) for k in UPDATE_COUNT_NAMES]))
