"""Where GradMonitor records go: the sinks, importable as ``gradfuse.sinks`` (they live in
``gradfuse.monitor.sinks``)."""
from gradfuse.monitor.sinks import *  # noqa: F401,F403
from gradfuse.monitor.sinks import __all__  # noqa: F401
