"""torchtitan: ``gradfuse.integrations.torchtitan.attach(trainer)`` runs a ``GradMonitor`` in a
torchtitan ``Trainer``'s step, in place of torchtitan's gradient clip.

``Trainer.train_step`` looks ``clip_grad_norm_`` up on ``torchtitan.distributed.utils`` when it
calls it, after the backward and FSDP2's reduce-scatter, before the optimizers' step; the
attachment puts its own function there. For the trainer's parameters it takes the monitor's
step: the statistics of the full gradients (FSDP2 and tensor-parallel shards, pipeline stages:
every rank's pieces, rows combined in one all-gather over the world, never a ``full_tensor()``
per parameter; ``gradfuse.core.mesh_pieces``), the clip by ``training.max_norm`` (torchtitan's
coefficient, from the same total norm within float rounding), the policies, logging; it returns
the total norm from before clipping, which torchtitan logs as ``grad_norm``. A step the policy
skips is not taken (its LR schedulers still advance, as torchtitan counts steps). Any other call
goes to torchtitan's own function. With ``checkpoint.enable`` the monitor's step number and
counters are saved and loaded with the trainer's states (key ``"gradfuse"``).

Decided on the device (``blocking=False``, the default) where every optimizer of the trainer takes
the skip there (torch's fused Adam / AdamW, torchtitan's default ``optimizer.implementation``):
each takes the step's flag as its ``found_inf``, gradfuse reads nothing on the host in the step,
and the report, counters and records of a step are settled at the next one (at ``detach()`` for
the last). Otherwise, or with ``blocking=True``, on the host.

Layer: integrations. Imports ``gradfuse.core``, ``gradfuse.monitor`` and
``gradfuse.integrations.step_gate``.
"""
from __future__ import annotations

import torch

from gradfuse.core.mesh_pieces import MeshPieces
from gradfuse.integrations.step_gate import StepGate
from gradfuse.monitor.device_skip import device_skip_kind
from gradfuse.monitor.monitor import GradMonitor, StepReport
from gradfuse.monitor.sinks.metrics_sink import MetricsSink
from gradfuse.utils import outside_tested

# The torchtitan releases whose Trainer (train_step's clip, model_parts, parallel_dims) was
# checked: [first, end).
TESTED_VERSIONS = ((0, 3), (0, 4))
# Where the monitor's state travels in torchtitan's checkpoints (a key of its checkpointer's states).
STATE_KEY = "gradfuse"
# Monitor options that need what the attachment does not give, and why.
REFUSED_OPTIONS = {
    "clip_value": "the clamped counts of tensor-parallel copies would be counted once per copy",
    "agc": "adaptive clipping needs each parameter's whole weight, which FSDP2 shards",
    "update_ratios": "torchtitan's optimizers are stepped through its OptimizersContainer",
    "max_update_rms": "torchtitan's optimizers are stepped through its OptimizersContainer",
    "noise_scale": "the per-micro-batch gradients are reduced inside FSDP2's backward",
    "scaler": "torchtitan does not scale its loss",
    "optimizer": "set by the attachment",
}


class EachOptimizer:
    """torchtitan's ``OptimizersContainer`` as a non-blocking monitor's ``optimizer=``: the
    monitor's step hooks go on each optimizer in it, so that each takes the step's skip flag as
    its ``found_inf`` (torch's fused Adam / AdamW skip on the device, step counters kept)."""

    takes_found_inf = True  # device_skip_kind: the monitor's step hooks hand it found_inf

    def __init__(self, container):
        self.optimizers = list(container.optimizers)

    def register_step_pre_hook(self, hook):
        """``hook`` before each optimizer's step; returns a handle with ``remove()``."""
        return _Handles([o.register_step_pre_hook(hook) for o in self.optimizers])

    def register_step_post_hook(self, hook):
        """``hook`` after each optimizer's step; returns a handle with ``remove()``."""
        return _Handles([o.register_step_post_hook(hook) for o in self.optimizers])


class _Handles:
    def __init__(self, handles):
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def check_version(version: str) -> None:
    """Raises RuntimeError when torchtitan ``version`` is outside ``TESTED_VERSIONS``."""
    tested = outside_tested(version, TESTED_VERSIONS)
    if tested is not None:
        raise RuntimeError(
            f"gradfuse.integrations.torchtitan: torchtitan {version} is outside the versions it was tested with "
            f"({tested}): it replaces the clip torchtitan's Trainer.train_step "
            "looks up, whose place and arguments move between releases. Install a tested torchtitan.")


