"""``StepGate``: a decision taken right before an optimizer's ``step()`` that may skip it, the way
``GradScaler`` skips one: what ``gradfuse.attach``, the Lightning callback, the Hugging Face
Trainer's attachment and the torchtitan attachment skip a step with.

Layer: integrations. Imports torch only.
"""
from __future__ import annotations

import types
from collections.abc import Callable

import torch

# What torch's LRScheduler marks the optimizer step it wrapped with (torch/optim/lr_scheduler.py);
# it warns when the step it finds at its first step lacks the mark.
LR_SCHEDULER_MARK = "_wrapped_by_lr_sched"


class StepGate:
    """Lets a decision taken right before ``optimizer.step()`` skip that step, the way
    ``GradScaler`` skips one: the optimizer's own ``step`` is not called at all, so parameters,
    momentum, weight decay and step counters stay as they were.

    ``optimizer.step`` becomes a bound method of the optimizer (an LR scheduler created later
    wraps it in turn, as it wraps the original). A step that an LR scheduler wrapped before keeps
    what torch's ``LRScheduler`` looks for: the replacement carries the wrapper's mark (so the
    scheduler does not warn that the step was overridden after it), and each call notes on the
    optimizer that its step was called, as the wrapper does, a skipped step included (so the
    scheduler does not warn that it stepped before the optimizer).

    With a closure, the gate evaluates it first (it runs backward), asks ``before_step(optimizer)``
    whether to skip, and hands the optimizer the loss it got (the optimizer's further evaluations,
    e.g. LBFGS's line search, call the closure again). A skipped step returns the closure's loss,
    or None. ``on_skip(optimizer)`` runs after a skip (e.g. a scaler's bookkeeping). While
    ``bypass(optimizer)`` is true the gate passes the call straight through, closure and all,
    without asking ``before_step`` (an accelerate micro-step, where the wrapped ``step`` does
    nothing). With a closure, ``on_loss(loss)`` gets the closure's result before ``before_step``
    is asked. ``remove`` restores ``step``.
    """

    def __init__(self, optimizer, before_step: Callable[[object], bool],
                 on_skip: Callable[[object], None] | None = None,
                 bypass: Callable[[object], bool] | None = None,
                 on_loss: Callable[[object], None] | None = None):
        if getattr(optimizer, "_gradfuse_gate", None) is not None:
            raise RuntimeError(f"gradfuse: {type(optimizer).__name__} already has a gradfuse step gate; "
                               "detach the first attachment before attaching again")
        self.optimizer = optimizer
        self.before_step = before_step
        self.on_skip = on_skip
        self.bypass = bypass
        self.on_loss = on_loss
        self.active = True
        self._had_own_step = "step" in optimizer.__dict__  # e.g. an LR scheduler's wrapper
        self._previous = optimizer.__dict__.get("step")
        self._inner = optimizer.step
        # The optimizers whose step an LR scheduler may wrap: this one, and the one inside a wrapper
        # (accelerate's AcceleratedOptimizer steps its .optimizer).
        self._schedulable = [o for o in (optimizer, getattr(optimizer, "optimizer", None))
                             if isinstance(o, torch.optim.Optimizer)]
        gate = self

        def step(opt, *args, **kwargs):
            return gate._step(args, kwargs)

        if hasattr(self._inner, LR_SCHEDULER_MARK):
            setattr(step, LR_SCHEDULER_MARK, True)  # a bound method reads its function's attributes
        self._bound = types.MethodType(step, optimizer)
        optimizer.step = self._bound
        optimizer._gradfuse_gate = self

    def _step(self, args: tuple, kwargs: dict):
        for opt in self._schedulable:  # what an LR scheduler's wrapper notes, skipped step or not
            if hasattr(opt.step, LR_SCHEDULER_MARK):
                opt._opt_called = True
        if not self.active or (self.bypass is not None and self.bypass(self.optimizer)):
            return self._inner(*args, **kwargs)
        closure = kwargs.get("closure", args[0] if args else None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            pending = [loss]

            def replay():  # the first evaluation is the one that ran; later ones run again
                return pending.pop() if pending else closure()

            if "closure" in kwargs:
                kwargs = {**kwargs, "closure": replay}
            else:
                args = (replay,) + tuple(args[1:])
            if self.on_loss is not None and loss is not None:
                self.on_loss(loss)
        if self.before_step(self.optimizer):
            if self.on_skip is not None:
                self.on_skip(self.optimizer)
            return loss
        return self._inner(*args, **kwargs)

    def remove(self) -> None:
        """Restores ``optimizer.step``; if something wrapped it after the gate (an LR scheduler
        created later), the gate stays in that chain but only passes calls through."""
        self.active = False
        opt = self.optimizer
        if opt.__dict__.get("step") is self._bound:
            if self._had_own_step:
                opt.step = self._previous
            else:
                del opt.step
        if getattr(opt, "_gradfuse_gate", None) is self:
            del opt._gradfuse_gate
