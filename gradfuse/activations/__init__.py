"""Activations and the gradients with respect to them: fused statistics per module, taken in
hooks on the steps that ask for them, and the first non-finite value traced to its module (see
``gradfuse.activations.capture``).

Layer: activations, a capability beside clip, numerics and dynamics. Imports ``gradfuse.ops``
and ``gradfuse.core``.
"""
from gradfuse.activations.capture import (ROOT_NAME, ActivationCapture, ActivationStats,
                                          capture_activations, unit_dim)

__all__ = ["ROOT_NAME", "ActivationCapture", "ActivationStats", "capture_activations", "unit_dim"]
