"""Numerics: exponent histograms of tensors (``gradfuse.numerics.histogram``) and the
numeric headroom they give for fp16, bf16 and fp8 (``gradfuse.numerics.headroom``).

Layer: numerics, a capability beside clip, activations and dynamics. Imports ``gradfuse.ops``
and ``gradfuse.core``.
"""
