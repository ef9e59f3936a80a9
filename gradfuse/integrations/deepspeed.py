"""DeepSpeed: ``gradfuse.attach(engine)`` runs a ``GradMonitor`` on a ``DeepSpeedEngine`` (ZeRO
stages 0 to 3), at the moment the engine steps its optimizer: after the gradients were reduced
(at the gradient accumulation boundary only), before DeepSpeed's own norm, clip and update.

Where the averaged gradients are then:

- stage 0: ``p.grad``, the whole gradient on every rank (as under DDP; no collective);
- stages 1 and 2: this rank's flat fragments, ``p._hp_mapping.get_lp_grad_fragment(...)``
  (none for parameters it does not own; a parameter may be split between ranks);
- stage 3: this rank's partition of each parameter, ``deepspeed.utils.safe_get_local_grad(p)``
  (without its padding).

At stages 1 to 3 the monitor takes the fused pass over the fragments and reduces the rows in one
all-gather per step (``gradfuse.core.fragments``): the rows are those of the full averaged
gradients, the same on every rank, never gathered per parameter. The clip scales the fragments
in place, which is what DeepSpeed's step then reads; DeepSpeed's own ``gradient_clipping`` is
off while gradfuse clips. A step a policy skips is handed to DeepSpeed as an overflow step
(stages 1-3: one element of a gradient fragment is set to NaN for DeepSpeed's overflow check and
given back its value after DeepSpeed's step, so nothing of it stays in the buffers DeepSpeed
keeps; stage 0: the optimizer's step is not called and ``optimizer.overflow`` is set), so
DeepSpeed skips it its own way: ``engine.skipped_steps`` counts it and the LR scheduler does not
advance.

At stages 1 to 3 the monitor decides on the device by default (``blocking=False``): the element is
written as ``where(flag, NaN, value)`` (``gradfuse.integrations.deepspeed_skip``), so gradfuse
reads nothing before DeepSpeed's step, and the report, counters and records of a step are
settled at the next one (``handle.monitor.settle()`` at once). Stage 0 decides on the host: the
engine reads ``optimizer.overflow`` there before its step.

The private accessors read here were checked against DeepSpeed ``TESTED_VERSIONS``; a DeepSpeed
outside that range is refused, as are configurations whose gradients are elsewhere (optimizer or
parameter offload, NVMe, the pipeline engine, MoE, model parallelism) or scaled (fp16).

Layer: integrations. Imports ``gradfuse.core``, ``gradfuse.clip``, ``gradfuse.monitor`` and
``gradfuse.utils``.
"""
from __future__ import annotations

import contextlib
import math
import types

import torch

from gradfuse.core.fragments import FragmentWatch, check_fragment_order
from gradfuse.integrations.deepspeed_skip import OverflowPlant
from gradfuse.monitor.monitor import GradMonitor, StepReport
from gradfuse.utils import outside_tested, warn

# The DeepSpeed releases whose gradient accessors (above) were checked: [first, end).
TESTED_VERSIONS = ((0, 19), (0, 20))
# Where the monitor's state travels in a DeepSpeed checkpoint (engine.save_checkpoint's client_state).
STATE_KEY = "gradfuse"
# Monitor options that need what ZeRO does not keep on a rank, and why.
REFUSED_OPTIONS = {
    "noise_scale": "the per-micro-batch gradients are reduced inside DeepSpeed's backward",
    "update_ratios": "the optimizer's state is partitioned and wrapped by DeepSpeed",
    "update_every": "the optimizer's state is partitioned and wrapped by DeepSpeed",
    "max_update_rms": "the optimizer's state is partitioned and wrapped by DeepSpeed",
    "agc": "adaptive clipping needs each parameter's whole weight, which ZeRO-3 partitions",
    "scaler": "DeepSpeed scales its own loss",
    "optimizer": "set by the attachment",
    "module": "set by the attachment",
}


def is_deepspeed_engine(obj) -> bool:
    """Whether ``obj`` is a ``deepspeed.DeepSpeedEngine`` (recognised by its class, without importing
    deepspeed)."""
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed")
               for c in type(obj).__mro__)


