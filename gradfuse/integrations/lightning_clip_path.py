"""gradfuse in the clipping path of Lightning's precision plugin (``ClipPath``), for
``gradfuse.integrations.lightning.GradfuseCallback``.

Lightning clips in its precision plugin: ``clip_gradients`` (with the Trainer's value, or one a
``configure_gradient_clipping`` override asks for) dispatches to ``clip_grad_by_norm`` /
``clip_grad_by_value``, inside ``_clip_gradients``, before ``optimizer_step``. ``ClipPath`` puts
wrappers over these methods of one fit's plugin so that the monitor runs once per optimizer step,
where Lightning clips (or would have), and makes the clip that was asked for. Which clip that is,
and the monitor's step itself, are the callback's: the path is given them as functions.

Layer: integrations. Imports ``lightning`` and ``gradfuse.monitor``.
"""
from __future__ import annotations

from gradfuse.utils import require

require("lightning", "lightning", "integrations.lightning")

from contextlib import contextmanager  # noqa: E402

from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402

from gradfuse.monitor.monitor import GradMonitor  # noqa: E402

# The clip of one step, as the clipping path asks for it: the callback's own mode (its max_norm,
# per=, clip_value=, agc=, or what it took from the Trainer), none, or (algorithm, value).
OWN = "own"


def clip_algorithm(algorithm) -> str:
    """``"norm"`` or ``"value"``, from Lightning's ``GradClipAlgorithmType``, a string or None (norm)."""
    return "value" if str(getattr(algorithm, "value", algorithm)).lower() == "value" else "norm"


def unwrap_optimizer(optimizer):
    """The torch optimizer behind a ``LightningOptimizer`` (what ``self.optimizers()`` returns)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


@contextmanager
def clip_mode(mon: GradMonitor, mode):
    """The monitor clips by ``mode`` for one step (``OWN``: as configured; None: not at all;
    ``("norm", v)`` / ``("value", v)``: by total 2-norm / by value), its configuration restored after."""
    if mode == OWN:
        yield
        return
    saved = (mon.max_norm, mon.clip_value, mon.agc, mon.per)
    algorithm, value = mode if mode is not None else (None, None)
    mon.max_norm = float(value) if algorithm == "norm" else None
    mon.clip_value = float(value) if algorithm == "value" else None
    mon.agc = mon.per = None
    try:
        yield
    finally:
        mon.max_norm, mon.clip_value, mon.agc, mon.per = saved


class ClipPath:
    """gradfuse in the clipping path of one fit's precision plugin.

    Instance attributes over the plugin's methods (``remove`` takes them off):

    - ``clip_gradients``: without a value (Lightning clips nothing), the monitor clips by the
      callback's own mode; with one, Lightning's method runs (its checks and errors) and the clip
      it dispatches to, ``clip_grad_by_norm`` / ``clip_grad_by_value`` (Lightning's own, not a
      plugin's override), is made by the monitor;
    - ``_clip_gradients`` (where Lightning calls ``configure_gradient_clipping``): when it made no
      clip call, the monitor runs after it without clipping (with manual optimization, which has
      no such hook, by the callback's own mode);
    - ``optimizer_step``: the step's round ends with it.

    Where the monitor ran already in the round (a second clip call, or LBFGS evaluating its
    closure again), Lightning's own method runs.

    Args:
        plugin: the Trainer's precision plugin.
        pending: ``pending(optimizer)``: whether the monitor has yet to run for the optimizer's
            coming step (an optimizer of the fit).
        run: ``run(optimizer, mode)``: the monitor's step for it, clipping by ``mode`` (``OWN``,
            None, or ``(algorithm, value)``).
        mode_for: ``mode_for(value, algorithm)``: the clip that Lightning's request gets.
        norm_type: ``norm_type(optimizer)``: the order of the total norm its monitor measures.
        end_round: ``end_round(optimizer)``: its step was taken (or refused).
    """

    def __init__(self, plugin, *, pending, run, mode_for, norm_type, end_round):
        self.plugin = plugin
        self.pending, self.run, self.mode_for = pending, run, mode_for
        self.norm_type, self.end_round = norm_type, end_round
        self.request = None  # (optimizer, value, algorithm) of the clip_gradients call in progress
        self._saved: dict[str, tuple] = {}
        self._patch("optimizer_step", self._optimizer_step)
        self._patch("clip_gradients", self._clip_gradients)
        if callable(getattr(plugin, "_clip_gradients", None)):
            self._patch("_clip_gradients", self._configured)
        for name, algorithm in (("clip_grad_by_norm", "norm"), ("clip_grad_by_value", "value")):
            if getattr(type(plugin), name, None) is getattr(Precision, name):
                self._patch(name, self._clip_by(algorithm))

    def _patch(self, name: str, make) -> None:
        plugin = self.plugin
        self._saved[name] = (name in plugin.__dict__, plugin.__dict__.get(name))
        wrapper = make(getattr(plugin, name))
        self._saved[name] += (wrapper,)
        setattr(plugin, name, wrapper)

    def remove(self) -> None:
        """Restores the plugin's methods."""
        for name, (had_own, previous, wrapper) in self._saved.items():
            if self.plugin.__dict__.get(name) is wrapper:
                if had_own:
                    setattr(self.plugin, name, previous)
                else:
                    delattr(self.plugin, name)
        self._saved = {}

    def _optimizer_step(self, original):
        def optimizer_step(optimizer, *args, **kwargs):
            try:
                return original(optimizer, *args, **kwargs)
            finally:
                self.end_round(unwrap_optimizer(optimizer))
        return optimizer_step

    def _clip_gradients(self, original):
        def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm=None, **kwargs):
            args = (optimizer, clip_val) + (() if gradient_clip_algorithm is None else (gradient_clip_algorithm,))
            opt = unwrap_optimizer(optimizer)
            if not self.pending(opt):
                return original(*args, **kwargs)
            if not clip_val or clip_val <= 0:  # Lightning clips nothing: gradfuse's own mode
                self.run(opt, OWN)
                return original(*args, **kwargs)
            previous, self.request = self.request, (opt, clip_val, clip_algorithm(gradient_clip_algorithm))
            try:
                out = original(*args, **kwargs)
            finally:
                self.request = previous
            if self.pending(opt):  # the plugin clips its own way (or not): statistics and policies
                self.run(opt, None)
            return out
        return clip_gradients

    def _clip_by(self, algorithm: str):
        def make(original):
            def clip_by(optimizer, clip_val, *args, **kwargs):
                opt = unwrap_optimizer(optimizer)
                if self.request is None or self.request[0] is not opt or not self.pending(opt):
                    return original(optimizer, clip_val, *args, **kwargs)
                mode = self.mode_for(clip_val, algorithm)
                if mode != OWN and algorithm == "norm" and self.norm_type(opt) != 2.0:
                    self.run(opt, None)  # Lightning clips by the 2-norm; the monitor measures another
                    return original(optimizer, clip_val, *args, **kwargs)
                self.run(opt, mode)
            return clip_by
        return make

    def _configured(self, original):
        def configured(model, optimizer, *args, **kwargs):
            out = original(model, optimizer, *args, **kwargs)
            opt = unwrap_optimizer(optimizer)
            if self.pending(opt):  # no clip was asked for: the override (if any) decided so
                self.run(opt, None if getattr(model, "automatic_optimization", True) else OWN)
            return out
        return configured
