"""What a ``GradMonitor`` hands its sinks: the record of a step, built from the step's
``StepReport`` (the keys are listed on the Data reference page), the run configuration that
sinks with ``on_start`` get before the first record, and which ranks write under
``torch.distributed``.

Layer: monitor. Imports ``gradfuse.core``, ``gradfuse.clip`` and ``gradfuse.numerics``.
"""
from __future__ import annotations

import torch

from gradfuse.clip.zclip import ZClip
from gradfuse.core.engine import fused_stats
from gradfuse.core.host_copy import HostCopy
from gradfuse.core.params import named_grads
from gradfuse.core.watch import GradWatch
from gradfuse.monitor.report import StepReport
from gradfuse.numerics import headroom
from gradfuse.numerics.histogram import attach as attach_histogram

# what a row of a clipped step's statistics says of its clip (per=, clip_value=)
_CLIP_KEYS = ("clip_coef", "clipped", "clamped")


def step_record(monitor, report: StepReport, event: bool, max_norm_now, logged_max_norm=None) -> dict:
    """The record of ``report`` (reads its statistics: one transfer), as ``GradMonitor.record``.

    Args:
        monitor: The ``GradMonitor`` that took the step (its counters, ``layer_depth``,
            ``histogram``, ``dynamics`` and watched ``source`` are read).
        report: A ``StepReport`` with ``stats``.
        event: The record is written because of an anomaly (its ``event`` key).
        max_norm_now: The step's ``max_norm`` when its statistics hold none (a number, a
            ``ZClip`` or None).
        logged_max_norm: The ``max_norm`` to log, when known already (a number); None: from
            ``report`` and ``max_norm_now``.

    Returns:
        The record, a dict of plain values.
    """
    d = report.stats.to_dict()
    params = d["params"]
    if report.skip:  # no clip applied, per parameter either
        params = {name: {k: v for k, v in row.items() if k not in _CLIP_KEYS} for name, row in params.items()}
    extra = {} if monitor.dynamics is None else monitor.dynamics.record(report)
    return {
        "step": report.step,
        "total_norm": d["total_norm"],
        "norm_type": d["norm_type"],
        "max_norm": logged_max_norm if logged_max_norm is not None else _logged_max_norm(report, max_norm_now),
        # a skipped step applies no clip (with blocking=False its gradients were clipped all the same)
        "clip_coef": None if report.skip else d["clip_coef"],
        "clipped": None if report.skip else d["clipped"],
        "nonfinite": d["nonfinite"],
        "skipped": report.skip,
        "anomalies": report.anomalies,
        "message": report.message,
        "event": event,
        "counters": monitor.counters(),
        "params": params,
        "layers": report.stats.layers(monitor.layer_depth),
        **(_headroom_fields(monitor.source, report, monitor.layer_depth) if monitor.histogram else {}),
        **extra,
        **_activation_fields(report, monitor.layer_depth),
        **({"dump": str(report.dump)} if report.dump is not None else {}),
    }


def _logged_max_norm(report: StepReport, max_norm_now):
    m = report.stats.max_norm if report.stats is not None else None
    if m is None:
        m = max_norm_now
    if isinstance(m, ZClip):  # its threshold of that step (inf: nothing clipped)
        m = m.last_threshold
    return float(m) if isinstance(m, torch.Tensor) else m