def check_version(version: str) -> None:
    """Raises RuntimeError when DeepSpeed ``version`` is outside ``TESTED_VERSIONS``."""
    tested = outside_tested(version, TESTED_VERSIONS)
    if tested is not None:
        raise RuntimeError(
            f"gradfuse.attach: DeepSpeed {version} is outside the versions gradfuse's DeepSpeed attachment "
            f"was tested with ({tested}): it reads DeepSpeed's gradient "
            "fragments through accessors that move between releases, and refuses rather than risk wrong "
            "statistics. Install a tested DeepSpeed, or use gradfuse.stats(deepspeed.utils.safe_get_full_grad"
            "(p) ...) by hand.")


def _offload_device(setting) -> str | None:
    device = getattr(setting, "device", None)
    name = getattr(device, "value", device)
    return None if name in (None, "none") else str(name)


def unsupported_setting(engine) -> str | None:
    """The first setting of ``engine`` whose gradients gradfuse cannot read correctly, in words
    (the configuration key), or None."""
    stage = engine.zero_optimization_stage()
    if any(c.__name__ == "PipelineEngine" for c in type(engine).__mro__):
        return "the pipeline engine (deepspeed.pipe.PipelineModule): its stages hold different parameters"
    if stage not in (0, 1, 2, 3):
        return f"zero_optimization.stage={stage}"
    device = _offload_device(engine.zero_offload_optimizer())
    if device is not None:
        return f"zero_optimization.offload_optimizer (device={device}): the gradients are copied off the device"
    device = _offload_device(engine.zero_offload_param())
    if device is not None:
        return f"zero_optimization.offload_param (device={device})"
    if engine.fp16_enabled():
        return "fp16 (DeepSpeed's loss scaler): the gradients it steps with are scaled"
    if getattr(engine, "has_moe_layers", False):
        return "MoE layers (expert-parallel groups)"
    if getattr(engine, "mpu", None) is not None:
        return "model parallelism (mpu=): gradients also split across model-parallel ranks"
    if getattr(engine.optimizer, "zenflow", False):
        return "zero_optimization.zenflow"
    return None


def overflow_seen(optimizer) -> bool:
    """Whether a ZeRO stage 1-2 optimizer skips a step whose gradients hold NaN (its overflow
    check, or an invalid global norm outside bfloat16)."""
    if getattr(optimizer, "check_grad_overflow", True):
        return True
    return bool(getattr(optimizer, "compute_grad_norm", True)) and getattr(optimizer, "dtype", None) != torch.bfloat16


class ZeroFragments:
    """This rank's pieces of the averaged gradients of ``params`` under ZeRO ``stage`` (1-3), in the
    order of ``params``: a callable for ``FragmentWatch``. Each piece is a view of the gradient
    DeepSpeed will step with (the clip scales it in place); an empty tensor where this rank holds
    none of a parameter."""

    def __init__(self, engine, params: list[torch.Tensor], stage: int):
        import torch.distributed as dist
        self.params = params
        self.stage = stage
        self.optimizer = engine.optimizer
        self.group = self.optimizer.dp_process_group
        self.rank = dist.get_rank(group=self.group)
        self.world = dist.get_world_size(group=self.group)
        self._empty = {}
        self._checked = False

    def empty(self, p: torch.Tensor) -> torch.Tensor:
        """The empty fragment of a parameter this rank holds none of (one per device and dtype)."""
        key = (p.device, p.dtype)
        if key not in self._empty:
            self._empty[key] = torch.empty(0, dtype=p.dtype, device=p.device)
        return self._empty[key]

    def __call__(self) -> list[torch.Tensor]:
        """This step's fragments, one per parameter."""
        return self.stage3() if self.stage == 3 else self.stage12()

    def stage12(self) -> list[torch.Tensor]:
        """ZeRO 1-2: the fragments of this rank's optimizer partition, through each parameter's
        ``_hp_mapping``."""
        out = []
        for p in self.params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # no element of p in this rank's partition
                out.append(self.empty(p))
                continue
            frag = mapping.get_lp_grad_fragment(p._index_in_param_group)
            address = mapping.lp_fragment_address
            if frag.numel() != address.numel:
                # A buffer of the whole parameter's gradient: this rank's piece of it only.
                frag = frag.view(-1).narrow(0, address.start, address.numel)
            out.append(frag)
        return out

    def stage3(self) -> list[torch.Tensor]:
        """ZeRO-3: this rank's partition of each parameter's gradient, without its padding."""
        out = []
        for p in self.params:
            if not p.requires_grad:
                out.append(self.empty(p))
                continue
            # The partition itself, in its own dtype: deepspeed.utils.safe_get_local_grad returns
            # it as float32, a copy under bf16 that a clip would not reach.
            part, _group = p._z3_optimizer._get_fp32_grad_state_partition(param=p, release_swap_buffers=False)
            if not self._checked:
                self._check_partition(p, part)
            # Partitions are ceil(numel / world) long; the last ranks' tails are padding.
            size = part.numel()
            out.append(part.view(-1).narrow(0, 0, max(0, min(size, p.ds_numel - self.rank * size))))
        self._checked = True
        return out

    def _check_partition(self, p, part) -> None:
        """Once, on the first step: the partition read is the one DeepSpeed's public accessor gives."""
        from deepspeed.utils import safe_get_local_grad
        public = safe_get_local_grad(p)
        if public is None or public.shape != part.shape or not torch.equal(public, part.float()):
            raise RuntimeError("gradfuse: the ZeRO-3 gradient partition gradfuse reads differs from "
                               "deepspeed.utils.safe_get_local_grad's: the partition layout is not the one gradfuse "
                               "was written for")
        if part.numel() * self.world < p.ds_numel:
            raise RuntimeError(f"gradfuse: a ZeRO-3 gradient partition of {part.numel()} elements on each of "
                               f"{self.world} ranks cannot hold a parameter of {p.ds_numel}: the partition layout "
                               "is not the one gradfuse reads")


