"""GradMonitor's arguments, checked when it is made, before any hook or handle exists: the clip
mode (``check_clip_args``) and the policies, logging and AMP settings (``check_monitor_args``).
Each error names the argument and what was wrong.

Layer: monitor. Imports ``gradfuse.clip``, ``gradfuse.core`` and the monitor's policies.
"""
from __future__ import annotations

from typing import NamedTuple

from gradfuse.clip.agc import check_agc_args
from gradfuse.clip.per import check_per
from gradfuse.clip.schedule import check_max_norm_arg
from gradfuse.clip.value import check_clip_value
from gradfuse.clip.zclip import ZClip
from gradfuse.core.params import check_norm_type
from gradfuse.monitor.policies import SPIKE_POLICIES, check_policy
from gradfuse.optim import FusedStep


class ClipArgs(NamedTuple):
    """The monitor's clip mode, checked.

    Attributes:
        max_norm: None, a number, a schedule (a callable of the step) or a ``ZClip``.
        norm_type: The order of the total norm.
        per: None, ``"param"`` or ``"layer"``.
        clip_value: None, or the bound of clipping by value.
        agc: None, or ``(clip_factor, eps, norm_type)`` of adaptive clipping.
        modes: The names of the modes given (``max_norm``, ``clip_value``, ``agc``): at most one.
    """

    max_norm: object
    norm_type: float
    per: str | None
    clip_value: float | None
    agc: tuple[float, float, float] | None
    modes: tuple[str, ...]


def check_clip_args(max_norm, norm_type, per, clip_value, agc, agc_eps) -> ClipArgs:
    """The clip arguments of ``GradMonitor``, checked.

    Raises:
        ValueError: ``max_norm`` or ``clip_value`` negative or NaN, ``norm_type`` NaN, ``per``
            not None, ``"param"`` or ``"layer"``, a bad ``agc`` / ``agc_eps``; more than one of
            ``max_norm``, ``clip_value`` and ``agc``; ``per`` without a numeric (or schedule)
            ``max_norm``.
    """
    modes = tuple(m for m, v in (("max_norm", max_norm), ("clip_value", clip_value), ("agc", agc))
                  if v is not None)
    max_norm = check_max_norm_arg(max_norm)
    norm_type = check_norm_type(norm_type)
    per = check_per(per)
    clip_value = None if clip_value is None else check_clip_value(clip_value)
    agc = None if agc is None else check_agc_args(agc, agc_eps, norm_type)
    if len(modes) > 1:
        raise ValueError(f"gradfuse.GradMonitor: pass one of max_norm, clip_value and agc, got {list(modes)}")
    if per is not None and (max_norm is None or isinstance(max_norm, ZClip)):
        raise ValueError("gradfuse.GradMonitor: per= needs a max_norm (a number or a schedule)")
    return ClipArgs(max_norm, norm_type, per, clip_value, agc, modes)


def check_monitor_args(*, on_nonfinite: str, on_explode: str, on_spike: str, explode_threshold, every: int,
                       sink_ranks, optimizer, scaler, max_update_rms, blocking: bool = True,
                       fused_step: bool = False, max_norm=None, per=None) -> None:
    """The policy, logging and AMP arguments of ``GradMonitor``, checked.

    Raises:
        ValueError: ``on_nonfinite`` / ``on_explode`` / ``on_spike`` not one of the policies;
            ``explode_threshold`` not > 0; ``every`` < 0; ``sink_ranks`` neither a rank number
            nor ``"all"``; ``optimizer`` without ``scaler``, ``max_update_rms`` or
            ``blocking=False``; ``fused_step`` without a
            ``gradfuse.optim`` optimizer, with a ``max_norm`` that is not a number or a
            schedule or a ``ZClip``, or with ``scaler`` and a ``ZClip`` or ``per``.
    """
    if fused_step:
        if not isinstance(optimizer, FusedStep):
            raise ValueError("gradfuse.GradMonitor: fused_step=True needs optimizer= a gradfuse.optim optimizer "
                             f"(gradfuse.optim.from_torch adopts a torch one), got {type(optimizer).__qualname__}")
        if max_norm is None:
            raise ValueError("gradfuse.GradMonitor: fused_step=True rides the clip as a scale per tensor: it takes a "
                             "numeric, schedule or ZClip max_norm (clip_value= and agc= change each element, "
                             "not a tensor's scale)")
        if scaler is not None and (isinstance(max_norm, ZClip) or per is not None):
            raise ValueError("gradfuse.GradMonitor: fused_step=True with scaler= rides the clip by the total norm "
                             "(the fused unscale scales every gradient by one factor): a ZClip or per= needs "
                             "fused_step=False there")
    if not isinstance(blocking, bool):
        raise ValueError(f"gradfuse.GradMonitor: blocking must be True or False, got {blocking!r}")
    check_policy("on_nonfinite", on_nonfinite)
    check_policy("on_explode", on_explode)
    check_policy("on_spike", on_spike, SPIKE_POLICIES)
    if explode_threshold is not None and not explode_threshold > 0:
        raise ValueError(f"gradfuse.GradMonitor: explode_threshold must be > 0, got {explode_threshold!r}")
    if every < 0:
        raise ValueError(f"gradfuse.GradMonitor: every must be >= 0, got {every}")
    if not (sink_ranks == "all" or (isinstance(sink_ranks, int) and not isinstance(sink_ranks, bool)
                                    and sink_ranks >= 0)):
        raise ValueError(f"gradfuse.GradMonitor: sink_ranks must be a rank number or 'all', got {sink_ranks!r}")
    if optimizer is not None and scaler is None and max_update_rms is None and blocking and not fused_step:
        raise ValueError("gradfuse.GradMonitor: optimizer= is for the fused AMP unscale (pass scaler= too), "
                         "max_update_rms, blocking=False or fused_step=True")
