"""The monitor's clip strategy: its clip in every mode from the step's statistics
(``monitor_clip_``), a step's ``max_norm`` (``max_norm_of_step``), the check that nothing
clipped the gradients before it (``DoubleClipCheck``), and the description of a configured mode.

Layer: monitor. Imports ``gradfuse.core`` and ``gradfuse.clip``.
"""
from __future__ import annotations

import torch

from gradfuse.clip.agc import adaptive_clip_grad_
from gradfuse.clip.per import clip_per_
from gradfuse.clip.schedule import ScheduleError, max_norm_at
from gradfuse.clip.value import clamp_watch_
from gradfuse.clip.zclip import ZClip, scale_total_
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.params import with_grads
from gradfuse.utils import warn


def max_norm_of_step(max_norm, step: int) -> tuple[object, ScheduleError | None]:
    """(the ``max_norm`` of step ``step``: a float, a ``ZClip`` or None, from a number, a ``ZClip``
    or a schedule; the ``ScheduleError`` of a schedule that raised or gave a bad value, then with None)."""
    if callable(max_norm) and not isinstance(max_norm, ZClip):
        try:
            return max_norm_at(max_norm, step), None
        except ScheduleError as e:
            return None, e
    return max_norm, None


def describe_mode(max_norm, monitor_kwargs: dict) -> str | None:
    """How an integration's own clipping is configured, in words (None: not at all)."""
    if monitor_kwargs.get("clip_value") is not None:
        return f"clip_value={monitor_kwargs['clip_value']:g}"
    if monitor_kwargs.get("agc") is not None:
        return f"agc={monitor_kwargs['agc']:g}"
    if max_norm is None:
        return None
    if isinstance(max_norm, ZClip):
        return repr(max_norm)
    if callable(max_norm):
        return "a max_norm schedule"
    return f"max_norm={float(max_norm):g}"


class DoubleClipCheck:
    """Notices gradients changed in place between the end of the backward and the monitor's clip
    (a ``clip_grad_norm_`` of the user's or of a framework multiplies every gradient, even when
    it does not clip), from the gradients' version counters, on every rank on its own (no
    collective).

    Post-accumulate-grad hooks on a few sentinel parameters note that a backward accumulated
    into them and queue an autograd final callback, which queues a second one: callbacks queued
    by a callback run after every callback queued during the backward, among them DDP's
    reducer's (``finalize_backward``, which writes the all-reduced gradients back: a
    ``copy_`` or an in-place division of the bucket view, each a version bump). The second
    callback records each sentinel gradient's version counter once the backward, DDP's
    synchronisation included, is over; ``changed`` compares it at step time. Costs two hooks
    and four callbacks per backward, whatever the model's size."""

    def __init__(self, params: list[torch.Tensor], names: list[str]):
        self._seen: dict[int, tuple[int, torch.Tensor]] = {}
        self._touched: set[int] = set()
        self._handles = []
        self.names = {}
        self._params: dict[int, torch.Tensor] = {}
        trainable = [(n, p) for n, p in zip(names, params)
                     if isinstance(p, torch.Tensor) and p.requires_grad and p.is_leaf]
        for name, p in {id(p): (n, p) for n, p in (trainable[:1] + trainable[-1:])}.values():
            key = id(p)
            self.names[key] = name
            self._params[key] = p
            try:
                self._handles.append(p.register_post_accumulate_grad_hook(self._recorder(key)))
            except RuntimeError:
                pass

    def _recorder(self, key: int):
        def hook(p):
            self._touched.add(key)
            try:  # once per sentinel and backward (a backward that fails runs no callback)
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            except RuntimeError:  # not inside an engine's backward: record now
                self._record()
        return hook

    def _after_backward(self) -> None:
        # Runs with the final callbacks queued during the backward; queue the recording behind
        # them (DDP's finalize_backward among them).
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._record)
        except RuntimeError:
            self._record()

    def _record(self) -> None:
        touched, self._touched = self._touched, set()
        for key in touched:
            g = self._params[key].grad
            if g is not None:
                self._seen[key] = (g._version, g)

    def changed(self, allowed: int = 0) -> str | None:
        """The name of a sentinel whose gradient was changed in place more than ``allowed`` times
        since the end of the backward that last accumulated into it, else None; then forgets
        what it recorded."""
        seen, self._seen = self._seen, {}
        for key, (version, grad) in seen.items():
            if grad._version > version + allowed:
                return self.names[key]
        return None

    def warn_once(self, allowed: int, call: str) -> bool:
        """Warns (``double_clip_message``, naming ``call``) when ``changed(allowed)`` names a
        sentinel, and then takes the hooks off (the warning is shown once); returns whether it
        warned."""
        name = self.changed(allowed)
        if name is not None:
            self.remove()
            warn(double_clip_message(call, name))
        return name is not None

    def remove(self) -> None:
        """Takes the hooks off the sentinel parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []


def double_clip_message(call: str, name: str) -> str:
    """The warning for gradients changed in place before gradfuse's clip, seen on ``name`` by ``call``."""
    return (f"{call}: the gradients were already changed in place since the backward "
            f"(seen on {name!r}): something scaled or clipped them before gradfuse's own clip "
            "(torch.nn.utils.clip_grad_norm_ / clip_grad_value_, a framework's gradient "
            "clipping, accelerator.clip_grad_norm_). Clipping twice shrinks every update. Hand "
            "clipping to gradfuse: remove the other call and pass max_norm= (or per=, "
            "clip_value=, agc=, a ZClip) to gradfuse. If the change was meant (your own gradient "
            "scaling), pass check_double_clip=False. (This warning is shown once.)")


