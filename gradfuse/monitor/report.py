"""What ``GradMonitor.step`` hands back: the ``StepReport`` of the step, its anomaly message, and
the ``GradientAnomaly`` that carries it out of a step under the ``"raise"`` policy.

Layer: monitor. Imports ``gradfuse.core`` and the monitor's policies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gradfuse.core.grad_stats import GradStats
from gradfuse.monitor.policies import describe


class GradientAnomaly(RuntimeError):
    """Raised by ``GradMonitor.step`` under the ``"raise"`` policy (``on_nonfinite="raise"`` or
    ``on_explode="raise"``); a ``RuntimeError``.

    The message names the anomaly and the parameters at fault. The step's record is written to
    the sinks (as an event) before the exception is raised.

    Args:
        message: The anomaly message (``report.message``).
        report: The step's ``StepReport``.

    Attributes:
        report (StepReport): The step's ``StepReport`` (``anomalies``, ``stats``, ``message``).

    Example:
        ```python
        monitor = gradfuse.GradMonitor(model, on_nonfinite="raise")
        try:
            monitor.step()
        except gradfuse.GradientAnomaly as e:
            print(e.report.anomalies, e.report.message)
        ```
    """

    def __init__(self, message: str, report: StepReport):
        super().__init__(message)
        self.report = report


@dataclass
class StepReport:
    """What ``GradMonitor.step`` saw and decided.

    Attributes:
        step (int): The step number (``GradMonitor.step_count`` before the step).
        stats (GradStats | None): The step's ``GradStats`` (device tensors; reading them
            syncs). None when the monitor is disabled (``enabled=False``).
        skip (bool): Skip this optimizer step: the ``"skip"`` policy fired; gradients are left as
            they were, unclipped, for inspection.
        logged (bool): The step's record was written to the sinks.
        anomalies (list[str]): What fired: ``"nonfinite"``, ``"explode"``, ``"max_norm"`` (a bad
            ``max_norm`` schedule value), ``"spike"`` (with a flight recorder: the loss, gradient
            norm or update norm spiked), or ``"amp_overflow"`` (a GradScaler step with Inf/NaN
            gradients: the scaler skips it and lowers its scale; not counted as an anomaly of
            the model).
        message (str): The anomaly message naming the parameters at fault (``""`` when none).
        activations (ActivationCapture | None): With ``activations=True``: the step's
            ``ActivationCapture`` on the steps it was armed for (``cap.forward`` /
            ``cap.backward``); else None.
        first_nonfinite (tuple[str, str] | None): With ``trace_nonfinite=True``, on a step with
            non-finite gradients: ``("forward" | "backward", module)``, where the first NaN / Inf
            appeared; else None.
        spikes (list[str]): With a flight recorder, on a ``"spike"`` step: the quantities that
            spiked (``"loss"``, ``"grad_norm"``, ``"update_norm"``).
        dump (Path | None): The flight recorder's dump written for this step, or None.
        settled (bool): Whether the host has read the step's decision: True at once with
            ``blocking=True``; with ``blocking=False``, False until the next ``step`` (or
            ``flush`` / ``close``) settles it and fills in ``skip``, ``anomalies``, ``message``,
            ``spikes``, ``dump`` and ``logged`` (the skip itself was applied on the device).
        updates (dict | None): With ``update_ratios``, on the steps that take the optimizer's
            statistics (logging steps, ``update_every``, ``max_update_rms``, a flight recorder
            recording updates): ``names``, ``rows`` (an ``UpdateRows`` of device tensors, per
            parameter, the update as applied; ``monitor.dynamics.update_ratios.layers(
            report.updates)`` reads them per layer), ``planned`` (the leading rows the step
            changes), ``applied``, and with ``max_update_rms`` ``coefs``; else None.
        headroom (HeadroomTake | None): With ``histogram=True`` and ``blocking=False``: the
            exponent histograms and headroom taken at the step (on logging steps; empty on the
            others), which its record is written from a step later; else None (taken when the
            record is written).

    Example:
        ```python
        report = monitor.step()
        if not report.skip:
            optimizer.step()
        if report.anomalies:
            print(report.step, report.anomalies, report.message)
        ```
    """
    step: int
    stats: GradStats | None = None
    skip: bool = False
    logged: bool = False
    anomalies: list[str] = field(default_factory=list)
    message: str = ""
    # activations=True: the step's ActivationCapture on steps it was armed for (cap.forward /
    # cap.backward); trace_nonfinite=True: ("forward" | "backward", module) on non-finite steps.
    activations: object | None = None
    first_nonfinite: tuple[str, str] | None = None
    spikes: list[str] = field(default_factory=list)  # with a flight recorder: the quantities that spiked
    dump: Path | None = None  # the flight recorder's dump of this step
    updates: dict | None = None  # the optimizer's statistics of this step, when taken
    settled: bool = True  # blocking=False: False until the host reads the step's decision
    headroom: object | None = None  # histogram=True, blocking=False: the HeadroomTake of the step


def anomaly_message(s: GradStats, anomalies: list[str], explode_threshold: float | None, capture,
                    bad_max_norm: Exception | None, recorder=None,
                    snapshot=None) -> tuple[str, tuple[str, str] | None, list[str]]:
    """The message of a step with an anomaly of the model, and where its first NaN / Inf appeared.

    Args:
        s: The step's statistics.
        anomalies: What fired (``StepReport.anomalies``).
        explode_threshold: The monitor's explosion threshold.
        capture: The step's ``ActivationCapture`` (full or trace-only), or None.
        bad_max_norm: The error of a bad ``max_norm`` schedule value at this step, or None.
        recorder: The monitor's ``FlightRecorder``, for a ``"spike"`` (or None).
        snapshot: The recorder's ``RecorderSnapshot`` of the step, when it is read a step later.

    Returns:
        ``(message, first_nonfinite, spikes)``: the parameters at fault (``policies.describe``),
            led by the module where the first NaN / Inf appeared when the capture traced it,
            followed by the schedule's error and the spike's description; ``StepReport.first_nonfinite``
            (None unless a capture saw the non-finite step); and the quantities that spiked.
    """
    message = describe(s, anomalies, explode_threshold)
    first_nonfinite = None
    if "nonfinite" in anomalies and capture is not None:
        first_nonfinite = capture.first_nonfinite  # where the NaN / Inf first appeared
        origin = capture.describe_nonfinite()
        if origin:
            message = f"{origin}; {message}"
    if bad_max_norm is not None:
        message = "; ".join(m for m in (message, str(bad_max_norm)) if m)
    spikes = []
    if "spike" in anomalies and recorder is not None:
        spike, spikes = recorder.describe_spike(snapshot)
        message = "; ".join(m for m in (message, spike) if m)
    return message, first_nonfinite, spikes
