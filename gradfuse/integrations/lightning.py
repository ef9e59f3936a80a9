"""PyTorch Lightning (2.x, the ``lightning`` package): :class:`GradfuseCallback`.

    trainer = L.Trainer(gradient_clip_val=1.0, log_every_n_steps=50,
                        callbacks=[GradfuseCallback(explode_threshold=1e4)])

The callback runs the monitor in ``on_before_optimizer_step``: once per optimizer step (after
gradient accumulation), after the precision plugin unscaled the gradients, before Lightning's
own clipping, which it turns off. A step the policy skips is not taken (see
:class:`gradfuse.integrations.pytorch.StepGate`).
"""
from __future__ import annotations

from gradfuse.sinks import _require

_require("lightning", "lightning", "integrations.lightning")

from lightning.pytorch import Callback  # noqa: E402

from gradfuse.integrations.pytorch import StepGate, named_optimizer_params  # noqa: E402
from gradfuse.monitor import GradMonitor, StepReport, warn  # noqa: E402
from gradfuse.sinks import metrics  # noqa: E402


class LightningLoggerSink:
    """Writes monitor records to the Lightning trainer's loggers (TensorBoard, CSV, W&B, ...) as
    flat metrics (:func:`gradfuse.sinks.metrics`), at the record's step."""

    def __init__(self, trainer, prefix: str = ""):
        self.trainer = trainer
        self.prefix = prefix

    def write(self, record: dict) -> None:
        m = {self.prefix + k: v for k, v in metrics(record).items()}
        for logger in self.trainer.loggers:
            logger.log_metrics(m, step=record["step"])


def _log_step(trainer) -> int:
    # The step Lightning logs training metrics under (one per batch that stepped), so gradient
    # statistics share the loss curve's x-axis.
    return getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)


def _should_log(trainer) -> bool:
    # The decision Lightning takes for its own training metrics of this batch (log_every_n_steps).
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return bool(connector.should_update_logs or trainer.fast_dev_run)
    n = trainer.log_every_n_steps
    return n > 0 and (_log_step(trainer) + 1) % n == 0


class GradfuseCallback(Callback):
    """Fused gradient statistics, clipping and the skip/raise policies of :class:`GradMonitor`
    for a Lightning ``Trainer``, logged through the trainer's loggers every
    ``log_every_n_steps`` (per-layer and total norms, clip coefficient, clipped / skipped /
    non-finite counts) and on every anomaly.

    Args:
        max_norm: clip by total norm. None (default): take the Trainer's ``gradient_clip_val``
            (with ``gradient_clip_algorithm="norm"``). Either way Lightning's own norm clipping
            is turned off for the fit (restored afterwards); value clipping stays Lightning's.
        sinks: further sinks (a ``JsonlSink``, ...), written on global rank 0 only.
        **monitor_kwargs: ``norm_type``, ``on_nonfinite``, ``explode_threshold``, ``on_explode``,
            ``layer_depth``, ``activations``, ``trace_nonfinite`` (see :class:`GradMonitor`; the
            activation hooks go on the LightningModule, for the batches Lightning logs, with the
            first optimizer's monitor).

    AMP: the scaler of a ``16-mixed`` precision plugin is handed to the monitor, so an overflow
    is left to the scaler (``amp_overflow``), not skipped as an anomaly. With several optimizers
    (manual optimization) each gets a monitor; their logger metrics are prefixed
    ``optimizer_{i}/``. The monitors' counters and step numbers are saved in checkpoints.
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

    @property
    def monitor(self) -> GradMonitor | None:
        """The monitor of the first optimizer."""
        return self.monitors.get(0)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or not trainer.gradient_clip_val:
            return
        algorithm = trainer.gradient_clip_algorithm
        if algorithm is not None and str(getattr(algorithm, "value", algorithm)) != "norm":
            return  # value clipping is not what gradfuse does: Lightning keeps it
        clip = float(trainer.gradient_clip_val)
        if self.max_norm is None:
            self.max_norm = clip
        elif self.max_norm != clip:
            warn(f"gradfuse GradfuseCallback: max_norm={self.max_norm:g} replaces the Trainer's "
                 f"gradient_clip_val={clip:g}")
        self._trainer_clip = trainer.gradient_clip_val
        trainer.gradient_clip_val = None  # gradfuse clips, in the same place, once

    def on_train_start(self, trainer, pl_module) -> None:
        # Before the first step: without a closure-free precision plugin the optimizer's step()
        # is entered before the backward, so the gate must be in place already.
        self._gates = [StepGate(opt, self._take_decision) for opt in trainer.optimizers]

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
            if not hooks:  # activation hooks: on the first optimizer's monitor only
                kwargs.pop("activations", None), kwargs.pop("trace_nonfinite", None)
            mon = GradMonitor(named_optimizer_params([optimizer], pl_module), max_norm=self.max_norm,
                              every=0, scaler=scaler, optimizer=optimizer if scaler is not None else None,
                              sinks=sinks, **({"module": pl_module} if hooks else {}), **kwargs)
            if index in self._saved:
                mon.load_state_dict(self._saved.pop(index))
            self.monitors[index] = mon
        return mon

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # activations=True: hooks for the batches Lightning logs (its log_every_n_steps decision)
        if trainer.optimizers and (self.monitor_kwargs.get("activations")
                                   or self.monitor_kwargs.get("trace_nonfinite")):
            mon = self._monitor_for(trainer, pl_module, trainer.optimizers[0])
            mon.arm_activations(full=_should_log(trainer))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        mon = self._monitor_for(trainer, pl_module, optimizer)
        mon.step_count = _log_step(trainer)
        report = mon.step(log=_should_log(trainer))
        self._skip[id(optimizer)] = report.skip
        self.last_report = report

    def _release(self, trainer) -> None:
        for gate in self._gates:
            gate.remove()
        self._gates = []
        self._skip.clear()
        for mon in self.monitors.values():
            if mon._act_hooks is not None:
                mon._act_hooks.take()  # no activation hook outlives the fit
        if self._trainer_clip is not None:
            trainer.gradient_clip_val = self._trainer_clip
            self._trainer_clip = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._release(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._release(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._release(trainer)

    def state_dict(self) -> dict:
        states = {i: mon.state_dict() for i, mon in self.monitors.items()}
        states.update({i: s for i, s in self._saved.items() if i not in states})
        return {"monitors": states}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = {int(i): s for i, s in state_dict.get("monitors", {}).items()}
        for index, state in saved.items():
            if index in self.monitors:
                self.monitors[index].load_state_dict(state)
            else:
                self._saved[index] = state  # applied when the monitor is made, at the first step
