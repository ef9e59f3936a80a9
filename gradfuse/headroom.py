"""Numeric headroom, at the path it has always had (it lives in
``gradfuse.numerics.headroom``)."""
from gradfuse.numerics.headroom import *  # noqa: F401,F403
from gradfuse.numerics.headroom import __all__  # noqa: F401
