"""gradfuse: fused gradient statistics and clipping for PyTorch.

One multi-tensor pass per (device, dtype) computes, for every gradient, L2 and L-infinity norms,
mean, NaN, Inf and zero counts, and the total norm, without host synchronisation; clipping scales
only when needed, decided on the device.
"""
from gradfuse._ext import backend, build_info
from gradfuse.activations import ActivationCapture, ActivationStats, capture_activations
from gradfuse.amp import unscale_clip_
from gradfuse.api import (clip_, clip_grad_norm_, clip_grads_with_norm_, get_total_norm, stats,
                          tensor_stats)
from gradfuse.clipping import ZClip, adaptive_clip_grad_, clip_grad_value_
from gradfuse.grad_stats import GradStats
from gradfuse.integrations.pytorch import Attachment, attach
from gradfuse.monitor import GradientAnomaly, GradMonitor, StepReport
from gradfuse.noise_scale import NoiseScale
from gradfuse.sinks import (JsonlSink, LoggingSink, MetricsSink, PrometheusSink, TensorBoardSink,
                            WandbSink)
from gradfuse.grad_watch import GradWatch, watch

__version__ = "0.1.0"

__all__ = ["ActivationCapture", "ActivationStats", "Attachment", "GradMonitor", "GradStats",
           "GradWatch", "GradientAnomaly", "JsonlSink", "LoggingSink", "MetricsSink", "NoiseScale",
           "PrometheusSink", "StepReport", "TensorBoardSink", "WandbSink", "attach", "backend",
           "build_info", "capture_activations", "clip_", "clip_grad_norm_",
           "clip_grads_with_norm_", "get_total_norm", "stats", "tensor_stats", "unscale_clip_",
           "watch", "__version__"]
__all__ += ["ZClip", "adaptive_clip_grad_", "clip_grad_value_"]  # issue 17: gradfuse.clipping
