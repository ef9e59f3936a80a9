"""Exponent histograms, importable as ``gradfuse.histogram`` (they live in
``gradfuse.numerics.histogram``)."""
from gradfuse.numerics.histogram import *  # noqa: F401,F403
from gradfuse.numerics.histogram import __all__  # noqa: F401
