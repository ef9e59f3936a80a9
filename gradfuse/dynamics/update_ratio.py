"""Update-to-weight ratios and the optimizer's statistics per layer: |w_after - w_before| / |w_before|,
the weight and update norms, the update's RMS, the RMS of the optimizer's moments, the fraction of
Adam's elements whose denominator is mostly ``eps``, and non-finite counts.

Taken right before ``optimizer.step()`` (where the monitor runs), from what the step is about to
apply: the gradients after clipping, the optimizer's hyper-parameters and its state, by the fused
update op (``gradfuse.dynamics.update_plan``, torch's own formulas), so the result equals the
applied update within float rounding. SGD, Adam, AdamW (and their subclasses); other optimizers:
"not available", said once.

Cost: one fused pass over the weights, the gradients and the optimizer's state per (device,
dtype) group of each parameter group, no temporaries (plus one stats pass over the weights of
parameters without a gradient, where there are any).
"""
from __future__ import annotations

import math

import torch

from gradfuse.core.engine import fused_stats
from gradfuse.core.host_copy import HostCopy
from gradfuse.core.layers import layer_of
from gradfuse.dynamics.update_plan import (
    LAYER_FIELDS,
    SUPPORTED,
    UpdateRows,
    layer_values,
    plan_updates,
    unavailable_reason,
)
from gradfuse.ops.layout import (
    INF,
    NAN,
    NUM_UPDATE_COUNT_STATS,
    NUM_UPDATE_FLOAT_STATS,
    NUMEL,
    SUMSQ,
    UPDATE_NUMEL,
    WEIGHT_NONFINITE,
    WEIGHT_SUMSQ,
)

__all__ = ["LAYER_FIELDS", "SUPPORTED", "UpdateRatios", "unavailable_reason"]

# The per-layer values that are counts (ints in a record).
COUNT_FIELDS = ("update_nonfinite", "moment_nonfinite", "weight_nonfinite")


