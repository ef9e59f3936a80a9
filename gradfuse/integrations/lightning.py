"""PyTorch Lightning (2.x, the ``lightning`` package): ``GradfuseCallback``.

    trainer = L.Trainer(gradient_clip_val=1.0, log_every_n_steps=50,
                        callbacks=[GradfuseCallback(explode_threshold=1e4)])

The callback runs the monitor in ``on_before_optimizer_step``: once per optimizer step (after
gradient accumulation), after the precision plugin unscaled the gradients, before Lightning's
own clipping, which it turns off. A step the policy skips is not taken (see
``gradfuse.integrations.pytorch.StepGate``).
"""
from __future__ import annotations

from gradfuse.utils import require

require("lightning", "lightning", "integrations.lightning")

from lightning.pytorch import Callback  # noqa: E402

from gradfuse.integrations.pytorch import StepGate, named_optimizer_params  # noqa: E402
from gradfuse.monitor.clip_strategy import describe_mode  # noqa: E402
from gradfuse.monitor.monitor import GradMonitor, StepReport  # noqa: E402
from gradfuse.monitor.sinks import metrics  # noqa: E402
from gradfuse.utils import warn  # noqa: E402


class LightningLoggerSink:
    """Writes monitor records to the Lightning trainer's loggers (TensorBoard, CSV, W&B, ...) as
    flat metrics (``gradfuse.sinks.metrics``), at the record's step."""

    def __init__(self, trainer, prefix: str = ""):
        self.trainer = trainer
        self.prefix = prefix

    def write(self, record: dict) -> None:
        """Logs ``record``'s flat metrics, prefixed, through each of the trainer's loggers at its step."""
        m = {self.prefix + k: v for k, v in metrics(record).items()}
        for logger in self.trainer.loggers:
            logger.log_metrics(m, step=record["step"])


def _log_step(trainer) -> int:
    # The step Lightning logs training metrics under (one per batch that stepped), so gradient
    # statistics share the loss curve's x-axis.
    return getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)


def _batch_size(batch) -> int | None:
    # Examples in a batch: the length of its first tensor (a tensor, a tuple/list or a dict of them).
    import torch
    if isinstance(batch, dict):
        batch = next(iter(batch.values()), None)
    elif isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    return len(batch) if isinstance(batch, torch.Tensor) and batch.dim() > 0 else None


def _should_log(trainer) -> bool:
    # The decision Lightning takes for its own training metrics of this batch (log_every_n_steps).
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return bool(connector.should_update_logs or trainer.fast_dev_run)
    n = trainer.log_every_n_steps
    return n > 0 and (_log_step(trainer) + 1) % n == 0


