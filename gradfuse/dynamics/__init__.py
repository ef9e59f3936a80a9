"""Training dynamics: the gradient noise scale (:mod:`~gradfuse.dynamics.noise_scale`, with its
DDP communication hook) and update-to-weight ratios (:mod:`~gradfuse.dynamics.update_ratio`).

Layer: dynamics, a capability beside clip, numerics and activations. Imports :mod:`gradfuse.ops`
and :mod:`gradfuse.core`.
"""
from gradfuse.dynamics.noise_scale import NoiseScale
from gradfuse.dynamics.update_ratio import UpdateRatios

__all__ = ["NoiseScale", "UpdateRatios"]