class HeadroomTake:
    """The exponent histograms and numeric headroom of the gradients at the moment it is made
    (one fused pass, device tensors, packed per tensor), with their host copy started at once:
    what a record's ``headroom`` and ``exponents`` are summed from, whenever it is written.
    ``source`` None: nothing taken (a step whose record, if any, goes without them)."""

    def __init__(self, source):
        self.names, self.keys, self._copy = [], [], None
        if source is None:
            return
        if isinstance(source, GradWatch):  # a watch given to the monitor in place of a model
            names, grads = source.counted_grads() if source.in_pieces else source.named_grads()
        else:
            names, _params, grads = named_grads(source)
        detached = [g.detach() for g in grads]
        h = attach_histogram(fused_stats(names, detached, 2.0, what="tensor", elementwise_zero_norm=True),
                             names, detached)
        hist, columns, self.names = h.exponent_histogram, h.headroom, list(h.names)
        if isinstance(source, GradWatch) and source.in_pieces:  # each rank holds pieces: the whole gradients'
            linf = h.linf
            if list(h.names) != list(names):  # rows in the watch's order, as on every rank
                at = {name: i for i, name in enumerate(h.names)}
                order = torch.tensor([at[name] for name in names])
                if hist.device.type != "cpu":  # pinned, so that the copy does not wait for the device
                    order = order.pin_memory().to(hist.device, non_blocking=True)
                hist, linf = hist[order], linf[order]
            hist, amax = source.combine_pieces(hist, linf[:, None])
            columns, self.names = headroom.headroom_columns(hist, amax[:, 0]), list(names)
        self.keys, packed = headroom.packed_rows(hist, columns)
        self._copy = HostCopy([packed])

    def fields(self, layer_depth: int | None) -> dict:
        """The record's ``headroom`` and ``exponents`` per layer, from the host copy ({} when
        nothing was taken)."""
        if self._copy is None:
            return {}
        [packed] = self._copy.get()
        frac, exps = headroom.layer_record_of_rows(self.names, self.keys, packed, layer_depth)
        return {"headroom": frac, "exponents": exps}


def _headroom_fields(source, report: StepReport, layer_depth: int | None) -> dict:
    # taken at the step when the record is written later (blocking=False), else now
    take = report.headroom if report.headroom is not None else HeadroomTake(source)
    return take.fields(layer_depth)


def _activation_fields(report: StepReport, layer_depth: int | None) -> dict:
    out = {}
    if report.first_nonfinite is not None:
        out["first_nonfinite"] = list(report.first_nonfinite)
    if report.activations is not None:
        out["act"] = report.activations.forward.layers(layer_depth)
        out["act_grad"] = report.activations.backward.layers(layer_depth)
        if report.activations.histogram:
            out["act_exponents"] = report.activations.forward.layer_exponents(layer_depth)
            out["act_grad_exponents"] = report.activations.backward.layer_exponents(layer_depth)
    return out


def run_config(monitor, activations: bool) -> dict:
    """The settings of ``monitor`` as plain values, as ``GradMonitor.config`` (``activations``:
    whether it takes the activation statistics)."""
    m = monitor.max_norm
    if isinstance(m, ZClip):
        m = "zclip"
    elif callable(m):
        m = "schedule"
    dyn = monitor.dynamics
    return {"max_norm": m, "norm_type": monitor.norm_type, "every": monitor.every,
            "on_nonfinite": monitor.on_nonfinite, "on_explode": monitor.on_explode,
            "explode_threshold": monitor.explode_threshold, "per": monitor.per,
            "clip_value": monitor.clip_value, "agc": None if monitor.agc is None else float(monitor.agc[0]),
            "layer_depth": monitor.layer_depth, "histogram": bool(monitor.histogram),
            "activations": activations,
            "noise_scale": bool(dyn is not None and dyn.noise_scale is not None),
            "update_ratios": bool(dyn is not None and dyn.update_ratios is not None),
            "update_every": None if dyn is None else dyn.update_every,
            "max_update_rms": None if dyn is None or dyn.update_clip is None else dyn.update_clip.max_rms,
            "sink_ranks": monitor.sink_ranks,
            **({"recorder": monitor.recorder.steps, "on_spike": monitor.on_spike}
               if monitor.recorder is not None else {})}


def writing_rank(sink_ranks: int | str):
    """None: not distributed (write, no rank key); False: this rank does not write; a rank
    number: this rank writes with that ``rank`` key (``sink_ranks="all"``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return None
    rank = torch.distributed.get_rank()
    if sink_ranks == "all":
        return rank
    return None if rank == sink_ranks else False
