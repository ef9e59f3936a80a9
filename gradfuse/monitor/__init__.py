"""The monitor: ``gradfuse.monitor.monitor.GradMonitor`` composed of its parts, each in a
module of its own: the policies (``gradfuse.monitor.policies``), the sink set and the sinks
(``gradfuse.monitor.sink_set``, ``gradfuse.monitor.sinks``), the clip strategy
(``gradfuse.monitor.clip_strategy``), the dynamics (``gradfuse.monitor.dynamics``) and
the activation hooks (``gradfuse.monitor.activation_hooks``).

Layer: monitor, above the capabilities. Imports ``gradfuse.core``, ``gradfuse.clip``,
``gradfuse.numerics``, ``gradfuse.activations`` and ``gradfuse.dynamics``, never
``gradfuse.viz`` or an integration.
"""
from gradfuse.monitor.monitor import GradientAnomaly, GradMonitor, StepReport

__all__ = ["GradMonitor", "GradientAnomaly", "StepReport"]