class MonitorState:
    """The monitor's state as torchtitan's checkpointer saves and loads its states (the
    ``Stateful`` protocol): its step number and counters (``GradMonitor.state_dict``)."""

    def __init__(self, monitor: GradMonitor):
        self.monitor = monitor

    def state_dict(self) -> dict:
        """The monitor's ``state_dict()`` (what the checkpointer saves)."""
        return self.monitor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores the monitor from what the checkpointer loaded."""
        self.monitor.load_state_dict(state)


class TorchtitanAttachment:
    """What ``attach`` returns: the ``monitor``, the ``last_report``, and ``detach()``, which
    puts torchtitan's clip back and closes the monitor.

    Attributes:
        monitor (GradMonitor): The monitor (its ``source`` the ``MeshPieces`` of the model).
        last_report (StepReport | None): The report of the latest step (with ``blocking``
            False, settled at the next step).
        blocking (bool): Whether the monitor decides on the host (see the module docstring).
        trainer: The torchtitan ``Trainer``.
    """

    def __init__(self, trainer, monitor_kwargs: dict, metrics: bool = True):
        import torchtitan
        import torchtitan.distributed.utils as dist_utils

        check_version(getattr(torchtitan, "__version__", "0.3.0"))
        for key, value in monitor_kwargs.items():
            if key in REFUSED_OPTIONS and value not in (None, False):
                raise ValueError(f"gradfuse.integrations.torchtitan.attach: {key}= is not available: "
                                 f"{REFUSED_OPTIONS[key]}")
        if trainer.parallel_dims.ep_enabled:
            raise ValueError("gradfuse.integrations.torchtitan.attach: expert parallel is not supported yet (not "
                             "tested: its uneven all-to-all does not run on gloo)")
        self.trainer = trainer
        named = [(n, p) for part in trainer.model_parts for n, p in part.named_parameters() if p.requires_grad]
        self._params = {id(p) for _, p in named}
        kwargs = {"max_norm": trainer.config.training.max_norm, "check_double_clip": False, **monitor_kwargs}
        # decided on the device where every optimizer takes the flag (torch's fused Adam / AdamW, the
        # default optimizer.implementation), unless blocking=True
        on_device = all(device_skip_kind(o) == "torch fused" for o in trainer.optimizers.optimizers)
        blocking = kwargs.pop("blocking", None)
        if blocking is False and not on_device:
            raise ValueError("gradfuse.integrations.torchtitan.attach: blocking=False needs optimizers that take the "
                             "skip on the device: torch's Adam / AdamW with optimizer.implementation='fused'")
        self.blocking = not on_device if blocking is None else blocking
        if not self.blocking:
            kwargs.update(blocking=False, optimizer=EachOptimizer(trainer.optimizers))
        group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        if metrics:
            kwargs = with_torchtitan_metrics(trainer, kwargs, group)
        watch = MeshPieces(named, group, norm_type=kwargs.get("norm_type", 2.0))
        self.monitor = GradMonitor(watch, **kwargs)
        self.last_report: StepReport | None = None
        self._module = dist_utils
        self._torchtitan_clip = dist_utils.clip_grad_norm_
        self._gate = None if not self.blocking else StepGate(
            trainer.optimizers, lambda _opt: self.last_report is not None and self.last_report.skip)
        dist_utils.clip_grad_norm_ = self._clip
        # with checkpoint.enable, saved and loaded with the trainer's states (loaded as train() starts)
        self._states = getattr(trainer.checkpointer, "states", None)
        if self._states is not None:
            self._states[STATE_KEY] = MonitorState(self.monitor)

    def _clip(self, parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, pp_mesh=None,
              ep_enabled=False):
        """Torchtitan's ``clip_grad_norm_``: for the trainer's parameters, the monitor's step (its
        total norm returned); for any others, torchtitan's own."""
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if {id(p) for p in parameters} != self._params:
            return self._torchtitan_clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh,
                                         ep_enabled)
        report = self.monitor.step()
        self.last_report = report
        return report.stats.total_norm

    def detach(self) -> None:
        """Puts torchtitan's clip and the optimizers' step back, takes the monitor's state out of
        the checkpointer's, and closes the monitor."""
        if self._module.clip_grad_norm_ == self._clip:
            self._module.clip_grad_norm_ = self._torchtitan_clip
        if self._gate is not None:
            self._gate.remove()
        if self._states is not None:
            self._states.pop(STATE_KEY, None)
        self.monitor.close()


def with_torchtitan_metrics(trainer, kwargs: dict, group) -> dict:
    """``kwargs`` with a ``MetricsSink`` of torchtitan's metric loggers (its TensorBoard / W&B,
    where its config enables them) among the sinks, on every rank, and ``sink_ranks`` (unless
    given) the rank torchtitan writes its metrics on (the last pipeline stage's first rank);
    ``kwargs`` itself where no rank has a logger (one collective, at attach)."""
    logger = getattr(getattr(trainer, "metrics_processor", None), "logger", None)
    writes = [getattr(logger, "number_of_loggers", 0) > 0]
    if group is not None:
        every = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(every, writes[0], group=group)
        writes = every
    if not any(writes):
        return kwargs
    return {**kwargs, "sinks": [*kwargs.get("sinks", []), MetricsSink(logger)],
            "sink_ranks": kwargs.get("sink_ranks", writes.index(True))}


def attach(trainer, *, metrics: bool = True, **monitor_kwargs) -> TorchtitanAttachment:
    """Runs a ``GradMonitor`` in ``trainer``'s steps, in place of torchtitan's clip (see the
    module docstring). Call it on every rank, after the ``Trainer`` is built and before
    ``trainer.train()``.

    Args:
        trainer: A torchtitan ``Trainer``.
        metrics: The records also go to torchtitan's own metric loggers (TensorBoard, W&B,
            where its ``metrics`` config enables them; the flat names of ``MetricsSink``, on the
            rank torchtitan logs from, which is then the default ``sink_ranks``).
        **monitor_kwargs: ``GradMonitor`` options (``max_norm`` defaults to the trainer's
            ``training.max_norm``; ``every``, ``sinks``, ``sink_ranks``, ``per``, ``histogram``,
            the policies, ``recorder`` ...); those of ``REFUSED_OPTIONS`` raise.

    Returns:
        TorchtitanAttachment: With ``monitor``, ``last_report`` and ``detach()``.

    Raises:
        ValueError: A refused option, or expert parallelism.
        RuntimeError: A torchtitan outside ``TESTED_VERSIONS``.

    Example:
        ```python
        trainer = config.build()
        handle = gradfuse.integrations.torchtitan.attach(trainer, every=10, sinks=[gradfuse.JsonlSink("run.jsonl")])
        trainer.train()
        handle.detach()
        ```
    """
    return TorchtitanAttachment(trainer, monitor_kwargs, metrics)
