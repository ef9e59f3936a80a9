"""What ``max_norm`` may be for the monitor and the integrations: None, a number, a
``gradfuse.clip.zclip.ZClip``, or a schedule (a callable of the step number).

Layer: clip (a capability). Imports ``gradfuse.core`` and ``gradfuse.clip.zclip``.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from gradfuse.clip.zclip import ZClip
from gradfuse.core.params import check_max_norm


def check_max_norm_arg(max_norm):
    """What GradMonitor and the integrations take as ``max_norm``: None, a number, a ZClip, or a
    callable of the step number returning a number."""
    if max_norm is None or isinstance(max_norm, ZClip):
        return max_norm
    if callable(max_norm):
        return max_norm
    return check_max_norm(max_norm)


class ScheduleError(ValueError):
    """A ``max_norm`` schedule returned a bad value (NaN, negative, not a number) or raised."""


def max_norm_at(schedule: Callable[[int], float], step: int) -> float:
    """``schedule(step)`` checked; raises ScheduleError naming the step."""
    try:
        value = schedule(step)
    except Exception as e:  # noqa: BLE001 - reported with the step, chained
        raise ScheduleError(f"gradfuse: the max_norm schedule raised at step {step}: "
                            f"{type(e).__name__}: {e}") from e
    try:
        m = float(value)
    except (TypeError, ValueError):
        raise ScheduleError(f"gradfuse: the max_norm schedule returned {value!r} at step {step}; "
                            "expected a number") from None
    if math.isnan(m) or m < 0:
        raise ScheduleError(f"gradfuse: the max_norm schedule returned {value!r} at step {step}; "
                            "expected a non-negative number")
    return m

