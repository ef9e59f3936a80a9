"""Numeric headroom, importable as ``gradfuse.headroom`` (it lives in
``gradfuse.numerics.headroom``)."""
from gradfuse.numerics.headroom import *  # noqa: F401,F403
from gradfuse.numerics.headroom import __all__  # noqa: F401
