"""Hugging Face ``transformers.Trainer``: ``attach``.

    trainer = Trainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0), ...)
    gradfuse.integrations.transformers.attach(trainer, explode_threshold=1e4)
    trainer.train()

gradfuse replaces the Trainer's clip: ``max_grad_norm`` becomes the monitor's ``max_norm``, and
the Trainer's own clip is off while it makes each update (its ``max_grad_norm`` is 0 from
``on_step_begin`` to ``on_step_end`` only, so the training arguments that the Trainer logs and
saves in its checkpoints are the ones it was given). The Trainer's own gradient-norm call
(``accelerator.clip_grad_norm_``, which transformers >= 5 makes every step for its ``grad_norm``
log, clipping or not) is answered by the monitor: one fused pass gives the statistics, the policy
decision, the clip and the ``grad_norm`` the Trainer logs. (Where the Trainer makes no such call,
the monitor runs in ``on_pre_optimizer_step``.) The statistics go into the Trainer's logs, so
they reach TensorBoard, W&B, ... through its own reporting.

Under DeepSpeed (``TrainingArguments(deepspeed=...)``, ZeRO stages 0-3) the engine steps inside the
Trainer's backward, so the monitor runs there, on the engine (``gradfuse.integrations.deepspeed``):
the statistics of the full averaged gradients, its clip in place of DeepSpeed's
``gradient_clipping`` (which the Trainer sets from ``max_grad_norm``), and its total norm as the
Trainer's ``grad_norm``.
"""
from __future__ import annotations

from gradfuse.utils import require

require("transformers", "transformers", "integrations.transformers")

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import DefaultFlowCallback  # noqa: E402

from gradfuse.integrations.pytorch import named_optimizer_params  # noqa: E402
from gradfuse.integrations.step_gate import StepGate  # noqa: E402
from gradfuse.monitor.clip_strategy import describe_mode  # noqa: E402
from gradfuse.monitor.device_skip import device_skip_kind  # noqa: E402
from gradfuse.monitor.monitor import GradMonitor, StepReport  # noqa: E402
from gradfuse.monitor.sinks import metrics  # noqa: E402
from gradfuse.utils import warn  # noqa: E402

# Where the monitor's state travels in trainer_state.json (TrainerState.stateful_callbacks).
# Not the class name: the Trainer re-creates callbacks stored under their class name from their
# constructor arguments, which would drop the sinks.
STATE_KEY = "gradfuse"


