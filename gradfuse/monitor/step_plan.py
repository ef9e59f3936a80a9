"""How one monitored step reads and changes the gradients: the pass that takes its statistics,
and the clip that follows once the policies allow it.

The passes, one fused pass each: under an enabled GradScaler with the monitor's ``optimizer``,
the AMP unscale, statistics and clip in one read and one write (``gradfuse.core.amp``; the
gradients stay scaled until the clip); with a total-norm ``max_norm`` and no policy to decide
before clipping, statistics and clip in one call; with ``clip_value`` (order 2, no policy to
decide), the clamp with the statistics from before clamping; else the statistics alone, and the
clip (by the total norm, or the other modes of ``gradfuse.monitor.clip_strategy``) after the
policies. With ``fused_step=True`` the clip by the total norm, by a ``ZClip`` or per parameter /
layer is its coefficients alone: the optimizer's fused step applies them as it reads the
gradients (no scaling pass).

Layer: monitor. Imports ``gradfuse.core``, ``gradfuse.clip`` and the monitor's clip strategy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gradfuse.clip.per import with_per_coefficients
from gradfuse.clip.schedule import ScheduleError
from gradfuse.clip.value import clamp_watch_
from gradfuse.clip.zclip import ZClip
from gradfuse.core import amp
from gradfuse.core.engine import with_clip_coefficient
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.watch import GradWatch
from gradfuse.monitor.clip_strategy import clip_other_modes_, with_zclip_coefficient


@dataclass
class StepPlan:
    """How one step of ``monitor`` takes its statistics and clips (``plan_step`` makes it).

    ``monitor`` is the ``GradMonitor``: its ``optimizer``, ``scaler``, ``norm_type``, ``per``,
    ``layer_depth``, ``clip_value`` and ``agc`` are read when the plan runs.
    """
    monitor: object
    watch: GradWatch
    names_by_param: dict  # id(parameter) -> name, for the fused AMP path
    log_now: bool
    rows: bool  # DTensor gradients: the per-parameter rows are reduced too, not only the total norm
    fused_unscale: bool  # the fused AMP path
    max_norm: object  # this step's max_norm: a float, a ZClip or None
    bad_max_norm: ScheduleError | None  # a schedule that raised or gave a bad value at this step
    plain: bool  # clip by the total norm
    clip_now: bool  # statistics and clip in one call
    value_now: bool  # clamp in one pass, with the statistics from before clamping
    ride: bool  # the clip rides the optimizer's fused step: the coefficient only, no scaling pass
    grads: list | None = None  # the fused AMP path: the gradients it unscales, and the inverse scale
    inv_scale: torch.Tensor | None = None

    def take_stats(self) -> GradStats:
        """The step's statistics, by the plan's pass (the gradients already clipped when
        ``clip_now``, clamped when ``value_now``; on the fused AMP path, still scaled)."""
        m = self.monitor
        if self.fused_unscale:
            names, self.grads = amp.optimizer_named_grads(m.optimizer, self.names_by_param)
            s, self.inv_scale = amp.unscaled_stats(names, self.grads, m.scaler, m.norm_type)
            return s
        if self.clip_now:
            return self.watch.clip_(self.max_norm, rows=self.rows)
        if self.value_now:  # one pass: clamp, with the statistics from before clamping
            return clamp_watch_(self.watch, m.clip_value)
        return self.watch.stats(rows=self.rows)

    def step_scale(self, s: GradStats, clip: bool) -> torch.Tensor | None:
        """The scale the optimizer's step applies as it reads the gradients when the clip rides
        it (None: none): the 0-d clip coefficient, times the inverse loss scale on the fused AMP
        path; per parameter / layer, one coefficient per parameter of the optimizer (float64
        ``[N]``, in its ``param_groups`` order; 1 for one the monitor does not watch). ``s``: the
        statistics ``clip`` returned."""
        if not self.ride:
            return None
        if self.fused_unscale:
            return amp.unscale_coefficient(self.inv_scale, s.clip_coef if clip else None)
        if clip and s.clip_per is not None:
            rows = _rows_of_optimizer(self.monitor.optimizer, s.names, self.names_by_param, s.clip_coef.device)
            return torch.cat([s.clip_coef, s.clip_coef.new_ones(1)]).index_select(0, rows)
        return s.clip_coef if clip else None

    def leave_unscaled(self, s: GradStats) -> None:
        """On the fused AMP path, unscales without clipping (a step that raises leaves the
        gradients in true units, for inspection); else nothing."""
        if self.fused_unscale:
            amp.finish_unscale_(self.monitor.scaler, self.monitor.optimizer, self.grads, s, self.inv_scale, None)

    def clip(self, s: GradStats, clip: bool, skip=None) -> GradStats:
        """Finishes the fused AMP unscale, and clips when ``clip`` (unless the statistics pass
        clipped already).

        Args:
            s: The statistics ``take_stats`` returned.
            clip: The step clips (a mode is set, and the step is neither skipped nor the
                scaler's to skip).
            skip: The step's skip flag on the device (``blocking=False``), or None: a ZClip's
                state stays as it was on a skipped step.

        Returns:
            The statistics, with the clip's ``clip_coef`` and ``clipped`` when it clipped.
        """
        m = self.monitor
        if self.fused_unscale:  # one multiply: unscale, and clip when due (riding: the step's)
            s = amp.finish_unscale_(m.scaler, m.optimizer, self.grads, s, self.inv_scale,
                                    self.max_norm if clip and self.plain else None, apply=not self.ride)
        elif clip and self.ride and m.per is not None:  # the coefficients only (step_scale)
            s = with_per_coefficients(s, self.max_norm, m.per, m.layer_depth, skip)
        elif clip and self.ride:  # the coefficient only: the optimizer's step applies it (step_scale)
            s = (with_zclip_coefficient(s, self.max_norm, skip) if isinstance(self.max_norm, ZClip)
                 else with_clip_coefficient(s, self.max_norm))
        elif clip and self.plain and not self.clip_now and skip is None:
            s = self.watch.clip_to(s, self.max_norm)
        elif clip and self.plain and not self.clip_now:  # a skipped step stays unclipped
            kept = s.plain_total_norm  # (a NaN norm's coefficient would spread the NaN)
            s = self.watch.clip_to(s.replace(total_norm=torch.where(skip, 0.0, kept)), self.max_norm)
            s = s.replace(total_norm=kept)
        if clip and not self.plain and not self.value_now and not self.ride:  # the other modes
            s = clip_other_modes_(s, self.watch, self.max_norm, per=m.per, layer_depth=m.layer_depth,
                                  clip_value=m.clip_value, agc=m.agc, skip=skip)
        return s


def plan_step(monitor, watch: GradWatch, names_by_param: dict, *, log_now: bool, fused_unscale: bool,
              max_norm, bad_max_norm: ScheduleError | None, needs_flag: bool, fused_step: bool = False) -> StepPlan:
    """The plan of one step of ``monitor``.

    Args:
        monitor: The ``GradMonitor`` (its ``sinks``, ``per``, ``clip_value`` and ``norm_type``
            choose the pass).
        watch: Its watch handle.
        names_by_param: id(parameter) -> name, for the fused AMP path.
        log_now: The step is logged.
        fused_unscale: The step unscales the gradients itself (the fused AMP path).
        max_norm: This step's ``max_norm`` (a float, a ``ZClip`` or None).
        bad_max_norm: The error of a bad ``max_norm`` schedule value, or None.
        needs_flag: A policy decides before the clip (no clip in the statistics pass).
        fused_step: The clip rides the optimizer's fused step (``GradMonitor(fused_step=True)``).

    Returns:
        The ``StepPlan``.
    """
    # DTensor gradients: a step that does not log reduces only the total norm (one scalar
    # all-reduce); the rows follow when an anomaly's message reads them (on every rank).
    rows = bool(log_now and monitor.sinks)
    plain = isinstance(max_norm, float) and monitor.per is None
    ride = fused_step and (plain or (not fused_unscale and (isinstance(max_norm, ZClip) or (
        isinstance(max_norm, float) and monitor.per is not None))))
    # With no policy to apply before clipping, statistics and clip are one call.
    clip_now = not fused_unscale and plain and not needs_flag and not ride
    value_now = (not fused_unscale and monitor.clip_value is not None and not needs_flag
                 and monitor.norm_type == 2.0)
    return StepPlan(monitor, watch, names_by_param, log_now, rows, fused_unscale, max_norm, bad_max_norm,
                    plain, clip_now, value_now, ride)


_rows_cache: dict = {}


def _rows_of_optimizer(optimizer, names: list[str], names_by_param: dict, device) -> torch.Tensor:
    """For each parameter of ``optimizer`` (``param_groups`` order), the index of its row in
    ``names`` (the statistics' rows), or ``len(names)`` for one not among them; cached."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    key = (tuple(names), tuple(map(id, params)), str(device))
    hit = _rows_cache.get(key)
    if hit is None:
        at = {name: i for i, name in enumerate(names)}
        hit = torch.tensor([at.get(names_by_param.get(id(p)), len(names)) for p in params])
        if device.type != "cpu":  # pinned, so that the copy does not wait for the device
            hit = hit.pin_memory().to(device, non_blocking=True)
        if len(_rows_cache) > 16:
            _rows_cache.clear()
        _rows_cache[key] = hit
    return hit
