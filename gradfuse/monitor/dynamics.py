"""What ``GradMonitor(noise_scale=..., update_ratios=..., max_update_rms=...)`` adds to a step:
the gradient noise scale (``gradfuse.dynamics.noise_scale``) every step; the optimizer's
statistics per layer (``gradfuse.dynamics.update_ratio``) on logging steps, every
``update_every`` steps, and on every step that limits the updates or whose flight recorder
records them (one fused pass serves them all); and the update clipping of ``max_update_rms``
(``gradfuse.dynamics.update_clip``). With ``fused_step=True`` and update statistics of the
monitor's ``gradfuse.optim`` optimizer alone, both ride that optimizer's step: its
``stats=True`` rows are the statistics, and it applies ``max_update_rms`` itself (no update
clipping hooks; the counters and records come from the coefficients it reports). The monitor
calls ``Dynamics.on_step`` after its own statistics and clip, right before the optimizer steps,
and ``Dynamics.record`` when it writes a record.

Layer: monitor. Imports ``gradfuse.dynamics`` and ``gradfuse.ops.layout``.
"""
from __future__ import annotations

import dataclasses

import torch

from gradfuse.core.host_copy import HostCopy
from gradfuse.dynamics.noise_scale import NoiseScale, values_of_packed
from gradfuse.dynamics.update_clip import UpdateClip, update_coefs
from gradfuse.dynamics.update_ratio import UpdateRatios
from gradfuse.ops.layout import SUMSQ, UPDATE_SUMSQ
from gradfuse.utils import warn