class GradfuseCallback(TrainerCallback):
    """The ``GradMonitor`` of a ``transformers.Trainer``; made and placed by ``attach``
    (it needs the Trainer: callbacks are not handed the optimizer the Trainer steps).

    ``monitor`` is the monitor (counters, ``state_dict()``), ``last_report`` the latest
    ``StepReport``. Step numbers are the Trainer's (``state.global_step`` after the update),
    so records and log lines share its x-axis. On each training log (``logging_steps``) the
    statistics of the latest update are added to the logs (``grad/total_norm``,
    ``grad_l2/<layer>``, the clipped / skipped / non-finite counters, ...) and written to
    ``sinks``; anomalies are written to ``sinks`` when they happen. The metric names are
    ``gradfuse.sinks.metrics``'s (see the Data reference page). The monitor's state is saved
    in the Trainer's checkpoints (``trainer_state.json``) and restored on resume.

    Args:
        trainer: The ``transformers.Trainer``.
        max_norm: As ``attach``'s.
        sinks: Further sinks, written on the main process only.
        **monitor_kwargs: As ``attach``'s.

    Attributes:
        monitor (GradMonitor | None): The monitor (made at ``on_train_begin``).
        last_report (StepReport | None): The latest update's report.
        trainer: The Trainer.

    Raises:
        TypeError: ``every``, ``scaler``, ``optimizer`` or ``start_step`` in ``monitor_kwargs``
            (the callback sets them).

    Example:
        ```python
        from gradfuse.integrations.transformers import attach

        callback = attach(trainer, explode_threshold=1e4)
        trainer.train()
        print(callback.monitor.counters())
        ```
    """

    def __init__(self, trainer, max_norm: float | None = None, *, sinks=(), **monitor_kwargs):
        for key in ("every", "scaler", "optimizer", "start_step"):
            if key in monitor_kwargs:
                raise TypeError(f"gradfuse GradfuseCallback: {key}= is set by the callback")
        self.trainer = trainer
        self.max_norm = max_norm
        self.sinks = list(sinks)
        self.monitor_kwargs = monitor_kwargs
        self.monitor: GradMonitor | None = None
        self.last_report: StepReport | None = None
        self._gate: StepGate | None = None
        self._skip_next = False
        self._ran_at: int | None = None
        self._trainer_max_grad_norm = None
        self._original_clip = None
        self._loss_seen = None  # the Trainer's running loss at the last update (flight recorder)
        self._deepspeed = None  # under DeepSpeed: the engine's attachment (gradfuse.integrations.deepspeed)

    def on_train_begin(self, args, state, control, **kwargs):
        """Trainer hook: makes the monitor and puts it where the Trainer clips.

        Takes the Trainer's ``max_grad_norm`` (unless another clip mode was given; the Trainer's
        own clipping is then off while it makes each update), restores the monitor's state on
        resume, gates the optimizer's step and takes over the accelerator's ``clip_grad_norm_``.
        """
        trainer = self.trainer
        if args.max_grad_norm and args.max_grad_norm > 0:
            own = describe_mode(self.max_norm, self.monitor_kwargs)
            if own is None:
                self.max_norm = float(args.max_grad_norm)
            elif own != f"max_norm={args.max_grad_norm:g}":
                warn(f"gradfuse: {own} replaces the Trainer's max_grad_norm={args.max_grad_norm:g}")
            self._trainer_max_grad_norm = args.max_grad_norm  # set to 0 during each update
        if getattr(trainer, "is_deepspeed_enabled", False):
            self._attach_deepspeed(state)
            return
        optimizer = trainer.optimizer  # accelerate's AcceleratedOptimizer around the torch one
        inner = getattr(optimizer, "optimizer", optimizer)
        scaler = getattr(optimizer, "scaler", None)
        if self.monitor is None:
            hooks = self.monitor_kwargs.get("activations") or self.monitor_kwargs.get("trace_nonfinite")
            kwargs = dict(self.monitor_kwargs)
            if kwargs.get("update_ratios") is True:
                kwargs["update_ratios"] = inner
            # The optimizer takes the skip on the device (the Trainer's default, fused AdamW): by
            # default the monitor never waits. The Trainer's scheduler reads step_was_skipped,
            # which only a scaler's overflow sets, with the monitor waiting or not.
            on_device = device_skip_kind(inner) is not None and scaler is None
            if kwargs.get("blocking") is None:
                kwargs["blocking"] = not on_device
            hand = scaler is not None or (on_device and not kwargs["blocking"])
            self.monitor = GradMonitor(
                named_optimizer_params([inner], trainer.model), max_norm=self.max_norm, every=0,
                scaler=scaler, optimizer=inner if hand else None,
                sinks=self.sinks if trainer.is_world_process_zero() else [],
                **({"module": trainer.model} if hooks else {}), **kwargs)
            self.monitor._call_name = "gradfuse.integrations.transformers.attach (the Trainer's clip)"
            if self.monitor.recorder is not None and not self.monitor.recorder.optimizers:
                self.monitor.recorder.optimizers = [inner]
            from gradfuse.dynamics.noise_scale import configure
            configure(self.monitor.noise_scale, batch_size=args.per_device_train_batch_size,
                      accumulation_steps=args.gradient_accumulation_steps)
        ns = self.monitor.noise_scale
        wrapped = getattr(trainer, "model_wrapped", None)
        import torch
        if (ns is not None and isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
                and ns.ddp_model is not wrapped):
            ns.register_ddp(wrapped)  # bucket norms before the all-reduce (gradfuse.dynamics.noise_scale)
        saved = (state.stateful_callbacks or {}).get(STATE_KEY)
        if saved and state.global_step > 0:  # resuming from a checkpoint
            self.monitor.load_state_dict(saved)
        # The Trainer steps the AcceleratedOptimizer: gate that one (accelerate swaps the inner
        # optimizer's step method in and out around AMP steps).
        self._gate = StepGate(optimizer, self._take_decision, on_skip=self._after_skip)
        self._take_over_norm_call()

    def _attach_deepspeed(self, state) -> None:
        """Under DeepSpeed: the monitor runs where the engine steps its optimizer (accelerate's
        engine wrapper calls ``engine.step()`` inside the Trainer's backward, before any Trainer
        hook of the update), through ``gradfuse.integrations.deepspeed``; it clips in place of
        DeepSpeed's ``gradient_clipping`` (which the Trainer set from ``max_grad_norm``)."""
        import warnings

        from gradfuse.integrations.deepspeed import attach_engine
        if self._deepspeed is None:
            trainer = self.trainer
            with warnings.catch_warnings():  # DeepSpeed's gradient_clipping is the Trainer's max_grad_norm
                warnings.filterwarnings("ignore", message=r".*gradient_clipping=.* is off while gradfuse clips")
                self._deepspeed = attach_engine(trainer.model_wrapped, max_norm=self.max_norm, every=0,
                                                sinks=self.sinks if trainer.is_world_process_zero() else [],
                                                **self.monitor_kwargs)
            self.monitor = self._deepspeed.monitor
        saved = (state.stateful_callbacks or {}).get(STATE_KEY)
        if saved and state.global_step > 0:  # resuming from a checkpoint
            self.monitor.load_state_dict(saved)
        self._take_over_norm_call()

    def _take_over_norm_call(self) -> None:
        accelerator = self.trainer.accelerator
        from accelerate.utils import DistributedType
        kind = accelerator.distributed_type
        if kind == DistributedType.XLA or (
                kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False)):
            return  # these compute the norm their own way; the monitor runs in on_pre_optimizer_step
        original = accelerator.clip_grad_norm_
        callback = self

        def clip_grad_norm_(parameters, max_norm, norm_type=2, **kw):
            if norm_type != callback.monitor.norm_type:
                return original(parameters, max_norm, norm_type, **kw)
            if callback._deepspeed is not None:  # the monitor ran inside the engine's step
                report = callback._deepspeed.last_report
                callback.last_report = report
                return None if report is None or report.stats is None else report.stats.total_norm
            return callback._run_monitor().stats.total_norm

        self._original_clip = ("clip_grad_norm_" in accelerator.__dict__, original)
        accelerator.clip_grad_norm_ = clip_grad_norm_

    def _run_monitor(self) -> StepReport:
        """The monitor's step for the update being made; at most once per update."""
        step = self.trainer.state.global_step
        if self._ran_at != step:
            self._ran_at = step
            self.monitor.step_count = step + 1  # the number the Trainer gives this update
            dynamics = self.monitor.dynamics
            if dynamics is not None:
                dynamics.micro_step(self.monitor)  # the last micro-batch of this update
                # Update ratios are taken now, before the step, for the log written after it.
                args, n = self.trainer.args, step + 1
                dynamics.capture_next = bool(
                    (n == 1 and args.logging_first_step) or (
                        str(getattr(args.logging_strategy, "value", args.logging_strategy)) == "steps"
                        and self.trainer.state.logging_steps and n % self.trainer.state.logging_steps == 0))
            self.last_report = self.monitor.step(log=False, loss=self._update_loss())
        return self.last_report

    def _update_loss(self):
        """The loss of this update for the flight recorder: what the Trainer's running training
        loss (``Trainer._tr_loss``, summed over the micro-batches) grew by since the last update
        (or since its last training log, which resets it); None where the Trainer has no such
        tensor, or without a recorder. Device ops only."""
        total = getattr(self.trainer, "_tr_loss", None)
        if self.monitor.recorder is None or not hasattr(total, "detach"):
            return None
        total = total.detach()
        seen, self._loss_seen = self._loss_seen, total.clone()
        return total if seen is None or seen.device != total.device else total - seen

    def on_substep_end(self, args, state, control, **kwargs):
        """Trainer hook: a micro-batch's backward that is not the last of its update."""
        # A micro-batch's backward that is not the last of its update (gradient accumulation).
        if self.monitor is not None:
            self.monitor.micro_step()

    def on_step_begin(self, args, state, control, **kwargs):
        """Trainer hook: turns the Trainer's own clip off for this update (gradfuse clips, once);
        arms the activation hooks, when asked for (full statistics on logged updates)."""
        if self._trainer_max_grad_norm is not None:
            args.max_grad_norm = 0.0  # back at on_step_end, before the Trainer logs or saves
        if self._deepspeed is not None:
            self.monitor.step_count = state.global_step + 1  # the number the Trainer gives this update
        # activations=True: hooks for the updates the Trainer will log (DefaultFlowCallback's rule)
        if self.monitor is not None and self.monitor.watches_activations:
            coming = state.global_step + 1
            logged = (coming == 1 and args.logging_first_step) or (
                args.logging_strategy == "steps" and state.logging_steps and coming % state.logging_steps == 0)
            self.monitor.arm_activations(full=bool(logged))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """Trainer hook: the monitor's step for this update, and whether its optimizer step is skipped
        (under DeepSpeed it ran inside the engine's step already)."""
        if self._deepspeed is not None:
            self.last_report = self._deepspeed.last_report
            return
        self._skip_next = self._run_monitor().skip

    def _take_decision(self, optimizer) -> bool:
        skip, self._skip_next = self._skip_next, False
        return skip

    def _after_skip(self, optimizer) -> None:
        # A skipped step never reaches scaler.step/update, which reset the scaler's per-step
        # state; without update() the next unscale would fail.
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            scaler.update()

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Trainer hook: adds the latest update's statistics to a training log and writes its record."""
        report = self.last_report
        if not logs or "loss" not in logs:
            return
        self._loss_seen = None  # the Trainer reset its running loss for this log
        if report is None or report.stats is None:
            return
        self.monitor.settle()  # blocking=False: this update's decision (the Trainer read its grad_norm)
        record = self.monitor.record(report)
        self.monitor.write(record)
        report.logged = True  # close() does not write it again
        m = metrics(record)
        logs.update(m)
        # The Trainer copied the logs into its history before calling back: complete that too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(m)

    def _stash_state(self, state, control) -> None:
        if control.should_save and self.monitor is not None:
            state.stateful_callbacks[STATE_KEY] = self.monitor.state_dict()

    def on_step_end(self, args, state, control, **kwargs):
        """Trainer hook: gives the Trainer its ``max_grad_norm`` back; puts the monitor's state in the
        Trainer state when a checkpoint is saved."""
        if self._trainer_max_grad_norm is not None:
            args.max_grad_norm = self._trainer_max_grad_norm
        self._stash_state(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        """Trainer hook: puts the monitor's state in the Trainer state when a checkpoint is saved."""
        self._stash_state(state, control)

    def on_train_end(self, args, state, control, **kwargs):
        """Trainer hook: ``detach``."""
        self.detach()

    def detach(self) -> None:
        """Undoes what ``on_train_begin`` changed: the step gate, the norm call, the
        Trainer's ``max_grad_norm``; also removes any activation hook still armed. Called at
        the end of ``train()``; the sinks stay open (``close`` closes them).
        """
        if self._gate is not None:
            self._gate.remove()
            self._gate = None
        if self._deepspeed is not None:  # the engine's step and clip setting restored; sinks stay open
            self._deepspeed.detach(close=False)
            self._deepspeed = None
        if self.monitor is not None:
            self.monitor.settle()  # blocking=False: the last update acted on before train() returns
            self.monitor.disarm_activations()  # no activation hook outlives train()
        if self._original_clip is not None:
            had_own, original = self._original_clip
            accelerator = self.trainer.accelerator
            if had_own:
                accelerator.clip_grad_norm_ = original
            else:
                accelerator.__dict__.pop("clip_grad_norm_", None)
            self._original_clip = None
        if self._trainer_max_grad_norm is not None:
            self.trainer.args.max_grad_norm = self._trainer_max_grad_norm
            self._trainer_max_grad_norm = None

    def close(self) -> None:
        """Detaches and closes the sinks (``GradMonitor.close``: the last step is logged first).

        Example:
            ```python
            callback = attach(trainer, sinks=[gradfuse.JsonlSink("run.jsonl")])
            trainer.train()
            callback.close()
            ```
        """
        self.detach()
        if self.monitor is not None:
            self.monitor.close()


def attach(trainer, max_norm: float | None = None, *, sinks=(), **monitor_kwargs) -> GradfuseCallback:
    """Adds a ``GradfuseCallback`` to ``trainer``, right after the Trainer's flow callback
    and before its reporting callbacks (TensorBoard, W&B, ...), so that those see the gradient
    statistics in the logs. Returns the callback.

    Args:
        trainer: The ``transformers.Trainer``, before ``train()``.
        max_norm: clip by total norm: a number, a schedule (callable of the step) or a
            ``gradfuse.ZClip``; None (default): the Trainer's ``max_grad_norm``. The Trainer
            itself then does not clip (its ``max_grad_norm`` is 0 while it makes an update, from
            ``on_step_begin`` to ``on_step_end``; what it logs and saves has the value it was
            given), also when ``per=``, ``clip_value=`` or ``agc=`` (passed to the monitor) clip
            instead.
        sinks: further sinks, written on the main process only.
        **monitor_kwargs: ``norm_type``, ``on_nonfinite``, ``explode_threshold``, ``on_explode``,
            ``layer_depth``, ``noise_scale``, ``update_ratios``, ``activations``,
            ``trace_nonfinite``, ``recorder``, ``on_spike`` (see ``GradMonitor``).
            ``update_ratios=True`` takes the Trainer's optimizer; ``noise_scale=True`` counts the
            micro-batches of gradient accumulation, in examples of
            ``per_device_train_batch_size``; the activation hooks go on ``trainer.model`` for the
            updates the Trainer logs; the flight recorder (``recorder=``) records the loss of each
            update (the Trainer's training loss summed over its micro-batches, as
            ``training_step`` returns it) and, with ``FlightRecorder(record_updates=True)``, the
            Trainer's optimizer's updates. ``blocking``: by default False where the Trainer's
            optimizer takes the skip on the device (its default ``adamw_torch_fused``, a
            ``gradfuse.optim`` optimizer) and there is no scaler: gradfuse never waits; an
            update's record is settled at the Trainer's log of it, or at the next update.

    Returns:
        The callback (``monitor``, ``last_report``, ``close()``).

    Raises:
        TypeError: ``every``, ``scaler``, ``optimizer`` or ``start_step`` in ``monitor_kwargs``.
        ImportError: ``transformers`` is not installed (``pip install transformers``), on
            importing ``gradfuse.integrations.transformers``.

    Example:
        ```python
        from gradfuse.integrations.transformers import attach

        trainer = Trainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0), ...)
        callback = attach(trainer, explode_threshold=1e4,
                          sinks=[gradfuse.JsonlSink("run.jsonl")])
        trainer.train()
        callback.close()
        ```
    """
    callback = GradfuseCallback(trainer, max_norm, sinks=sinks, **monitor_kwargs)
    callbacks = trainer.callback_handler.callbacks
    flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
    callbacks.insert(flow[-1] + 1 if flow else 0, callback)
    return callback
