"""Training dynamics: the gradient noise scale (``gradfuse.dynamics.noise_scale``, with its
DDP communication hook), the optimizer's update per parameter from the fused update op
(``gradfuse.dynamics.update_plan``), the per-layer update statistics built on it
(``gradfuse.dynamics.update_ratio``) and update clipping (``gradfuse.dynamics.update_clip``).

Layer: dynamics, a capability beside clip, numerics and activations. Imports ``gradfuse.ops``
and ``gradfuse.core``.
"""
from gradfuse.dynamics.noise_scale import NoiseScale
from gradfuse.dynamics.update_clip import UpdateClip, clip_update_rms
from gradfuse.dynamics.update_ratio import UpdateRatios

__all__ = ["NoiseScale", "UpdateClip", "UpdateRatios", "clip_update_rms"]
