"""The monitor: ``gradfuse.monitor.monitor.GradMonitor`` composed of its parts, each in a
module of its own: the checks of its arguments (``gradfuse.monitor.arguments``), its checkpoint
state (``gradfuse.monitor.checkpoint``), the step plan (``gradfuse.monitor.step_plan``), the policies
(``gradfuse.monitor.policies``), the sink set and the sinks (``gradfuse.monitor.sink_set``,
``gradfuse.monitor.sinks``), the clip strategy (``gradfuse.monitor.clip_strategy``), the
dynamics (``gradfuse.monitor.dynamics``), the activation hooks
(``gradfuse.monitor.activation_hooks``), the flight recorder, its spike detector, the
monitor's calls into it and its dump file (``gradfuse.monitor.recorder``,
``gradfuse.monitor.spikes``, ``gradfuse.monitor.recorder_hooks``, ``gradfuse.monitor.flight_dump``),
and what a step hands back and logs: ``StepReport`` and ``GradientAnomaly``
(``gradfuse.monitor.report``) and the record (``gradfuse.monitor.record``).

Layer: monitor, above the capabilities. Imports ``gradfuse.core``, ``gradfuse.clip``,
``gradfuse.numerics``, ``gradfuse.activations`` and ``gradfuse.dynamics``, never
``gradfuse.viz`` or an integration.
"""
from gradfuse.monitor.flight_dump import FlightDump, load_dump
from gradfuse.monitor.monitor import GradMonitor
from gradfuse.monitor.recorder import FlightRecorder
from gradfuse.monitor.report import GradientAnomaly, StepReport

__all__ = ["FlightDump", "FlightRecorder", "GradMonitor", "GradientAnomaly", "StepReport", "load_dump"]
