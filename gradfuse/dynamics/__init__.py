"""Training dynamics: the gradient noise scale (``gradfuse.dynamics.noise_scale``, with its
DDP communication hook) and update-to-weight ratios (``gradfuse.dynamics.update_ratio``).

Layer: dynamics, a capability beside clip, numerics and activations. Imports ``gradfuse.ops``
and ``gradfuse.core``.
"""
from gradfuse.dynamics.noise_scale import NoiseScale
from gradfuse.dynamics.update_ratio import UpdateRatios

__all__ = ["NoiseScale", "UpdateRatios"]