class GradfuseCallback(Callback):
    """Fused gradient statistics, clipping and the skip/raise policies of ``GradMonitor``
    for a Lightning ``Trainer``, logged through the trainer's loggers every
    ``log_every_n_steps`` (per-layer and total norms, clip coefficient, clipped / skipped /
    non-finite counts) and on every anomaly.

    Args:
        max_norm: clip by total norm: a number, a schedule (callable of the step) or a
            ``gradfuse.ZClip``. None (default): take the Trainer's ``gradient_clip_val``,
            by norm, or by value with ``gradient_clip_algorithm="value"`` (the monitor's
            ``clip_value``). Either way Lightning's own clipping is turned off for the fit
            (restored afterwards). ``per=``, ``clip_value=`` and ``agc=`` go to the monitor.
        sinks: further sinks (a ``JsonlSink``, ...), written on global rank 0 only.
        **monitor_kwargs: ``norm_type``, ``on_nonfinite``, ``explode_threshold``, ``on_explode``,
            ``layer_depth``, ``noise_scale``, ``update_ratios``, ``activations``,
            ``trace_nonfinite``, ``recorder``, ``on_spike`` (see ``GradMonitor``).
            ``update_ratios=True`` takes the optimizer; ``noise_scale=True`` counts micro-batches
            in ``on_after_backward`` (in examples: the first tensor of the batch); the activation
            hooks go on the LightningModule, for the batches Lightning logs, with the first
            optimizer's monitor, and so does the flight recorder (``recorder=``), which records
            the loss of ``training_step`` (and that optimizer's updates, with
            ``FlightRecorder(record_updates=True)``). Lightning hands the loss
            over only after the optimizer step (``on_train_batch_end``; under gradient
            accumulation the sum of the micro-batches' normalized losses): it is written into the
            row of the step just taken, and its spike is acted on at the next step.

    AMP: the scaler of a ``16-mixed`` precision plugin is handed to the monitor, so an overflow
    is left to the scaler (``amp_overflow``), not skipped as an anomaly. With several optimizers
    (manual optimization) each gets a monitor; their logger metrics are prefixed
    ``optimizer_{i}/``. The monitors' counters and step numbers are saved in checkpoints.

    Step numbers are Lightning's (the batches that stepped), so the statistics share the loss
    curve's x-axis; the metric names are ``gradfuse.sinks.metrics``'s (see the Data reference
    page).

    Attributes:
        monitors (dict[int, GradMonitor]): The monitors, by optimizer index (made during the
            fit; ``monitor`` is the first optimizer's).
        last_report (StepReport | None): The latest step's report.
        max_norm: The clip threshold in use (the Trainer's ``gradient_clip_val`` when taken).
        sinks (list): The further sinks.

    Raises:
        TypeError: ``every``, ``scaler``, ``optimizer`` or ``start_step`` in ``monitor_kwargs``
            (the callback sets them).
        ImportError: ``lightning`` is not installed (``pip install lightning``), on importing
            ``gradfuse.integrations.lightning``.

    Example:
        ```python
        import lightning as L
        from gradfuse.integrations.lightning import GradfuseCallback

        trainer = L.Trainer(gradient_clip_val=1.0, log_every_n_steps=50,
                            callbacks=[GradfuseCallback(explode_threshold=1e4,
                                                        sinks=[gradfuse.JsonlSink("run.jsonl")])])
        trainer.fit(model)
        ```
    """

    def __init__(self, max_norm: float | None = None, *, sinks=(), **monitor_kwargs):
        for key in ("every", "scaler", "optimizer", "start_step"):
            if key in monitor_kwargs:
                raise TypeError(f"gradfuse GradfuseCallback: {key}= is set by the callback")
        self.max_norm = max_norm
        self.sinks = list(sinks)
        self.monitor_kwargs = monitor_kwargs
        self.monitors: dict[int, GradMonitor] = {}  # by optimizer index
        self.last_report: StepReport | None = None
        self._gates: list[StepGate] = []
        self._skip: dict[int, bool] = {}
        self._saved: dict[int, dict] = {}
        self._trainer_clip = None
        self._took_value = False
        self._loss = None  # the losses of the micro-batches since the last step (flight recorder)
        self._stepped = False

    @property
    def monitor(self) -> GradMonitor | None:
        """The monitor of the first optimizer."""
        return self.monitors.get(0)

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Lightning hook: for the fit, takes over the Trainer's ``gradient_clip_val``.

        Unless ``max_norm`` or another clip mode was given, the monitor clips by it (by value with
        ``gradient_clip_algorithm="value"``); Lightning's own clipping is turned off for the fit.
        """
        if stage != "fit" or not trainer.gradient_clip_val:
            return
        algorithm = trainer.gradient_clip_algorithm
        by_value = algorithm is not None and str(getattr(algorithm, "value", algorithm)) == "value"
        clip = float(trainer.gradient_clip_val)
        own = describe_mode(self.max_norm, self.monitor_kwargs)
        if own is None and by_value:  # gradient_clip_algorithm="value": clamped by the monitor
            self.monitor_kwargs["clip_value"] = clip
            self._took_value = True
        elif own is None:
            self.max_norm = clip
        elif own != (f"clip_value={clip:g}" if by_value else f"max_norm={clip:g}"):
            warn(f"gradfuse GradfuseCallback: {own} replaces the Trainer's gradient_clip_val={clip:g}"
                 f" (gradient_clip_algorithm={'value' if by_value else 'norm'})")
        self._trainer_clip = trainer.gradient_clip_val
        trainer.gradient_clip_val = None  # gradfuse clips, in the same place, once

    def on_train_start(self, trainer, pl_module) -> None:
        """Lightning hook: gates each optimizer's step (a step the policy skips is not taken).

        With ``noise_scale`` under DDP, also registers the communication hook that takes the bucket
        norms.
        """
        # Before the first step: without a closure-free precision plugin the optimizer's step()
        # is entered before the backward, so the gate must be in place already.
        self._gates = [StepGate(opt, self._take_decision) for opt in trainer.optimizers]
        self._register_noise_scale_ddp_hook(trainer, pl_module)

    def _register_noise_scale_ddp_hook(self, trainer, pl_module) -> None:
        # Noise scale under DDP: the bucket norms before the all-reduce (gradfuse.dynamics.noise_scale).
        if not self.monitor_kwargs.get("noise_scale") or len(trainer.optimizers) != 1:
            return
        import torch
        ddp = getattr(trainer.strategy, "model", None)
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return
        mon = self._monitor_for(trainer, pl_module, trainer.optimizers[0])
        try:
            mon.noise_scale.register_ddp(ddp)
        except RuntimeError as e:  # a comm hook of the strategy's own (ddp_comm_hook=...)
            warn(f"gradfuse GradfuseCallback: the noise scale's DDP hook could not be registered ({e}); "
                 "the noise scale then comes from gradient accumulation only")

    def _take_decision(self, optimizer) -> bool:
        return self._skip.pop(id(optimizer), False)

    def _monitor_for(self, trainer, pl_module, optimizer) -> GradMonitor:
        index = next(i for i, opt in enumerate(trainer.optimizers) if opt is optimizer)
        mon = self.monitors.get(index)
        if mon is None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            prefix = f"optimizer_{index}/" if len(trainer.optimizers) > 1 else ""
            sinks = (self.sinks if trainer.is_global_zero else []) + [LightningLoggerSink(trainer, prefix)]
            hooks = index == 0 and (self.monitor_kwargs.get("activations")
                                    or self.monitor_kwargs.get("trace_nonfinite"))
            kwargs = dict(self.monitor_kwargs)
            if kwargs.get("update_ratios") is True:
                kwargs["update_ratios"] = optimizer
            if not hooks:  # activation hooks: on the first optimizer's monitor only
                kwargs.pop("activations", None), kwargs.pop("trace_nonfinite", None)
            if index != 0:  # the flight recorder too
                kwargs.pop("recorder", None)
            mon = GradMonitor(named_optimizer_params([optimizer], pl_module), max_norm=self.max_norm,
                              every=0, scaler=scaler, optimizer=optimizer if scaler is not None else None,
                              sinks=sinks, **({"module": pl_module} if hooks else {}), **kwargs)
            mon._call_name = "gradfuse GradfuseCallback (Lightning, on_before_optimizer_step)"
            if mon.recorder is not None and not mon.recorder.optimizers:
                mon.recorder.optimizers = [optimizer]
            from gradfuse.dynamics.noise_scale import configure
            configure(mon.noise_scale, accumulation_steps=trainer.accumulate_grad_batches)
            if index in self._saved:
                mon.load_state_dict(self._saved.pop(index))
            self.monitors[index] = mon
        return mon

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """Lightning hook: arms the activation hooks, when asked for, and notes the batch size."""
        # activations=True: hooks for the batches Lightning logs (its log_every_n_steps decision)
        if trainer.optimizers and (self.monitor_kwargs.get("activations")
                                   or self.monitor_kwargs.get("trace_nonfinite")):
            mon = self._monitor_for(trainer, pl_module, trainer.optimizers[0])
            mon.arm_activations(full=_should_log(trainer))
        self._batch_size = _batch_size(batch)

    def on_after_backward(self, trainer, pl_module) -> None:
        """Lightning hook: a micro-batch's backward, for the noise scale (with one optimizer)."""
        # A micro-batch's backward (Lightning divides each loss by accumulate_grad_batches: the
        # noise scale's "mean" accumulation). One optimizer only: with several (manual
        # optimization) the backward is not tied to one of them.
        if not self.monitor_kwargs.get("noise_scale") or len(trainer.optimizers) != 1:
            return
        mon = self._monitor_for(trainer, pl_module, trainer.optimizers[0])
        from gradfuse.dynamics.noise_scale import configure
        configure(mon.noise_scale, batch_size=getattr(self, "_batch_size", None))
        mon.micro_step()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """Lightning hook: the monitor's step for ``optimizer`` (statistics, clipping, policies).

        The step is numbered as Lightning numbers its logged steps and logged when Lightning logs.
        """
        mon = self._monitor_for(trainer, pl_module, optimizer)
        mon.step_count = _log_step(trainer)
        report = mon.step(log=_should_log(trainer))
        self._skip[id(optimizer)] = report.skip
        self.last_report = report
        self._stepped = self._stepped or mon.recorder is not None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Lightning hook: with a flight recorder, the loss of the step just taken (its row)."""
        mon = self.monitor
        if mon is None or mon.recorder is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        import torch
        if isinstance(loss, torch.Tensor):  # the micro-batch's loss, normalized by Lightning
            loss = loss.detach()
            self._loss = loss if self._loss is None else self._loss + loss
        if self._stepped:
            if self._loss is not None:
                mon.recorder.record_loss(self._loss)
            self._loss, self._stepped = None, False

    def _release(self, trainer) -> None:
        for gate in self._gates:
            gate.remove()
        self._gates = []
        self._skip.clear()
        for mon in self.monitors.values():
            mon.disarm_activations()  # no activation hook outlives the fit
        if self._trainer_clip is not None:
            trainer.gradient_clip_val = self._trainer_clip
            self._trainer_clip = None
        if self._took_value:
            self.monitor_kwargs.pop("clip_value", None)
            self._took_value = False

    def on_train_end(self, trainer, pl_module) -> None:
        """Lightning hook: removes the step gates and activation hooks; restores ``gradient_clip_val``."""
        self._release(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        """Lightning hook: as ``on_train_end``."""
        self._release(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """Lightning hook: as ``on_train_end``."""
        self._release(trainer)

    def state_dict(self) -> dict:
        """The monitors' counters and step numbers, by optimizer index, for Lightning's checkpoints."""
        states = {i: mon.state_dict() for i, mon in self.monitors.items()}
        states.update({i: s for i, s in self._saved.items() if i not in states})
        return {"monitors": states}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the monitors' state from a checkpoint (a monitor made later takes it when made)."""
        saved = {int(i): s for i, s in state_dict.get("monitors", {}).items()}
        for index, state in saved.items():
            if index in self.monitors:
                self.monitors[index].load_state_dict(state)
            else:
                self._saved[index] = state  # applied when the monitor is made, at the first step
