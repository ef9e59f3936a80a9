"""The monitor: ``gradfuse.monitor.monitor.GradMonitor`` composed of its parts, each in a
module of its own: the step plan (``gradfuse.monitor.step_plan``), the policies
(``gradfuse.monitor.policies``), the sink set and the sinks (``gradfuse.monitor.sink_set``,
``gradfuse.monitor.sinks``), the clip strategy (``gradfuse.monitor.clip_strategy``), the
dynamics (``gradfuse.monitor.dynamics``), the activation hooks
(``gradfuse.monitor.activation_hooks``), and what a step hands back and logs: ``StepReport``
and ``GradientAnomaly`` (``gradfuse.monitor.report``) and the record
(``gradfuse.monitor.record``).

Layer: monitor, above the capabilities. Imports ``gradfuse.core``, ``gradfuse.clip``,
``gradfuse.numerics``, ``gradfuse.activations`` and ``gradfuse.dynamics``, never
``gradfuse.viz`` or an integration.
"""
from gradfuse.monitor.monitor import GradMonitor
from gradfuse.monitor.report import GradientAnomaly, StepReport

__all__ = ["GradMonitor", "GradientAnomaly", "StepReport"]