def _weights_only(params: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of parameters the step leaves alone (no gradient): the weight's sum of squares and
    non-finite count, an update of 0 (one fused stats pass)."""
    keys = [str(i) for i in range(len(params))]
    s = fused_stats(keys, [p.detach() for p in params], 2.0, what="tensor", elementwise_zero_norm=True)
    order = torch.tensor([int(n) for n in s.names], device=s.floats.device)
    floats = torch.zeros((len(params), NUM_UPDATE_FLOAT_STATS), dtype=torch.float64, device=s.floats.device)
    counts = torch.zeros((len(params), NUM_UPDATE_COUNT_STATS), dtype=torch.int64, device=s.floats.device)
    floats[order, WEIGHT_SUMSQ] = s.floats[:, SUMSQ].to(torch.float64)
    counts[order, WEIGHT_NONFINITE] = s.counts[:, NAN] + s.counts[:, INF]
    counts[order, UPDATE_NUMEL] = s.counts[:, NUMEL]
    return floats.to(device), counts.to(device)


class UpdateRatios:
    """Per-layer update and weight statistics of the parameters of ``optimizers``, named through
    ``names_by_param`` (id -> name; others ``group{g}.{i}``) and grouped into layers as
    ``GradStats.layers`` groups them (``layer_depth``)."""

    def __init__(self, optimizers, names_by_param: dict[int, str] | None = None,
                 layer_depth: int | None = None):
        self.optimizers = list(optimizers)
        self.layer_depth = layer_depth
        self.names_by_param = dict(names_by_param or {})
        reasons = [r for r in (unavailable_reason(o) for o in self.optimizers) if r]
        self.unavailable = reasons[0] if reasons else None
        self.passes = 0  # captures taken (one fused update pass per group each)

    def _names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for k, opt in enumerate(self.optimizers):
            prefix = f"opt{k}." if len(self.optimizers) > 1 else ""
            for g, group in enumerate(opt.param_groups):
                for i, p in enumerate(group["params"]):
                    if id(p) not in names:
                        names[id(p)] = self.names_by_param.get(id(p)) or f"{prefix}group{g}.{i}"
        return names

    def capture(self, applied: bool = True) -> dict | None:
        """Device tensors of this step, before ``optimizer.step()``: ``names`` and ``rows`` (an
        ``UpdateRows`` over every parameter of the optimizers; those without a gradient have an
        update of 0 and come last), ``planned`` (how many rows the step changes: the first ones)
        and ``applied``. ``applied=False``: the step will be skipped, the updates
        are 0. None when not available or when the optimizers hold no parameter."""
        if self.unavailable:
            return None
        names_of = self._names()
        if not names_of:
            return None
        rows = plan_updates(self.optimizers)
        self.passes += 1
        return self._captured(rows, names_of, applied)

    def from_step(self, step_rows: list, applied: bool = True) -> dict | None:
        """What ``capture`` gives, from the rows a ``gradfuse.optim`` step took in its own pass
        (``optimizer.last_rows``, after ``optimizer.step(stats=True)``): no pass of its own.
        ``step_rows``: the ``StepRows`` of the step of ``optimizers`` (one optimizer)."""
        if self.unavailable:
            return None
        names_of = self._names()
        if not names_of:
            return None
        momentum = {id(p): not isinstance(opt, torch.optim.SGD) or group["momentum"] != 0
                    for opt in self.optimizers for group in opt.param_groups for p in group["params"]}
        params = [p for r in step_rows for p in r.params]
        device = step_rows[0].floats.device if step_rows else None
        floats = [torch.zeros((0, NUM_UPDATE_FLOAT_STATS), dtype=torch.float64)] + [r.floats for r in step_rows]
        counts = [torch.zeros((0, NUM_UPDATE_COUNT_STATS), dtype=torch.int64)] + [r.counts for r in step_rows]
        rows = UpdateRows(params, torch.cat([f.to(device) for f in floats]), torch.cat([c.to(device) for c in counts]),
                          [not isinstance(self.optimizers[0], torch.optim.SGD)] * len(params),
                          [momentum[id(p)] for p in params])
        return self._captured(rows, names_of, applied)

    def _captured(self, rows: UpdateRows, names_of: dict[int, str], applied: bool) -> dict:
        """The captured dict of ``rows`` (the parameters a step changes), with the rows of the
        parameters it leaves alone after them."""
        planned_rows = rows
        planned = {id(p) for p in rows.params}
        rest = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]
                if id(p) not in planned]
        rest = list({id(p): p for p in rest}.values())
        if rest:
            device = rows.floats.device if len(rows) else rest[0].device
            f, c = _weights_only(rest, device)
            rows = UpdateRows(rows.params + rest, torch.cat([rows.floats.to(device), f]),
                              torch.cat([rows.counts.to(device), c]), rows.adam + [False] * len(rest),
                              rows.moment1 + [False] * len(rest), rows.calls)
        return {"names": [names_of[id(p)] for p in rows.params], "rows": rows, "planned": len(planned_rows),
                "applied": applied}

    def layer_table(self, captured: dict) -> tuple[list[str], torch.Tensor]:
        """(layers, float64 ``[len(layers), len(LAYER_FIELDS)]`` on the device): the per-layer
        values of ``captured`` (``gradfuse.dynamics.update_plan.layer_values``), no host read."""
        layers = list(dict.fromkeys(layer_of(n, self.layer_depth) for n in captured["names"]))
        index = {k: i for i, k in enumerate(layers)}
        rows = captured["rows"]
        ids = torch.tensor([index[layer_of(n, self.layer_depth)] for n in captured["names"]], dtype=torch.int64)
        return layers, layer_values(rows, ids.to(rows.floats.device), len(layers), captured["applied"])

    def start_host_copy(self, captured: dict) -> None:
        """Takes the per-layer table of ``captured`` now and starts its host copy: ``layers``
        then reads the copy (a step whose record is written when the host has read its skip;
        ``captured["applied"]`` may be a device flag here, and is set to the host's bool then)."""
        layers, table = self.layer_table(captured)
        captured["host_table"] = (layers, HostCopy([table]))

    def layers(self, captured: dict) -> dict[str, dict[str, float]]:
        """Field -> {layer: value} for every field of ``LAYER_FIELDS`` (one transfer):
        ``update_ratio`` (|u| / |w|; inf for zero weights, 0 when the update is 0 too),
        ``weight_norm``, ``update_norm``, ``update_rms``; ``moment1_rms`` (layers with a first
        moment: Adam, SGD with momentum), ``moment2_rms`` and ``eps_dominated`` (a fraction; layers
        with Adam parameters), on steps that apply the update; ``update_nonfinite``,
        ``moment_nonfinite`` (on steps that apply the update), ``weight_nonfinite`` (element
        counts, ints)."""
        if "host_table" in captured:
            layers, copy = captured["host_table"]
            host = copy.get()[0].tolist()
        else:
            layers, table = self.layer_table(captured)
            host = table.cpu().tolist()
        rows = captured["rows"]
        has_m1: set[str] = set()
        has_adam: set[str] = set()
        for name, m1, adam in zip(captured["names"], rows.moment1, rows.adam):
            key = layer_of(name, self.layer_depth)
            if m1:
                has_m1.add(key)
            if adam:
                has_adam.add(key)
        out: dict[str, dict] = {f: {} for f in LAYER_FIELDS}
        for layer, values in zip(layers, host):
            for field_name, v in zip(LAYER_FIELDS, values):
                if field_name == "moment1_rms" and (layer not in has_m1 or not captured["applied"]):
                    continue
                if field_name in ("moment2_rms", "eps_dominated") and (layer not in has_adam
                                                                       or not captured["applied"]):
                    continue
                if field_name == "moment_nonfinite" and not captured["applied"]:  # no moments after no step
                    continue
                out[field_name][layer] = int(v) if field_name in COUNT_FIELDS and math.isfinite(v) else v
        return out