class Dynamics:
    """The monitor's noise-scale estimator, update statistics and update clipping (each may be None)."""

    def __init__(self, noise_scale, update_ratios, *, optimizer=None, names_by_param=None,
                 layer_depth: int | None = None, update_every: int | None = None, max_update_rms=None,
                 fused_optimizer=None):
        self.noise_scale: NoiseScale | None = None
        if noise_scale is True:
            self.noise_scale = NoiseScale()
        elif isinstance(noise_scale, NoiseScale):
            self.noise_scale = noise_scale
        elif noise_scale not in (None, False):
            raise TypeError("gradfuse.GradMonitor: noise_scale must be True, False or a gradfuse.NoiseScale, "
                            f"got {type(noise_scale).__name__}")
        self.update_ratios: UpdateRatios | None = None
        if max_update_rms is not None and update_ratios in (None, False):
            if optimizer is None:
                raise ValueError("gradfuse.GradMonitor: max_update_rms needs the optimizer: pass "
                                 "update_ratios=optimizer (or a list of optimizers); gradfuse.attach passes it itself")
            update_ratios = True
        if update_every is not None and (not isinstance(update_every, int) or isinstance(update_every, bool)
                                         or update_every < 1):
            raise ValueError(f"gradfuse.GradMonitor: update_every must be an int >= 1 or None, got {update_every!r}")
        if update_every is not None and update_ratios in (None, False):
            raise ValueError("gradfuse.GradMonitor: update_every needs update_ratios (the optimizer)")
        self.update_every = update_every
        if update_ratios not in (None, False):
            if update_ratios is True:
                if optimizer is None:
                    raise ValueError("gradfuse.GradMonitor: update_ratios=True needs the optimizer: pass "
                                     "update_ratios=optimizer (or a list of optimizers); gradfuse.attach and "
                                     "the integrations pass it themselves")
                optimizers = [optimizer]
            elif isinstance(update_ratios, torch.optim.Optimizer):
                optimizers = [update_ratios]
            else:
                optimizers = list(update_ratios)
                if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
                    raise TypeError("gradfuse.GradMonitor: update_ratios must be True, an optimizer or a "
                                    "list of optimizers")
            self.update_ratios = UpdateRatios(optimizers, names_by_param, layer_depth)
            if self.update_ratios.unavailable:
                warn(f"gradfuse.GradMonitor: {self.update_ratios.unavailable}; update_ratio/* and "
                     "weight_norm/* are not logged")
        # fused_step: the statistics and the update clipping of the monitor's gradfuse.optim
        # optimizer ride its step (when they are of that optimizer alone)
        self.rides_step = (fused_optimizer is not None and self.update_ratios is not None
                           and self.update_ratios.optimizers == [fused_optimizer])
        self.update_clip: UpdateClip | None = None
        if max_update_rms is not None:
            self.update_clip = UpdateClip(self.update_ratios.optimizers, max_update_rms, hooks=not self.rides_step)
        self._clip_restored = {"update_clipped_params": 0, "update_clipped_steps": 0}
        # An integration that writes records later than the step (the HF Trainer logs after the
        # update) sets this before the step it will log.
        self.capture_next = False
        self._captured: tuple[int, dict] | None = None
        # blocking=False: the latest step's number, whether it offered a pair, the host copies of
        # the estimates and of the updates rescaled; and the rescaled updates of the steps settled
        self._deferred: dict | None = None
        self._settled_clips: dict[str, int] | None = None

    def micro_step(self, watch) -> None:
        """After a micro-batch's backward; ``watch``: the monitor's handle on the gradients."""
        if self.noise_scale is not None:
            self.noise_scale.after_backward(watch)

    def on_step(self, report, log_now: bool, loss_scale=None, need_updates: bool = False,
                from_step: bool = False) -> bool:
        """After the monitor's statistics and clip, before the optimizer steps; ``loss_scale``:
        the GradScaler's scale tensor when AMP scales the gradients; ``need_updates``: the flight
        recorder records this step's update (taken here, in the same pass, when the optimizers
        are the same). The update statistics go into ``report.updates``. ``from_step``: the
        optimizer's own step takes them (a ``gradfuse.optim`` step with ``stats=True``): returns
        whether this step wants them, for ``take_step_rows`` after the step."""
        s = report.stats
        skipped = report.skip or "amp_overflow" in report.anomalies or s is None
        self._noise_step(s, skipped, loss_scale)
        capture, self.capture_next = log_now or self.capture_next, False
        every = self.update_every is not None and report.step % self.update_every == 0
        ur, clip = self.update_ratios, self.update_clip
        if clip is not None and skipped:
            clip.cancel()  # the optimizer does not step: nothing to rescale
        if ur is None or not (capture or every or need_updates or (clip is not None and not skipped)):
            return False
        if from_step and not skipped:  # the step's rows, and with max_update_rms its coefficients
            return True
        got = ur.capture(applied=not skipped)
        if got is not None and clip is not None and not skipped:
            got = _with_coefs(got, clip.prepare(got["rows"]))
        self._captured = None if got is None else (report.step, got)
        report.updates = got
        return False

    def on_deferred_step(self, report, skip, log_now: bool, loss_scale=None, need_updates: bool = False,
                         from_step: bool = False) -> bool:
        """``on_step`` of a ``blocking=False`` step, whose skip the host has not read: ``skip``
        is its 0-d device flag (None: never skipped), and with AMP (``loss_scale``) a non-finite
        step is the scaler's to skip. The noise scale averages in the step's pair unless it is
        skipped; the update statistics are taken as ``on_step`` takes them, zero where the step
        is skipped, their per-layer table copied now (``need_updates``: on every step, for the
        flight recorder); ``max_update_rms`` gets coefficients of 1 where the step is skipped
        (its hooks then rescale nothing). The estimates and the count of rescaled updates are
        copied now too; ``settle`` finishes the step when the host has read its skip.
        ``from_step``: the ``gradfuse.optim`` step takes the update statistics: returns whether
        this step wants them, for ``take_deferred_rows`` after the step."""
        s = report.stats
        held = skip
        if loss_scale is not None and s is not None:  # an overflow: GradScaler does not step
            held = s.nonfinite if held is None else held | s.nonfinite
        ns = self.noise_scale
        offered = self._noise_step(s, s is None, loss_scale, held)
        if self.update_clip is not None and self._settled_clips is None:
            self._settled_clips = {"update_clipped_params": 0, "update_clipped_steps": 0}
        self._deferred = {"step": report.step, "offered": offered, "clipped": None,
                          "estimates": HostCopy([None if ns is None else ns.packed_values()])}
        capture, self.capture_next = log_now or self.capture_next, False
        every = self.update_every is not None and report.step % self.update_every == 0
        ur, clip = self.update_ratios, self.update_clip
        if ur is None or not (capture or every or need_updates or clip is not None):
            return False
        if from_step:
            return True
        got = ur.capture(applied=True if held is None else ~held)
        if got is not None and clip is not None:
            coefs = clip.coefs(got["rows"])
            got = _with_coefs(got, clip.prepare(got["rows"], coefs if held is None else torch.where(held, 1.0, coefs)))
        self._deferred_take(report, got)
        return False

    def _noise_step(self, s, skipped: bool, loss_scale, skip=None) -> bool:
        """The noise scale's step (``skip``: a device flag); whether it offered a pair."""
        ns = self.noise_scale
        if ns is None:
            return False
        if skipped or not len(s):
            ns.skip_step()
            return False
        return ns.step(g2=s.floats[:, SUMSQ].sum(), loss_scale=loss_scale, skip=skip)

    def take_deferred_rows(self, report, step_rows, skip) -> None:
        """``take_step_rows`` for a ``blocking=False`` step (``on_deferred_step`` said it wants
        them): the rows its ``gradfuse.optim`` step took (None: it did not step), zero where
        ``skip`` (its device flag) skipped it, their table and count of rescaled updates copied."""
        if step_rows is not None:
            self.take_step_rows(report, step_rows, applied=True if skip is None else ~skip)
            self._deferred_take(report, report.updates)

    def _deferred_take(self, report, got) -> None:
        if got is not None:
            self.update_ratios.start_host_copy(got)
            if "coefs" in got:
                self._deferred["clipped"] = HostCopy([(got["coefs"] < 1).sum()])
        self._captured = None if got is None else (report.step, got)
        report.updates = got

    def settle(self, report) -> None:
        """A ``blocking=False`` step, decided: a skipped step's pair (or an AMP overflow's) was
        not averaged in, so it does not count in ``NoiseScale.updates`` either (as with
        ``on_step``); its update statistics say it applied nothing; the updates it rescaled
        are counted."""
        deferred = self._deferred
        if deferred is None or deferred["step"] != report.step:
            return
        skipped = report.skip or "amp_overflow" in report.anomalies
        if deferred["offered"] and skipped:
            self.noise_scale.updates -= 1
        if self._captured is not None and self._captured[0] == report.step:
            self._captured[1]["applied"] = not skipped
            if skipped:  # nothing rescaled: the record says nothing of the update clipping (as on_step)
                self._captured[1].pop("coefs", None)
        if deferred["clipped"] is not None:
            [clipped] = deferred["clipped"].get()
            self._settled_clips["update_clipped_params"] += int(clipped)
            self._settled_clips["update_clipped_steps"] += int(clipped) > 0

    def take_step_rows(self, report, step_rows: list, applied=True) -> None:
        """The update statistics of ``report``'s step from the rows its ``gradfuse.optim`` step took
        (``optimizer.last_rows``), into ``report.updates``: what ``on_step`` would have taken
        (``applied``: a device flag where the host has not read the skip)."""
        got = self.update_ratios.from_step(step_rows, applied)
        clip = self.update_clip
        if got is not None and clip is not None:  # the step's coefficients, then those of the rows it left alone
            rows, n = got["rows"], got["planned"]
            rest = update_coefs(dataclasses.replace(rows, floats=rows.floats[n:], counts=rows.counts[n:]), clip.max_rms)
            got = {**got, "coefs": torch.cat([clip.last_coefs.to(rest.device), rest])}
        self._captured = None if got is None else (report.step, got)
        report.updates = got

    def planned_updates(self, report, optimizers):
        """The ``UpdateRows`` of ``report``'s step over ``optimizers`` (the parameters the step
        changes; their updates as applied, after any update clipping) when this step took them
        for the same optimizers, else None."""
        ur = self.update_ratios
        got = report.updates
        if got is None or ur is None or list(optimizers) != ur.optimizers:
            return None
        rows, n = got["rows"], got["planned"]
        return dataclasses.replace(rows, params=rows.params[:n], floats=rows.floats[:n], counts=rows.counts[:n],
                                   adam=rows.adam[:n], moment1=rows.moment1[:n])

    def record(self, report) -> dict:
        """The record's additions for ``report``: ``noise_scale`` ({noise_scale, G2, trSigma}, the
        estimates so far), and when captured at this step the per-layer optimizer statistics
        (``update_ratio``, ``weight_norm``, ``update_norm``, ``update_rms``, ``moment1_rms``,
        ``moment2_rms``, ``eps_dominated``, ``update_nonfinite``, ``moment_nonfinite``,
        ``weight_nonfinite``) and with ``max_update_rms`` ``update_clipped`` (the parameters whose
        update is rescaled at this step), or ``update_ratio_unavailable`` (why not)."""
        out = {}
        deferred = self._deferred if self._deferred is not None and self._deferred["step"] == report.step else None
        if self.noise_scale is not None:  # a blocking=False step's: from the copy its step took
            [packed] = [self.noise_scale.packed_values()] if deferred is None else deferred["estimates"].get()
            out["noise_scale"] = None if packed is None else values_of_packed(packed)
        ur = self.update_ratios
        if ur is not None:
            if ur.unavailable:
                out["update_ratio_unavailable"] = ur.unavailable
            elif self._captured is not None and self._captured[0] == report.step:
                got = self._captured[1]
                out.update(ur.layers(got))
                if "coefs" in got:
                    clipped = deferred["clipped"].get()[0] if deferred is not None else (got["coefs"] < 1).sum()
                    out["update_clipped"] = int(clipped)
        return out

    def counters(self) -> dict[str, int]:
        """With ``max_update_rms``: ``update_clipped_params`` (parameter updates rescaled) and
        ``update_clipped_steps`` (steps that rescaled one), restored ones included (reads the
        device counters); else empty."""
        if self.update_clip is None:
            return {}
        now = self._clip_counts()
        return {k: now[k] + self._clip_restored[k] for k in now}

    def _clip_counts(self) -> dict[str, int]:
        # blocking=False: the steps settled so far, from their host copies; else the device counters
        return dict(self._settled_clips) if self._settled_clips is not None else self.update_clip.counts()

    def state_dict(self) -> dict:
        """The noise scale estimator's state, for checkpoints."""
        state = {"noise_scale": None if self.noise_scale is None else self.noise_scale.state_dict()}
        if self.update_clip is not None:
            state["update_clip"] = self.counters()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores the noise scale estimator's state from ``state_dict``'s output."""
        if self.noise_scale is not None and state.get("noise_scale") is not None:
            self.noise_scale.load_state_dict(state["noise_scale"])
        if self.update_clip is not None and state.get("update_clip") is not None:
            now = self._clip_counts()
            self._clip_restored = {k: int(state["update_clip"].get(k, 0)) - now[k] for k in now}


def _with_coefs(got: dict, coefs: torch.Tensor) -> dict:
    """``got`` (a capture) with the update clipping's ``coefs``: its rows describe the update
    applied, rescaled where the coefficient is below 1."""
    rows = got["rows"]
    scale = torch.where(coefs < 1, coefs * coefs, torch.ones_like(coefs))
    floats = rows.floats.clone()
    floats[:, UPDATE_SUMSQ] = floats[:, UPDATE_SUMSQ] * scale
    return {**got, "rows": dataclasses.replace(rows, floats=floats), "coefs": coefs}
