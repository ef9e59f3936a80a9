"""gradfuse: fused gradient statistics and clipping for PyTorch.

One multi-tensor pass per (device, dtype) computes, for every gradient, L2 and L-infinity norms,
mean, NaN, Inf and zero counts, and the total norm, without host synchronisation; clipping scales
only when needed, decided on the device.

The package is in layers, each importing only from those below it (docs/architecture.md):
``gradfuse.ops`` (the compiled ops and their reference fallbacks) and ``gradfuse.utils``;
``gradfuse.core`` (grouping, distributed reductions, the fused engine, ``GradStats``, the watch
handle, AMP); the capabilities ``gradfuse.clip``, ``gradfuse.numerics``,
``gradfuse.activations``, ``gradfuse.dynamics`` and the entry points of
``gradfuse.functional``; ``gradfuse.monitor`` (the monitor, its policies, sinks and clip
strategy); ``gradfuse.viz``; ``gradfuse.integrations``; and at the top the demo and the CLI.
This module re-exports the public names.
"""
from gradfuse.activations import ActivationCapture, ActivationStats, capture_activations
from gradfuse.clip import (
    ZClip,
    adaptive_clip_grad_,
    clip_,
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
)
from gradfuse.core.amp import unscale_clip_
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.host_reads import HostReads
from gradfuse.core.watch import GradWatch, watch
from gradfuse.dynamics import NoiseScale, UpdateClip, clip_update_rms
from gradfuse.functional import stats, tensor_stats
from gradfuse.integrations.pytorch import Attachment, attach
from gradfuse.monitor import FlightRecorder, GradientAnomaly, GradMonitor, StepReport, load_dump
from gradfuse.monitor.sinks import (
    JsonlSink,
    LoggingSink,
    MetricsSink,
    MLflowSink,
    PrometheusSink,
    Sink,
    TensorBoardSink,
    WandbSink,
)
from gradfuse.ops import backend, build_info
from gradfuse.viz.explain import explain

# isort: split
# gradfuse.headroom, .histogram and .sinks as attributes of the package too (imported after the
# names they re-export).
from gradfuse import headroom, histogram, sinks  # noqa: F401

__version__ = "0.1.0"

__all__ = ["ActivationCapture", "ActivationStats", "Attachment", "FlightRecorder", "GradMonitor", "GradStats",
           "GradWatch", "GradientAnomaly", "HostReads", "JsonlSink", "LoggingSink", "MLflowSink", "MetricsSink",
           "NoiseScale",
           "PrometheusSink", "Sink", "StepReport", "TensorBoardSink", "UpdateClip", "WandbSink", "ZClip",
           "__version__", "adaptive_clip_grad_", "attach", "backend", "build_info", "capture_activations", "clip_",
           "clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "clip_update_rms", "explain",
           "get_total_norm",
           "load_dump", "stats", "tensor_stats", "unscale_clip_", "watch"]
