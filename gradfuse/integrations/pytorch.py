"""``gradfuse.attach``: the monitor, the clip and the policies right before every
``optimizer.step()``, with no other change to a plain PyTorch loop."""
from __future__ import annotations

import types
from collections.abc import Iterable

import torch
from torch import nn

from gradfuse.integrations.step_gate import StepGate
from gradfuse.monitor.device_skip import device_skip_kind
from gradfuse.monitor.monitor import GradMonitor, StepReport
from gradfuse.optim import from_torch


def accelerate_parts(optimizer):
    """``(inner optimizer, gradient state, scaler)`` when ``optimizer`` is accelerate's
    ``AcceleratedOptimizer`` (what ``accelerator.prepare`` returns), else None. Recognised by its
    attributes, without importing accelerate."""
    state = getattr(optimizer, "gradient_state", None)
    inner = getattr(optimizer, "optimizer", None)
    if (type(optimizer).__name__ == "AcceleratedOptimizer" and isinstance(inner, torch.optim.Optimizer)
            and hasattr(state, "sync_gradients")):
        return inner, state, getattr(optimizer, "scaler", None)
    return None


def named_optimizer_params(optimizers, model: nn.Module | None = None) -> list[tuple[str, torch.Tensor]]:
    """The parameters the optimizers update, once each, named by ``model`` when given, else by the
    names the optimizer was built with (``AdamW(model.named_parameters())``), else
    ``group{g}.{i}`` (prefixed ``opt{k}.`` with several optimizers)."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    out, seen = [], set()
    for k, opt in enumerate(optimizers):
        prefix = f"opt{k}." if len(optimizers) > 1 else ""
        for g, group in enumerate(opt.param_groups):
            own = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                out.append((names.get(id(p)) or (own[i] if own else f"{prefix}group{g}.{i}"), p))
    return out


class Attachment:
    """What ``gradfuse.attach`` returns. ``monitor`` is the ``GradMonitor`` (counters,
    ``state_dict()``), ``last_report`` the latest ``StepReport``; ``detach`` undoes
    the attachment (also as a context manager).

    Made by ``gradfuse.attach``, not directly.

    The loss of a step, for the monitor's flight recorder (``recorder=``): the closure's result
    when ``optimizer.step(closure)`` is given one, else what ``loss(value)`` was given before
    the step.

    Attributes:
        monitor (GradMonitor): The monitor that runs before each ``optimizer.step()``.
        last_report (StepReport | None): The latest step's report (None before the first).
        optimizers (list): The attached optimizers.
        scaler: The ``GradScaler`` in use (given, or accelerate's under fp16), or None.

    Example:
        ```python
        with gradfuse.attach(optimizer, model, max_norm=1.0) as handle:
            for x, y in loader:
                loss_fn(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                if handle.last_report.skip:
                    print("skipped:", handle.last_report.message)
        print(handle.monitor.counters())
        ```
    """

    def __init__(self, optimizers: list, model: nn.Module | None, scaler, monitor_kwargs: dict):
        self.optimizers = optimizers
        # accelerate: the AcceleratedOptimizer is gated (accelerate swaps the inner optimizer's step
        # in and out around its scaler's steps); its step does nothing while accelerate accumulates
        # (sync_gradients False), and neither does the gate then. The scaler keys its state by the
        # inner optimizer, and it is accelerate's own scaler (fp16) unless one is given.
        accelerated = [accelerate_parts(o) for o in optimizers]
        self._gradient_states = [a[1] for a in accelerated if a is not None]
        self._accelerated = {id(o) for a, o in zip(accelerated, optimizers) if a is not None}
        own = {id(a[2]): a[2] for a in accelerated if a is not None and a[2] is not None}
        if scaler is None and len(own) == 1:
            scaler = next(iter(own.values()))
        self._accelerate_scaler = scaler is not None and id(scaler) in own
        self._scaled = [a[0] if a is not None else o for a, o in zip(accelerated, optimizers)]
        self.scaler = scaler
        named = named_optimizer_params(optimizers, model)
        # One optimizer: the monitor unscales itself, fused with its statistics (one read, one
        # write) unless scaler.unscale_ ran already. Several: each is unscaled with scaler.unscale_.
        fused = scaler is not None and len(optimizers) == 1
        if monitor_kwargs.get("update_ratios") is True or (  # the optimizers attached to
                monitor_kwargs.get("max_update_rms") is not None and not monitor_kwargs.get("update_ratios")):
            monitor_kwargs = {**monitor_kwargs, "update_ratios": optimizers}
        if model is not None and (monitor_kwargs.get("activations") or monitor_kwargs.get("trace_nonfinite")):
            monitor_kwargs = {**monitor_kwargs, "module": model}  # the hooks go on the model
        if monitor_kwargs.get("fused_step"):  # the clip rides the step: a gradfuse.optim optimizer, adopted in place
            if len(optimizers) != 1 or any(accelerated):
                raise ValueError("gradfuse.attach: fused_step=True takes one torch optimizer (not accelerate's)")
            from_torch(optimizers[0])
        # The one optimizer takes the skip on the device. The loop reads nothing of the step, so
        # by default the monitor waits only where the optimizer cannot take the skip (or a
        # scaler's unscale is fused with the statistics) and under accelerate, whose scheduler
        # reads step_was_skipped on the host (blocking=False: it is not told of a skip).
        can = len(optimizers) == 1 and device_skip_kind(self._scaled[0]) is not None
        if monitor_kwargs.get("blocking") is None:
            monitor_kwargs = {**monitor_kwargs, "blocking": not (can and scaler is None and not any(accelerated))}
        on_device = (monitor_kwargs["blocking"] is False and can) or bool(monitor_kwargs.get("fused_step"))
        self.monitor = GradMonitor(named, scaler=scaler, optimizer=self._scaled[0] if fused or on_device else None,
                                   **monitor_kwargs)
        self.monitor._call_name = "gradfuse.attach (before optimizer.step())"
        recorder = self.monitor.recorder
        if recorder is not None and not recorder.optimizers:  # the updates it records
            recorder.optimizers = list(self._scaled)
        self._loss = None
        # Noise scale: micro-batch boundaries from the backward passes themselves; under DDP
        # (model= a DistributedDataParallel) the bucket norms from a communication hook.
        self._backward_ends = None
        if self.monitor.noise_scale is not None:
            from gradfuse.dynamics.noise_scale import BackwardEnds
            self._backward_ends = BackwardEnds([p for _, p in named], self.monitor.micro_step)
            if isinstance(model, nn.parallel.DistributedDataParallel):
                self.monitor.noise_scale.register_ddp(model)
        self.last_report: StepReport | None = None
        self._skip = False
        self._pending: set[int] = set()  # optimizers still to step under the current decision
        self._in_scaler_step: int | None = None
        self._gates = [StepGate(opt, self._gate_decision, on_skip=self._after_skip,
                                bypass=self._accumulating if self._gradient_states else None, on_loss=self.loss)
                       for opt in optimizers]
        self._scaler_step = None
        if scaler is not None:
            self._previous_scaler_step = scaler.__dict__.get("step")
            self._scaler_inner = scaler.step
            attachment = self

            def step(sc, optimizer, *args, **kwargs):
                return attachment._scaler_step_call(optimizer, args, kwargs)

            self._scaler_step = types.MethodType(step, scaler)
            scaler.step = self._scaler_step

    def _decide(self, optimizer) -> bool:
        """The decision for this optimizer's step: a new one (the monitor runs) at the first step
        of a round, where a round ends once every attached optimizer has stepped (or one steps
        again)."""
        key = id(optimizer)
        if key not in self._pending:
            if self.scaler is not None and self.monitor.optimizer is None:
                from torch.amp.grad_scaler import OptState
                for opt in self._scaled:
                    if self.scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY:
                        self.scaler.unscale_(opt)
            loss, self._loss = self._loss, None
            self.last_report = self.monitor.step(loss=loss)
            self._skip = self.last_report.skip
            self._pending = {id(o) for o in self.optimizers}
        self._pending.discard(key)
        return self._skip

    def loss(self, loss) -> None:
        """The loss of the coming step, for the monitor's flight recorder (its loss column and
        loss spikes); call it before ``optimizer.step()``. A step with a closure passes the
        closure's result itself. Without a ``recorder`` the loss is not used.

        Args:
            loss: A tensor (read on the device, no host sync) or a number.

        Example:
            ```python
            handle = gradfuse.attach(optimizer, model, recorder=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            handle.loss(loss)
            optimizer.step()
            ```
        """
        self._loss = loss

    def _accumulating(self, optimizer) -> bool:
        """Whether this is accelerate's micro-step: ``accelerator.sync_gradients`` is False, the
        AcceleratedOptimizer's step does nothing, and the monitor does not run (nor count it)."""
        return not all(state.sync_gradients for state in self._gradient_states)

    def _after_skip(self, optimizer) -> None:
        # A step the policy skipped, gated before accelerate's step (which runs scaler.step and
        # scaler.update): the scaler's bookkeeping for it, as a GradScaler-skipped step gets.
        if self._accelerate_scaler and not self._pending:
            from torch.amp.grad_scaler import OptState
            if any(self.scaler._per_optimizer_states[id(o)]["stage"] is not OptState.READY
                   for o in self._scaled):
                self.scaler.update()

    def _gate_decision(self, optimizer) -> bool:
        if self._in_scaler_step == id(optimizer):  # decided in scaler.step, which called us
            return self._skip
        skip = self._decide(optimizer)
        if id(optimizer) in self._accelerated:
            # accelerate's LR scheduler does not advance when the optimizer's step_was_skipped,
            # a read-only view of _is_overflow, which accelerate sets only around its scaler's
            # step: a step skipped here is skipped for the scheduler too, as an fp16 overflow is
            # (a step taken resets it; under a scaler accelerate then sets it again).
            optimizer._is_overflow = skip
        return skip

    def _scaler_step_call(self, optimizer, args, kwargs):
        if not any(optimizer is o for o in self.optimizers):
            return self._scaler_inner(optimizer, *args, **kwargs)
        self._decide(optimizer)
        # The scaler then runs its own checks and calls optimizer.step() (our gate) unless the
        # gradients overflowed; a skipped step still gets the scaler's bookkeeping.
        self._in_scaler_step = id(optimizer)
        try:
            return self._scaler_inner(optimizer, *args, **kwargs)
        finally:
            self._in_scaler_step = None

    def state_dict(self) -> dict:
        """The monitor's ``state_dict`` (step number, counters, ZClip and noise scale state):
        save it with the training checkpoint.

        Returns:
            ``GradMonitor.state_dict()``.
        """
        return self.monitor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores the monitor's state (``GradMonitor.load_state_dict``).

        Args:
            state: A dict from ``state_dict``.

        Raises:
            KeyError: ``state`` lacks the step number or a counter.
            ValueError: ``state`` comes from a newer gradfuse (or a mismatched ZClip).

        Example:
            ```python
            handle = gradfuse.attach(optimizer, model, max_norm=1.0)
            handle.load_state_dict(torch.load("ckpt.pt")["gradfuse"])
            ```
        """
        self.monitor.load_state_dict(state)

    def detach(self) -> None:
        """Restores ``optimizer.step`` (and ``scaler.step``); the monitor's sinks are closed.

        Also removes the backward hooks of the noise scale, and logs the last step if it was
        not logged (``GradMonitor.close``). Leaving the ``with`` block calls it.

        Example:
            ```python
            handle = gradfuse.attach(optimizer, model, max_norm=1.0)
            train()
            handle.detach()
            ```
        """
        for gate in self._gates:
            gate.remove()
        self._gates = []
        if self._backward_ends is not None:
            self._backward_ends.remove()
            self._backward_ends = None
        if self._scaler_step is not None:
            if self.scaler.__dict__.get("step") is self._scaler_step:
                if self._previous_scaler_step is None:
                    del self.scaler.step
                else:
                    self.scaler.step = self._previous_scaler_step
            self._scaler_step = None
        self.monitor.close()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


def attach(optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
           model: nn.Module | None = None, *, scaler=None, **monitor_kwargs) -> Attachment:
    """Runs a ``GradMonitor`` (statistics, clip, policies, logging) right before every
    ``optimizer.step()``; a step the policy skips is not taken at all (no parameter, momentum,
    weight-decay or step-count update), as ``GradScaler`` skips one. The loop does not change
    (see the example).

    Args:
        optimizer: one optimizer, or several that step the same model: the monitor runs before
            the first of them steps in each round and its decision (skip or not) holds for all
            (a round ends once each has stepped, or when one steps again). Or a DeepSpeed engine
            (what ``deepspeed.initialize`` returns first; ZeRO stages 0-3): then the monitor runs
            where the engine steps its optimizer, on the full averaged gradients, and the handle is a
            ``gradfuse.integrations.deepspeed.DeepSpeedAttachment`` (see the DeepSpeed guide). Or a
            torchtitan ``Trainer``: then the monitor runs in place of its clip
            (``gradfuse.integrations.torchtitan.attach``; see the torchtitan guide).
        model: names the parameters (else the optimizer's own names, or ``group{g}.{i}``).
            Watched are the parameters the optimizer(s) update.
        scaler: the ``torch.amp.GradScaler`` of the loop (``scaler.step(optimizer)``): then the
            monitor also sees steps the scaler skips (counted as ``amp_overflow``, not as
            anomalies), and with one optimizer it unscales the gradients itself, fused with its
            statistics (a prior ``scaler.unscale_(optimizer)`` is fine too).
            With accelerate, attach the optimizer ``accelerator.prepare`` returned (its
            ``AcceleratedOptimizer``) and leave ``scaler`` out: under ``mixed_precision="fp16"`` its
            scaler is taken. The monitor runs only on the steps accelerate takes
            (``accelerator.sync_gradients``), not on the micro-steps of gradient accumulation, and
            replaces ``accelerator.clip_grad_norm_``.
        **monitor_kwargs: what ``GradMonitor`` takes (``max_norm``, ``every``, ``sinks``,
            ``on_nonfinite``, ``explode_threshold``, ``on_explode``, ...; ``max_norm`` may be a
            schedule or a ``gradfuse.ZClip``, and ``per``, ``clip_value``, ``agc`` choose
            other clipping modes, see ``gradfuse.clip``). ``update_ratios=True`` and
            ``max_update_rms`` take the attached optimizers; ``noise_scale=True`` counts micro-batches by the
            backward passes themselves (no call in the loop; gradient accumulation is seen), and
            with ``model`` a ``DistributedDataParallel`` registers the DDP hook.
            ``activations=True`` and ``trace_nonfinite=True`` need ``model`` (their hooks go on
            its modules). ``recorder=True`` (a flight recorder) records the loss of
            ``optimizer.step(closure)`` or of ``handle.loss(loss)`` (and the attached optimizers'
            updates, with ``FlightRecorder(record_updates=True)``). ``blocking``: by default
            False where the one optimizer takes the skip on the device (a ``gradfuse.optim``
            optimizer, torch's fused Adam / AdamW, ``fused_step=True``) and no ``scaler`` is
            given: the host never waits, and the report, warnings and records of a step come
            at the next ``optimizer.step()`` (``handle.last_report.settled``); else True, and
            True under accelerate, whose scheduler reads ``step_was_skipped`` on the host (with
            False it is not told of a skip).

    Returns:
        The handle: ``monitor``, ``last_report``, ``state_dict()``, ``detach()``
            (also a context manager).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` (or a non-empty list of
            them), a DeepSpeed engine or a torchtitan ``Trainer``, or ``monitor_kwargs`` sets
            ``optimizer``, ``model`` or ``module`` (attach sets them itself); ``model`` or
            ``scaler`` with a DeepSpeed engine or a torchtitan ``Trainer``.
        RuntimeError: an optimizer already has a gradfuse step gate (detach the first
            attachment before attaching again).
        ValueError: a bad monitor argument (see ``GradMonitor``).

    Example:
        ```python
        handle = gradfuse.attach(optimizer, model, max_norm=1.0, every=100,
                                 on_nonfinite="skip", explode_threshold=1e4, on_explode="skip",
                                 sinks=[gradfuse.JsonlSink("run.jsonl")])
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step()          # gradfuse runs here first
            optimizer.zero_grad()
        handle.detach()
        ```
    """
    if any(c.__name__ == "DeepSpeedEngine" for c in type(optimizer).__mro__):
        if model is not None or scaler is not None:
            raise TypeError("gradfuse.attach: a DeepSpeed engine names its own parameters and scales its own "
                            "loss; pass it alone (gradfuse.attach(engine, max_norm=...))")
        from gradfuse.integrations.deepspeed import attach_engine
        return attach_engine(optimizer, **monitor_kwargs)
    if any(c.__name__ == "Trainer" and c.__module__.startswith("torchtitan") for c in type(optimizer).__mro__):
        if model is not None or scaler is not None:
            raise TypeError("gradfuse.attach: a torchtitan Trainer holds its own model and does not scale its loss; "
                            "pass it alone (gradfuse.attach(trainer, every=...))")
        from gradfuse.integrations import torchtitan
        return torchtitan.attach(optimizer, **monitor_kwargs)
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError("gradfuse.attach: expected a torch.optim.Optimizer or a list of them, got "
                        f"{type(optimizer).__name__}")
    for key in ("optimizer", "model", "module"):
        if key in monitor_kwargs:
            raise TypeError(f"gradfuse.attach: {key}= is set by attach itself")
    return Attachment(optimizers, model, scaler, monitor_kwargs)