def with_zclip_coefficient(s: GradStats, zclip: ZClip, skip=None) -> GradStats:
    """``s`` with the coefficient ``zclip`` takes for its total norm (one step of its state;
    ``skip``: the step's device skip flag, which leaves the state), nothing scaled."""
    return s.replace(clip_coef=zclip.clip_coef(s.plain_total_norm, skip=skip), max_norm=None)


def monitor_clip_(s: GradStats, named_grads, mode: dict, max_norm_now, skip=None) -> GradStats:
    """Clips the gradients ``s`` was taken of (``named_grads``: their names and tensors) by the
    monitor's configured mode; ``max_norm_now`` is this step's float max_norm or a ZClip
    (``skip``: the step's device skip flag, which leaves a ZClip's state as it was).
    Returns ``s`` with what was applied."""
    _names, grads = named_grads
    if isinstance(max_norm_now, ZClip):
        s = with_zclip_coefficient(s, max_norm_now, skip)
        scale_total_(grads, s.clip_coef, s.plain_total_norm.dtype)
        return s
    if mode.get("per"):
        if list(s.names) != list(_names):
            # rows follow the grouping; re-order the gradients to match them
            by_name = dict(zip(_names, grads))
            grads = [by_name[n] for n in s.names]
        return clip_per_(s, grads, max_norm_now, mode["per"], mode.get("layer_depth"), skip)
    raise AssertionError("monitor_clip_: no mode")



def clip_other_modes_(s: GradStats, watch, max_norm_now, *, per: str | None, layer_depth: int | None,
                      clip_value: float | None, agc: tuple | None, skip=None) -> GradStats:
    """The monitor's clip in the modes other than one plain ``max_norm``: AGC (``agc``: its
    checked (clip_factor, eps, norm_type)), by value, per parameter or layer, or a ZClip
    threshold; ``watch`` is the monitor's handle on the gradients ``s`` was taken of; ``skip``:
    the step's device skip flag (a ZClip's state stays on a skipped step)."""
    if agc is not None:
        cf, eps, p = agc
        _names, params, _grads = with_grads(watch.names, watch.params)
        adaptive_clip_grad_(params, cf, eps, p)
        return s
    if clip_value is not None:
        clamped = clamp_watch_(watch, clip_value)
        s = s.replace()
        s.clamped, s.clip_value = clamped.clamped, clip_value
        return s
    return monitor_clip_(s, watch.named_grads(), {"per": per, "layer_depth": layer_depth},
                         max_norm_now, skip)
