"""``gradfuse.clip_`` with ``per=`` (each parameter or layer by its own norm) or ``value=``
(clamping, with the statistics from before).

Layer: clip (a capability). Imports ``gradfuse.core`` and the clip modules per and value.
"""
from __future__ import annotations

from gradfuse.clip.per import check_per, clip_per_
from gradfuse.clip.value import check_clip_value, clamp_stats_
from gradfuse.core.engine import fused_stats, raise_if_nonfinite
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.params import check_max_norm, check_norm_type, named_grads


def clip_modes_(source, max_norm, norm_type: float = 2.0, error_if_nonfinite: bool = False, *,
                group=None, per=None, value=None, layer_depth: int | None = None) -> GradStats:
    """``gradfuse.clip_`` with ``per=`` or ``value=`` (see there)."""
    per = check_per(per)
    if value is not None:
        if max_norm is not None or per is not None:
            raise ValueError("gradfuse.clip_: value= clips by value; pass max_norm=None and no per=")
        if group is not None:
            raise ValueError("gradfuse.clip_: value= takes no group= (clamping is element-wise)")
        v = check_clip_value(value)
        names, _params, grads = named_grads(source)
        return clamp_stats_(names, grads, v)
    if max_norm is None:
        raise ValueError("gradfuse.clip_: max_norm is None; pass a number (or value= to clip by value)")
    max_norm = check_max_norm(max_norm)
    p = check_norm_type(norm_type)
    names, _params, grads = named_grads(source)
    s = fused_stats(names, grads, p, group)
    if grads and error_if_nonfinite:
        raise_if_nonfinite(s)
    if s.names is not names and list(s.names) != names:  # rows follow the (device, dtype) grouping
        by_name = dict(zip(names, grads))
        grads = [by_name[n] for n in s.names]
    return clip_per_(s, grads, max_norm, per, layer_depth)

