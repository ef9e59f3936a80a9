"""How a ``GradMonitor`` drives its flight recorder: making it from the ``recorder=`` argument,
feeding it the two halves of each step, dumping on an anomaly a policy acted on, and its counters
and checkpoint state in the monitor's.

Kept apart from ``gradfuse.monitor.recorder`` so that the recorder knows nothing of the monitor
(it takes statistics, not reports), and ``monitor.py`` makes one call at each point of its step.

Layer: monitor. Imports the monitor's flight recorder.
"""
from __future__ import annotations

from gradfuse.monitor.recorder import FlightRecorder


def as_recorder(value) -> FlightRecorder | None:
    """``GradMonitor(recorder=...)``: None / False: none; True: the defaults; an int: that many
    steps; a ``FlightRecorder``: itself.

    Raises:
        TypeError: anything else.
    """
    if value is None or value is False:
        return None
    if value is True:
        return FlightRecorder()
    if isinstance(value, int):
        return FlightRecorder(steps=value)
    if isinstance(value, FlightRecorder):
        return value
    raise TypeError(f"gradfuse.GradMonitor: recorder must be None, True, an int or a gradfuse.FlightRecorder, "
                    f"got {type(value).__name__}")


def trigger_of(report) -> dict | None:
    """The dump trigger of a step's ``StepReport``: its kind (``"nonfinite"``, ``"explode"`` or
    ``"spike"``, the first that applies), or None when none of them fired."""
    kind = next((k for k in ("nonfinite", "explode", "spike") if k in report.anomalies), None)
    if kind is None:
        return None
    first = report.first_nonfinite
    return {"kind": kind, "step": report.step, "anomalies": list(report.anomalies), "message": report.message,
            "quantities": list(report.spikes), "first_nonfinite": None if first is None else list(first)}


def configure(recorder: FlightRecorder | None, names: list[str], names_by_param: dict, layer_depth: int | None,
              norm_type: float, dynamics, optimizer, fused_step: bool = False) -> None:
    """``recorder.configure`` for a monitor (nothing without a recorder): its optimizers are
    those of its ``update_ratios`` (``dynamics``), else its AMP ``optimizer``.

    Raises:
        ValueError: ``record_updates`` with ``fused_step`` whose update statistics do not ride
            the step (no ``update_ratios`` of its optimizer).
    """
    if recorder is None:
        return
    if fused_step and recorder.record_updates and not (dynamics is not None and dynamics.rides_step):
        raise ValueError("gradfuse.GradMonitor: FlightRecorder(record_updates=True) with fused_step=True needs "
                         "update_ratios=optimizer: the clip rides the step, so p.grad keeps the unclipped gradient "
                         "and the update applied is known from the step's own statistics, which update_ratios "
                         "takes")
    ratios = None if dynamics is None else dynamics.update_ratios
    recorder.configure(names, names_by_param, layer_depth, norm_type,
                       ratios.optimizers if ratios is not None else [optimizer])


def observe(recorder: FlightRecorder | None, step: int, report, loss) -> None:
    """``recorder.observe`` for a monitor's step (nothing without a recorder)."""
    if recorder is not None:
        recorder.observe(step, report.stats, loss, report.activations)


def wants_updates(recorder: FlightRecorder | None) -> bool:
    """Whether ``recorder`` records the optimizer's update at each step."""
    return recorder is not None and recorder.record_updates and bool(recorder.optimizers)


def commit_step(recorder: FlightRecorder | None, report, decision, raising: bool = False, dynamics=None) -> None:
    """The monitor's step with ``recorder``: the row of the step (``commit``; no update when
    the step is skipped, the scaler's to skip, or ``raising``; the update statistics the
    monitor's ``dynamics`` took this step when they cover the recorder's optimizers), and a dump
    when a policy other than ``"ignore"`` acted on a non-finite, explode or spike anomaly (its
    path in ``report.dump``)."""
    if recorder is None:
        return
    applied = not (raising or report.skip or "amp_overflow" in report.anomalies)
    updates = None if dynamics is None else dynamics.planned_updates(report, recorder.optimizers)
    recorder.commit(report.stats, skipped=report.skip, applied=applied, updates=updates)
    dump_if_acted(recorder, report, decision)


def commit_deferred(recorder: FlightRecorder | None, report, skip, keep: bool, dynamics=None):
    """``commit_step`` for a monitor that never blocks: the row of the step with its skip as
    decided on the device (``skip``, a 0-d bool, or None), and, when ``keep``, the
    ``RecorderSnapshot`` the host reads the next step (else None)."""
    if recorder is None:
        return None
    skipped = skip if skip is not None else False
    updates = None if dynamics is None else dynamics.planned_updates(report, recorder.optimizers)
    return recorder.commit(report.stats, skipped=skipped, applied=True, updates=updates, snapshot=keep)


def dump_if_acted(recorder: FlightRecorder | None, report, decision, snapshot=None) -> None:
    """A dump when a policy other than ``"ignore"`` acted on a non-finite, explode or spike
    anomaly of ``report`` (its path in ``report.dump``); from ``snapshot`` when the step is
    settled a step later."""
    trigger = None if recorder is None else trigger_of(report)
    if trigger is not None and set(decision.policies) - {"ignore"}:
        report.dump = recorder.dump(trigger=trigger, snapshot=snapshot)


def recorder_counters(monitor) -> dict[str, int]:
    """The counters a monitor with a recorder adds: ``spike_steps``, ``dumps``, ``failed_dumps``."""
    rec = monitor.recorder
    if rec is None:
        return {}
    return {"spike_steps": monitor.spike_steps, "dumps": rec.dumps, "failed_dumps": rec.failed_dumps}


def recorder_state(monitor) -> dict:
    """What a monitor's ``state_dict`` adds with a recorder: ``spike_steps`` and ``recorder``."""
    if monitor.recorder is None:
        return {}
    return {"spike_steps": monitor.spike_steps, "recorder": monitor.recorder.state_dict()}


def load_recorder_state(monitor, state: dict) -> None:
    """Restores what ``recorder_state`` saved (a state without it: the counters start at 0)."""
    monitor.spike_steps = int(state.get("spike_steps", 0))
    if monitor.recorder is not None and "recorder" in state:
        monitor.recorder.load_state_dict(state["recorder"])
