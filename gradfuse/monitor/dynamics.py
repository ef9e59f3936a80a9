"""What ``GradMonitor(noise_scale=..., update_ratios=...)`` adds to a step: the gradient noise
scale (``gradfuse.dynamics.noise_scale``) every step, and the update-to-weight ratios
(``gradfuse.dynamics.update_ratio``) on logging steps. The monitor calls
``Dynamics.on_step`` after its own statistics and clip, right before the optimizer steps,
and ``Dynamics.record`` when it writes a record.

Layer: monitor. Imports ``gradfuse.dynamics`` and ``gradfuse.ops.layout``.
"""
from __future__ import annotations

import torch

from gradfuse.dynamics.noise_scale import NoiseScale
from gradfuse.dynamics.update_ratio import UpdateRatios
from gradfuse.ops.layout import SUMSQ
from gradfuse.utils import warn


class Dynamics:
    """The monitor's noise-scale estimator and update-ratio capture (either may be None)."""

    def __init__(self, noise_scale, update_ratios, *, optimizer=None, names_by_param=None,
                 layer_depth: int | None = None):
        self.noise_scale: NoiseScale | None = None
        if noise_scale is True:
            self.noise_scale = NoiseScale()
        elif isinstance(noise_scale, NoiseScale):
            self.noise_scale = noise_scale
        elif noise_scale not in (None, False):
            raise TypeError("gradfuse.GradMonitor: noise_scale must be True, False or a gradfuse.NoiseScale, "
                            f"got {type(noise_scale).__name__}")
        self.update_ratios: UpdateRatios | None = None
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
        # An integration that writes records later than the step (the HF Trainer logs after the
        # update) sets this before the step it will log.
        self.capture_next = False
        self._captured: tuple[int, dict] | None = None

    def micro_step(self, watch) -> None:
        """After a micro-batch's backward; ``watch``: the monitor's handle on the gradients."""
        if self.noise_scale is not None:
            self.noise_scale.after_backward(watch)

    def on_step(self, report, log_now: bool, loss_scale=None) -> None:
        """After the monitor's statistics and clip, before the optimizer steps; ``loss_scale``:
        the GradScaler's scale tensor when AMP scales the gradients."""
        s = report.stats
        skipped = report.skip or "amp_overflow" in report.anomalies or s is None
        ns = self.noise_scale
        if ns is not None:
            if skipped or not len(s):
                ns.skip_step()
            else:
                ns.step(g2=s.floats[:, SUMSQ].sum(), loss_scale=loss_scale)
        capture, self.capture_next = log_now or self.capture_next, False
        if self.update_ratios is not None and capture:
            got = self.update_ratios.capture(applied=not skipped)
            self._captured = None if got is None else (report.step, got)

    def record(self, report) -> dict:
        """The record's additions for ``report``: ``noise_scale`` ({noise_scale, G2, trSigma}, the
        estimates so far), and when captured at this step ``update_ratio``, ``weight_norm``,
        ``update_norm`` (per layer), or ``update_ratio_unavailable`` (why not)."""
        out = {}
        if self.noise_scale is not None:
            out["noise_scale"] = self.noise_scale.host_values()
        ur = self.update_ratios
        if ur is not None:
            if ur.unavailable:
                out["update_ratio_unavailable"] = ur.unavailable
            elif self._captured is not None and self._captured[0] == report.step:
                out.update(ur.layers(self._captured[1]))
        return out

    def state_dict(self) -> dict:
        """The noise scale estimator's state, for checkpoints."""
        return {"noise_scale": None if self.noise_scale is None else self.noise_scale.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores the noise scale estimator's state from ``state_dict``'s output."""
        if self.noise_scale is not None and state.get("noise_scale") is not None:
            self.noise_scale.load_state_dict(state["noise_scale"])