class DeepSpeedAttachment:
    """What ``gradfuse.attach(engine)`` returns for a ``DeepSpeedEngine``: the monitor runs
    where the engine steps its optimizer (at the gradient accumulation boundary).

    Made by ``gradfuse.attach``, not directly.

    Attributes:
        engine: The DeepSpeed engine.
        monitor (GradMonitor): The monitor (counters, ``state_dict()``).
        last_report (StepReport | None): The latest step's report.
        stage (int): The engine's ZeRO stage.

    Example:
        ```python
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        with gradfuse.attach(engine, max_norm=1.0, every=10) as handle:
            for x, y in loader:
                engine.backward(loss_fn(engine(x), y))
                engine.step()
        ```
    """

    def __init__(self, engine, monitor_kwargs: dict):
        import deepspeed
        check_version(deepspeed.__version__)
        setting = unsupported_setting(engine)
        if setting is not None:
            raise ValueError(f"gradfuse.attach: this DeepSpeed configuration is not supported: {setting}")
        for key in monitor_kwargs:
            if key in REFUSED_OPTIONS and monitor_kwargs[key] not in (None, False):
                raise ValueError(f"gradfuse.attach: {key}= is not available on a DeepSpeed engine: "
                                 f"{REFUSED_OPTIONS[key]}")
        recorder = monitor_kwargs.get("recorder")
        if getattr(recorder, "record_updates", False):
            raise ValueError("gradfuse.attach: FlightRecorder(record_updates=True) is not available on a DeepSpeed "
                             "engine: the optimizer's state is partitioned and wrapped by DeepSpeed")
        self.engine = engine
        self.stage = engine.zero_optimization_stage()
        self.optimizer = engine.optimizer
        named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        can_skip = any(monitor_kwargs.get(k, default) == "skip" for k, default in
                       (("on_nonfinite", "skip"), ("on_explode", "skip"), ("on_spike", "warn")))
        if self.stage in (1, 2) and can_skip and not overflow_seen(self.optimizer):
            raise ValueError("gradfuse.attach: a step gradfuse skips is handed to DeepSpeed as an overflow step, "
                             "and this configuration does not check for overflow (bf16.check_grad_overflow=false, "
                             "or zero_optimization.compute_grad_norm=false): set it, or use the 'warn' / 'raise' "
                             "policies")
        kwargs = {"check_double_clip": False, **monitor_kwargs}  # DeepSpeed's own clip is off (below)
        norm_type = kwargs.get("norm_type", 2.0)
        if self.stage == 0:  # every rank holds the whole averaged gradient, as under DDP
            source = named
        else:
            check_fragment_order(norm_type)
            fragments = ZeroFragments(engine, [p for _, p in named], self.stage)
            source = FragmentWatch([n for n, _ in named], [p for _, p in named], fragments, fragments.group,
                                   norm_type=norm_type)
        self._watch = source if isinstance(source, FragmentWatch) else None
        # Stages 1-3: the skip is decided on the device and planted for DeepSpeed's overflow check.
        blocking = kwargs.pop("blocking", None)
        self._plant = None if self.stage == 0 or blocking is True else OverflowPlant(self._plant_nan)
        if self._plant is not None:
            kwargs.update(blocking=False, optimizer=self._plant)
        elif blocking is False:
            warn("gradfuse.attach: at ZeRO stage 0 the engine reads optimizer.overflow on the host before its "
                 "step, so the monitor decides there as with blocking=True")
        if kwargs.get("activations") or kwargs.get("trace_nonfinite"):  # forward hooks on the model
            kwargs["module"] = engine.module
        self.monitor = GradMonitor(source, **kwargs)
        self.last_report: StepReport | None = None
        self._unsettled = None  # (report, whether DeepSpeed skipped it) of the step settled next
        self._loss = None
        # DeepSpeed's clip: off while gradfuse clips (stage 0 reads the config, ZeRO its optimizer's copy).
        self._clips = kwargs.get("max_norm") is not None
        self._ds_clip = float(engine.gradient_clipping() or 0.0)
        # DeepSpeed clips at 1.0 unless told otherwise: only a gradient_clipping the config sets was asked for.
        asked = "gradient_clipping" in (getattr(engine._config, "_param_dict", None) or {})
        if self._clips and self._ds_clip > 0 and asked:
            warn(f"gradfuse.attach: DeepSpeed's gradient_clipping={self._ds_clip:g} is off while gradfuse clips "
                 "(both were asked for; gradfuse's clip is the one applied). Drop gradient_clipping from the "
                 "DeepSpeed config to silence this.")
        self._set_deepspeed_clip(0.0 if self._clips else self._ds_clip)
        # Stage 0 with a torch optimizer: the engine reads optimizer.overflow, if there is one, to
        # count a skipped step and hold the LR scheduler; the attachment keeps one while attached.
        self._own_overflow = self.stage == 0 and not hasattr(self.optimizer, "overflow")
        self._patched = {}
        self._patch(self.optimizer, "step", self._optimizer_step)
        self._patch(engine, "save_checkpoint", self._save_checkpoint)
        self._patch(engine, "load_checkpoint", self._load_checkpoint)

    def _patch(self, obj, name: str, replacement) -> None:
        inner = getattr(obj, name)
        had_own = name in obj.__dict__
        previous = obj.__dict__.get(name)

        def call(_self, *args, **kwargs):
            return replacement(inner, *args, **kwargs)

        bound = types.MethodType(call, obj)
        setattr(obj, name, bound)
        self._patched[(id(obj), name)] = (obj, name, bound, had_own, previous)

    def _set_deepspeed_clip(self, value: float) -> None:
        self.engine._config.gradient_clipping = value
        if hasattr(self.optimizer, "clip_grad"):
            self.optimizer.clip_grad = value

    def loss(self, loss) -> None:
        """The loss of the coming step, for the flight recorder (``recorder=``); call it before
        ``engine.step()`` at the accumulation boundary.

        Args:
            loss: A tensor (read on the device) or a number.
        """
        self._loss = loss

    def _optimizer_step(self, inner, *args, **kwargs):
        loss, self._loss = self._loss, None
        report = self.monitor.step(loss=loss)
        self._check_skipped()
        self.last_report = report
        if self._plant is not None:  # decided on the device: DeepSpeed's step takes the flag
            out = self._plant.step(inner, *args, **kwargs)
            self._unsettled = (report, bool(getattr(self.optimizer, "overflow", False)))
            return out
        if not report.skip:
            if self._own_overflow:
                self.optimizer.overflow = False
            return inner(*args, **kwargs)
        if self.stage == 0:  # the optimizer's step is not taken; the engine counts the skip
            self.optimizer.overflow = True
            return None
        # DeepSpeed's own overflow skip: gradients released, loss scale and LR scheduler kept.
        planted = self._plant_nan()
        try:
            out = inner(*args, **kwargs)
        finally:
            if planted is not None:
                element, value = planted
                element.copy_(value)
        self._unsettled = (report, bool(getattr(self.optimizer, "overflow", False)))
        self._check_skipped()
        return out

    def _check_skipped(self) -> None:
        """Raises if DeepSpeed took a step that gradfuse's policy skipped (read from the settled
        report, and from DeepSpeed's own ``overflow`` after that step)."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is not None and unsettled[0].skip and not unsettled[1]:
            raise RuntimeError(f"gradfuse: DeepSpeed did not skip step {unsettled[0].step}, which gradfuse's "
                               "policy skipped (its overflow check did not see the NaN gradients)")

    def _plant_nan(self, where: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sets one element of this rank's gradient fragments to NaN (where the 0-d ``where`` is
        nonzero, on the device: no host read), for DeepSpeed's overflow check (it and the norm
        are reduced over the ranks, so one element on any rank is seen by all): the element (a
        0-d view) and its value, to be put back after DeepSpeed's step. At stage 3 the fragments
        are views of one buffer DeepSpeed keeps across steps, and a parameter that gets no
        gradient next step would carry a NaN left there into every later step. None where this
        rank holds no element."""
        _names, fragments = self._watch.named_grads()
        target = next((f for f in fragments if f.numel()), None)
        if target is None:
            return None
        element = target[(0,) * target.dim()]
        value = element.clone()
        if where is None:
            element.fill_(math.nan)
        else:
            element.copy_(torch.where(where.to(element.device) != 0, math.nan, value))
        return element, value

    @contextlib.contextmanager
    def _deepspeed_clip_restored(self):
        """DeepSpeed's own clip setting in place for a while (a checkpoint saves what the user configured)."""
        self._set_deepspeed_clip(self._ds_clip)
        try:
            yield
        finally:
            self._set_deepspeed_clip(0.0 if self._clips else self._ds_clip)

    def _save_checkpoint(self, inner, save_dir, tag=None, client_state=None, *args, **kwargs):
        client_state = {**(client_state or {}), STATE_KEY: self.monitor.state_dict()}
        with self._deepspeed_clip_restored():
            return inner(save_dir, tag, client_state, *args, **kwargs)

    def _load_checkpoint(self, inner, *args, **kwargs):
        # ZeRO 1-2 optimizers take their clip from the checkpoint, stage 3 keeps its own: either
        # way, what the optimizer holds after the load is DeepSpeed's setting from then on.
        self._set_deepspeed_clip(self._ds_clip)
        try:
            out = inner(*args, **kwargs)
            self._ds_clip = float(getattr(self.optimizer, "clip_grad", self._ds_clip) or 0.0)
        finally:
            self._set_deepspeed_clip(0.0 if self._clips else self._ds_clip)
        client_state = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if isinstance(client_state, dict) and STATE_KEY in client_state:
            self.monitor.load_state_dict(client_state.pop(STATE_KEY))
        return out

    def state_dict(self) -> dict:
        """The monitor's ``state_dict`` (``engine.save_checkpoint`` saves it in the checkpoint's
        client state under ``"gradfuse"``, and ``engine.load_checkpoint`` restores it).

        Returns:
            ``GradMonitor.state_dict()``.
        """
        return self.monitor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores the monitor's state (``GradMonitor.load_state_dict``).

        Args:
            state: A dict from ``state_dict``.
        """
        self.monitor.load_state_dict(state)

    def detach(self, close: bool = True) -> None:
        """Restores the engine: its optimizer's ``step``, ``save_checkpoint``, ``load_checkpoint``
        and DeepSpeed's own ``gradient_clipping``; closes the monitor's sinks (the last step is
        logged first).

        Args:
            close: False: the monitor's sinks stay open (an integration that closes them later).
        """
        for obj, name, bound, had_own, previous in self._patched.values():
            if obj.__dict__.get(name) is bound:
                if had_own:
                    setattr(obj, name, previous)
                else:
                    delattr(obj, name)
        self._patched = {}
        self._set_deepspeed_clip(self._ds_clip)
        if self._own_overflow and "overflow" in self.optimizer.__dict__:
            del self.optimizer.overflow
        self.monitor.settle()
        if close:
            self.monitor.close()
        self._check_skipped()

    def __enter__(self) -> DeepSpeedAttachment:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


def attach_engine(engine, **monitor_kwargs) -> DeepSpeedAttachment:
    """``gradfuse.attach`` for a ``DeepSpeedEngine``: see ``DeepSpeedAttachment``.

    Args:
        engine: What ``deepspeed.initialize`` returned first.
        **monitor_kwargs: What ``GradMonitor`` takes (``max_norm``, ``per``, ``every``, ``sinks``,
            the policies, ``recorder``, ``sink_ranks``, ``norm_type`` > 0 or inf); those in
            ``REFUSED_OPTIONS`` raise.

    Returns:
        The ``DeepSpeedAttachment``.

    Raises:
        RuntimeError: DeepSpeed is outside ``TESTED_VERSIONS``.
        ValueError: an unsupported configuration or monitor option (the message names it).
    """
    return DeepSpeedAttachment(engine, monitor_kwargs)
