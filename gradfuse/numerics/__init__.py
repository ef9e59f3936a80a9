"""Numerics: exponent histograms of tensors (:mod:`~gradfuse.numerics.histogram`) and the
numeric headroom they give for fp16, bf16 and fp8 (:mod:`~gradfuse.numerics.headroom`).

Layer: numerics, a capability beside clip, activations and dynamics. Imports :mod:`gradfuse.ops`
and :mod:`gradfuse.core`.
"""
