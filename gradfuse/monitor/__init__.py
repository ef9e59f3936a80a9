"""The monitor: :class:`~gradfuse.monitor.monitor.GradMonitor` composed of its parts, each in a
module of its own: the policies (:mod:`~gradfuse.monitor.policies`), the sink set and the sinks
(:mod:`~gradfuse.monitor.sink_set`, :mod:`~gradfuse.monitor.sinks`), the clip strategy
(:mod:`~gradfuse.monitor.clip_strategy`), the dynamics (:mod:`~gradfuse.monitor.dynamics`) and
the activation hooks (:mod:`~gradfuse.monitor.activation_hooks`).

Layer: monitor, above the capabilities. Imports :mod:`gradfuse.core`, :mod:`gradfuse.clip`,
:mod:`gradfuse.numerics`, :mod:`gradfuse.activations` and :mod:`gradfuse.dynamics`, never
:mod:`gradfuse.viz` or an integration.
"""
from gradfuse.monitor.monitor import GradientAnomaly, GradMonitor, StepReport

__all__ = ["GradMonitor", "GradientAnomaly", "StepReport"]
