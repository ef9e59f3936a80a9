"""Clipping, every mode, each computed from the core's one fused statistics pass with its
coefficients decided on the device.

One module per mode:

- ``gradfuse.clip.norm``: by total norm (the drop-ins for ``torch.nn.utils``, and
  ``gradfuse.clip_``);
- ``gradfuse.clip.per``: each parameter or layer by its own norm;
- ``gradfuse.clip.value``: by value;
- ``gradfuse.clip.agc``: adaptive gradient clipping (timm's semantics);
- ``gradfuse.clip.zclip``: ZClip's adaptive thresholds;
- ``gradfuse.clip.schedule``: ``max_norm`` as a number, a schedule or a ZClip.

Layer: clip, a capability beside numerics, activations and dynamics. Imports ``gradfuse.ops``
and ``gradfuse.core``, never the monitor or the integrations.
"""
from gradfuse.clip.agc import adaptive_clip_grad_
from gradfuse.clip.norm import clip_, clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from gradfuse.clip.schedule import ScheduleError
from gradfuse.clip.value import clip_grad_value_
from gradfuse.clip.zclip import ZClip

__all__ = ["ScheduleError", "ZClip", "adaptive_clip_grad_", "clip_", "clip_grad_norm_",
           "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm"]
