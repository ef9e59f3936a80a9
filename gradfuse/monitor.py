"""GradMonitor: fused gradient statistics every step, logging every N steps, and policies for
non-finite and exploding gradients that name the parameters at fault.

The monitor never stops a run because of its own output: a sink that raises is warned about once,
retried with a back-off, and every record it did not write is counted (see ``GradMonitor.write``).
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from gradfuse import amp, api, clipping
from gradfuse.api import _check_norm_type
from gradfuse.grad_stats import GradStats
from gradfuse.grad_watch import watch

POLICIES = ("raise", "skip", "warn", "ignore")
# A failing sink sits out 1, 2, 4, ... records after each consecutive failure, at most this many.
SINK_MAX_BACKOFF = 64
STATE_VERSION = 1
COUNTERS = ("skipped_steps", "anomaly_steps", "nonfinite_steps", "explode_steps", "amp_overflow_steps")

# Frames of these packages are not the user's line: warnings point past them.
_FRAMEWORK_PACKAGES = ("gradfuse", "torch", "lightning", "pytorch_lightning", "lightning_fabric",
                       "transformers", "accelerate")


def _framework_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _FRAMEWORK_PACKAGES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside gradfuse, torch and the training
    frameworks: the user's ``mon.step()``, ``optimizer.step()`` or ``trainer.fit()`` line (a fixed
    stacklevel breaks on every decorator, e.g. ``torch.no_grad``)."""
    internal = _framework_dirs()
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


class GradientAnomaly(RuntimeError):
    """Raised by the ``"raise"`` policy; ``report`` holds the step's :class:`StepReport`."""

    def __init__(self, message: str, report: "StepReport"):
        super().__init__(message)
        self.report = report


@dataclass
class StepReport:
    """What :meth:`GradMonitor.step` saw and decided.

    ``skip`` says to skip this optimizer step (the ``"skip"`` policy fired; gradients are left
    as they were, unclipped, for inspection). ``stats`` is the step's :class:`GradStats` (device
    tensors; reading them syncs). ``anomalies`` names what fired: ``"nonfinite"``,
    ``"explode"``, or ``"amp_overflow"`` (a GradScaler step with Inf/NaN gradients: the scaler
    skips it and lowers its scale; not counted as an anomaly of the model).
    """
    step: int
    stats: GradStats | None = None
    skip: bool = False
    logged: bool = False
    anomalies: list[str] = field(default_factory=list)
    message: str = ""
    # activations=True: the step's ActivationCapture on steps it was armed for (cap.forward /
    # cap.backward); trace_nonfinite=True: ("forward" | "backward", module) on non-finite steps.
    activations: object | None = None
    first_nonfinite: tuple[str, str] | None = None


class _SinkState:
    """Failure bookkeeping of one sink (the rule is in :meth:`GradMonitor.write`)."""
    __slots__ = ("written", "dropped", "failures", "wait", "warned", "last_error")

    def __init__(self):
        self.written = self.dropped = self.failures = self.wait = 0
        self.warned = False
        self.last_error: str | None = None


class GradMonitor:
    """Watches a model's gradients during training at the cost of one fused pass per step.

    Args:
        model: the module (or iterable of ``(name, parameter)`` pairs) to watch; held as a
            :func:`gradfuse.watch` handle (see there for when its parameters are re-resolved).
        max_norm: clip by total norm to this value every step (as ``clip_grad_norm_``); None: no clip.
            Also a schedule, a callable of the step number returning the value (``lambda step:
            1.0 if step < 5000 else 0.5``; logged each logging step as ``max_norm``; a value that
            is NaN, negative or not a number, or a schedule that raises, is an anomaly named
            ``"max_norm"`` handled by ``on_nonfinite``: ``raise`` raises a ValueError naming the
            step, ``skip`` skips the step, ``warn`` / ``ignore`` do not clip that step), or a
            :class:`gradfuse.ZClip` (adaptive threshold, state on the device and in
            :meth:`state_dict`). See :mod:`gradfuse.clipping`.
        per: with ``max_norm``: ``"param"`` / ``"layer"`` clips each parameter / layer (grouped
            as ``layer_depth`` groups them) by its own norm.
        clip_value: clamp every gradient to ``[-clip_value, clip_value]`` (as
            ``clip_grad_value_``); the statistics are from before clamping, with the clamped
            element counts.
        agc: adaptive gradient clipping with this ``clip_factor`` (as
            ``gradfuse.adaptive_clip_grad_``, ``eps=agc_eps``, of order ``norm_type``).
        check_double_clip: warn once when the gradients were changed in place between the
            backward and the monitor's clip (someone else clipped them too).
        norm_type: order of the total norm.
        every: log the full statistics to the sinks every ``every`` steps (0: never).
        on_nonfinite: policy when any gradient holds NaN or Inf: ``"skip"`` (default: the update
            is not applied, as ``GradScaler`` does), ``"raise"``, ``"warn"`` or ``"ignore"``.
        explode_threshold: total norm above which a step counts as an explosion (None: off).
        on_explode: policy for explosions (same choices). Default ``"skip"``: a threshold is a
            circuit breaker. Clipping would still apply a full ``max_norm`` step in the direction
            of a gradient that is mostly noise, and without clipping the spike enters Adam's
            second moments and shrinks the learning rate for thousands of steps.
        sinks: objects with ``write(record: dict)`` (see :mod:`gradfuse.sinks`).
        layer_depth: how parameters are grouped into layers for the per-layer aggregates.
            None (default): by module path up to the first block index (``transformer.h.3``,
            ``layers.0``; ``lm_head`` for parameters outside numbered blocks); an int: that many
            leading name parts.
        scaler: a ``torch.amp.GradScaler``. Either call ``scaler.unscale_(optimizer)`` before
            :meth:`step`, or pass ``optimizer`` too and let the monitor unscale, check and clip
            in one fused pass (one read and one write of the gradients instead of three reads
            and two writes; see :func:`gradfuse.unscale_clip_`).
        optimizer: with ``scaler``: the optimizer whose gradients the monitor unscales.
        enabled: False turns the monitor off: :meth:`step` then does nothing at all.
        start_step: the first step number. A resumed run restores it (and the counters) with
            :meth:`load_state_dict`.
        histogram: on logging steps also the per-layer exponent histogram (record key
            ``exponents``) and numeric headroom for fp16 / bf16 / fp8 (``headroom``; metrics
            ``headroom/<layer>/<column>``), of the gradients as the optimizer gets them (after
            unscaling and clipping): two more fused passes on logging steps only
            (see :mod:`gradfuse.headroom`).
        noise_scale: True or a :class:`gradfuse.NoiseScale`: the gradient noise scale, logged as
            ``grad/noise_scale``, ``grad/noise_scale_G2``, ``grad/noise_scale_trSigma`` (see
            :mod:`gradfuse.noise_scale`; call :meth:`micro_step` after each backward under
            gradient accumulation, or register the DDP hook).
        update_ratios: an optimizer (or a list; True: ``optimizer``): per-layer update-to-weight
            ratios and weight norms on logging steps, ``update_ratio/<layer>``,
            ``weight_norm/<layer>`` (see :mod:`gradfuse.update_ratio`).
        activations: also log the statistics of every module's output and of the gradient with
            respect to it (see :func:`gradfuse.capture_activations`) on the steps that are logged
            (``every``): hooks are registered for those steps only (armed at the end of the step
            before), no hook at all on the others. Records get ``act`` and ``act_grad`` per layer.
        trace_nonfinite: on every step, one small fused reduction per module output and output
            gradient (no host sync on a clean step); on a step with non-finite gradients, the
            first module where a NaN / Inf appeared is named in the message and in
            ``StepReport.first_nonfinite``.
        activation_modules: which modules (names or modules; default: all) for both options.
        module: the nn.Module whose activations are watched when ``model`` is not one (e.g. named
            parameters; :func:`gradfuse.attach` passes its ``model``).

    Host transfers: none on a step that needs no decision and logs nothing; one 0-d flag on
    steps where a policy must decide; the whole statistics on logging steps and anomalies.

    Sinks never stop training: see :meth:`write` for what happens when one raises.
    """

    def __init__(self, model, *, max_norm: float | None = None, norm_type: float = 2.0,
                 every: int = 100, on_nonfinite: str = "skip",
                 explode_threshold: float | None = None, on_explode: str = "skip",
                 sinks=(), layer_depth: int | None = None, scaler=None, optimizer=None,
                 enabled: bool = True, start_step: int = 0, histogram: bool = False,
                 per: str | None = None, clip_value: float | None = None, agc: float | None = None,
                 agc_eps: float = 1e-3, check_double_clip: bool = True,
                 noise_scale=False, update_ratios=False,
                 activations: bool = False, trace_nonfinite: bool = False, activation_modules=None,
                 module: nn.Module | None = None):
        for name, value in (("on_nonfinite", on_nonfinite), ("on_explode", on_explode)):
            if value not in POLICIES:
                raise ValueError(f"gradfuse.GradMonitor: {name} must be one of {POLICIES}, got {value!r}")
        if explode_threshold is not None and not explode_threshold > 0:
            raise ValueError(f"gradfuse.GradMonitor: explode_threshold must be > 0, got {explode_threshold!r}")
        if every < 0:
            raise ValueError(f"gradfuse.GradMonitor: every must be >= 0, got {every}")
        if not isinstance(model, (nn.Module, torch.Tensor)):
            model = list(model)  # iterated every step
        self.source = model
        self.max_norm = clipping.check_max_norm_arg(max_norm)
        self.norm_type = _check_norm_type(norm_type)
        self._watch = watch(model, norm_type=self.norm_type)  # parameters resolved once, not per step
        self.per = clipping.check_per(per)
        self.clip_value = None if clip_value is None else clipping.check_clip_value(clip_value)
        self.agc = None if agc is None else clipping.check_agc_args(agc, agc_eps, self.norm_type)
        modes = [m for m, v in (("max_norm", max_norm), ("clip_value", clip_value), ("agc", agc))
                 if v is not None]
        if len(modes) > 1:
            raise ValueError(f"gradfuse.GradMonitor: pass one of max_norm, clip_value and agc, got {modes}")
        if per is not None and (self.max_norm is None or isinstance(self.max_norm, clipping.ZClip)):
            raise ValueError("gradfuse.GradMonitor: per= needs a max_norm (a number or a schedule)")
        self._call_name = "gradfuse GradMonitor.step()"  # what the double-clipping warning names
        self._double_clip = (clipping.DoubleClipCheck(self._watch.params, self._watch.names)
                             if check_double_clip and modes else None)
        self._double_clip_warned = False
        self._max_norm_now = None  # the max_norm of the latest step (a number, or a device threshold)
        self.every = every
        self.on_nonfinite = on_nonfinite
        self.explode_threshold = explode_threshold
        self.on_explode = on_explode if explode_threshold is not None else "ignore"
        self.sinks = list(sinks)
        self._sink_states: dict[int, _SinkState] = {}
        self.layer_depth = layer_depth
        self.scaler = scaler
        self.optimizer = optimizer
        if optimizer is not None and scaler is None:
            raise ValueError("gradfuse.GradMonitor: optimizer= is for the fused AMP unscale; pass scaler= too")
        named = model.named_parameters() if isinstance(model, nn.Module) else (
            [] if isinstance(model, torch.Tensor) else model)
        self._names_by_param = {id(item[1]): item[0] for item in named if isinstance(item, tuple)}
        self.enabled = enabled
        self.histogram = histogram  # exponent histograms and headroom on logging steps
        self.step_count = start_step
        self.skipped_steps = 0
        self.anomaly_steps = 0
        self.nonfinite_steps = 0
        self.explode_steps = 0
        self.amp_overflow_steps = 0
        self._clipped_restored = 0  # clipped steps before load_state_dict
        self._clipped = None  # device counter: reading it syncs, counting it does not
        self._restored = False
        self._started = False
        self._last_report: StepReport | None = None
        self.dynamics = None  # gradfuse.dynamics: noise scale, update ratios
        if noise_scale or update_ratios:
            from gradfuse.dynamics import Dynamics
            self.dynamics = Dynamics(self, noise_scale, update_ratios)
        self._act_hooks = None
        if activations or trace_nonfinite:
            from gradfuse.activations import MonitorHooks
            self._act_hooks = MonitorHooks(module if module is not None else model, activation_modules,
                                           activations=activations, trace_nonfinite=trace_nonfinite)
            if enabled:  # the first step's forward and backward come before its step()
                self._act_hooks.arm(full=self.every > 0 and start_step % self.every == 0)

    def arm_activations(self, full: bool = True) -> None:
        """Arms the activation hooks for the coming forward and backward (an integration that
        decides per step whether it logs calls this before the step; ``step`` arms by ``every``)."""
        if self._act_hooks is not None and self.enabled:
            self._act_hooks.arm(full)

    @property
    def clipped_steps(self) -> int:
        """Steps on which clipping scaled the gradients (reads a device counter)."""
        return self._clipped_restored + (0 if self._clipped is None else int(self._clipped))

    @property
    def dropped_records(self) -> int:
        """Records that some sink did not write (it raised, or sat out its back-off)."""
        return sum(st.dropped for st in self._sink_states.values())

    def sink_health(self) -> list[dict]:
        """Per sink, in the order of :attr:`sinks`: ``sink`` (its class name), ``written``,
        ``dropped``, ``failures`` (consecutive), ``retry_in`` (records it still sits out) and
        ``last_error``."""
        out = []
        for sink in self.sinks:
            st = self._sink_states.get(id(sink)) or _SinkState()
            out.append({"sink": type(sink).__name__, "written": st.written, "dropped": st.dropped,
                        "failures": st.failures, "retry_in": st.wait, "last_error": st.last_error})
        return out

    def _amp_active(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def _needs_flag(self) -> bool:
        return (self.on_nonfinite != "ignore" or self.on_explode != "ignore"
                or self._amp_active()
                or (self._act_hooks is not None and self._act_hooks.trace_nonfinite))

    def _unscale_here(self) -> bool:
        """Whether this step unscales the gradients itself: the fused AMP path, taken unless
        the gradients were unscaled already (``scaler.unscale_`` was called)."""
        if self.optimizer is None or not self._amp_active():
            return False
        from torch.amp.grad_scaler import OptState
        return self.scaler._per_optimizer_states[id(self.optimizer)]["stage"] is OptState.READY

    @torch.no_grad()
    def step(self, log: bool | None = None) -> StepReport:
        """Takes this step's statistics (and clips when ``max_norm`` is set), applies the policies,
        logs when due, and says whether to skip the optimizer step.

        ``log``: True / False log this step or not (an integration following its framework's
        logging cadence); None: every ``every`` steps. Anomalies are logged either way.
        """
        step = self.step_count
        self.step_count += 1
        if not self.enabled:
            if self._act_hooks is not None:
                self._act_hooks.take()  # turned off after hooks were armed: none stays
            return StepReport(step)
        if not self._started:
            self._started = True
            self._check_sinks_continue(step)
        capture = self._act_hooks.take() if self._act_hooks is not None else None
        fused_unscale = self._unscale_here()
        log_now = (self.every > 0 and step % self.every == 0) if log is None else log
        # DTensor gradients: a step that does not log reduces only the total norm (one scalar
        # all-reduce); the rows follow when an anomaly's message reads them (on every rank).
        rows = bool(log_now and self.sinks)
        self._check_double_clip(fused_unscale)
        max_norm, bad_max_norm = self._max_norm_at(step)
        plain = isinstance(max_norm, float) and self.per is None
        # With no policy to apply before clipping, statistics and clip are one call.
        clip_now = not fused_unscale and plain and not self._needs_flag()
        value_now = (not fused_unscale and self.clip_value is not None and not self._needs_flag()
                     and self.norm_type == 2.0)
        if fused_unscale:
            names, grads = amp.optimizer_named_grads(self.optimizer, self._names_by_param)
            s, inv_scale = amp.unscaled_stats(names, grads, self.scaler, self.norm_type)
        elif clip_now:
            s = self._watch.clip_(max_norm, rows=rows)
        elif value_now:  # one pass: clamp, with the statistics from before clamping
            names, _params, grads = api._with_grads(self._watch.names, self._watch.params)
            s = clipping.clamp_stats_(names, grads, self.clip_value)
        else:
            s = self._watch.stats(rows=rows)
        report = StepReport(step, stats=s)
        if capture is not None and capture.full:
            report.activations = capture
        if self._act_hooks is not None:  # hooks for the next step's forward and backward
            self._act_hooks.arm(full=log is None and self.every > 0 and (step + 1) % self.every == 0)

        code = 0
        if len(s) and self._needs_flag():
            flag = s.nonfinite.to(torch.int32)
            if self.explode_threshold is not None:
                flag = flag + 2 * (s._total.double() > self.explode_threshold).to(torch.int32)
            code = int(flag)  # the one host sync of a quiet step that has a policy
        if code & 1 and self._amp_active():
            report.anomalies.append("amp_overflow")
            self.amp_overflow_steps += 1
            code = 0  # the scaler skips this step; leave its gradients alone
        elif code & 1:
            report.anomalies.append("nonfinite")
            self.nonfinite_steps += 1
        if code & 2:
            report.anomalies.append("explode")
            self.explode_steps += 1

        policies = ([self.on_nonfinite] if code & 1 else []) + ([self.on_explode] if code & 2 else [])
        if bad_max_norm is not None:  # a schedule's bad value: under the on_nonfinite policy
            report.anomalies.append("max_norm")
            policies.append(self.on_nonfinite)
            if self.on_nonfinite == "raise":
                if fused_unscale:
                    amp.finish_unscale_(self.scaler, self.optimizer, grads, s, inv_scale, None)
                raise bad_max_norm
        if report.anomalies and report.anomalies != ["amp_overflow"]:
            self.anomaly_steps += 1
            report.message = self._describe(s, report.anomalies)
            if code & 1 and capture is not None:  # where the NaN / Inf first appeared
                report.first_nonfinite = capture.first_nonfinite
                origin = capture.describe_nonfinite()
                if origin:
                    report.message = f"{origin}; {report.message}"
            if bad_max_norm is not None:
                report.message = "; ".join(m for m in (report.message, str(bad_max_norm)) if m)
        if "raise" in policies:
            if fused_unscale:  # leave the gradients unscaled, in true units, for inspection
                amp.finish_unscale_(self.scaler, self.optimizer, grads, s, inv_scale, None)
            self._write(report, event=True)
            raise GradientAnomaly(report.message, report)
        # An AMP overflow step is the scaler's to skip: scaler.step/update must still run.
        report.skip = "skip" in policies
        if report.skip:
            self.skipped_steps += 1
            warn(f"gradfuse step {step}: optimizer step skipped: {report.message}")
        elif "warn" in policies:
            warn(f"gradfuse step {step}: {report.message}")

        clip = ((max_norm is not None or self.clip_value is not None or self.agc is not None)
                and not report.skip and "amp_overflow" not in report.anomalies)
        if fused_unscale:  # one multiply: unscale, and clip when due
            s = amp.finish_unscale_(self.scaler, self.optimizer, grads, s, inv_scale,
                                    max_norm if clip and plain else None)
        elif clip and plain and not clip_now:
            s = self._watch._clip_to(s, max_norm)
        if clip and not plain and not value_now:  # the other modes: gradfuse.clipping
            s = self._clip_other_modes(s, max_norm)
        if clip and s.clipped is not None:
            clipped = s.clipped if s.clipped.dim() == 0 else s.clipped.any()
            report.stats = s
            self._clipped = clipped.to(torch.int64) if self._clipped is None else self._clipped + clipped
        if self.dynamics is not None:
            self.dynamics.on_step(self, report, log_now)
        if log_now or (report.anomalies and policies):
            self._write(report, event=bool(report.anomalies))
            report.logged = True
        self._last_report = report
        return report

    def _max_norm_at(self, step: int):
        """(this step's max_norm: a float, a ZClip or None; the ScheduleError of a bad value)."""
        m = self.max_norm
        if callable(m) and not isinstance(m, clipping.ZClip):
            try:
                m = clipping.max_norm_at(m, step)
            except clipping.ScheduleError as e:
                self._max_norm_now = None
                return None, e
        self._max_norm_now = m
        return m, None

    def _logged_max_norm(self, report: StepReport):
        m = report.stats.max_norm if report.stats is not None else None
        if m is None:
            m = self._max_norm_now
        if isinstance(m, clipping.ZClip):  # its threshold of that step (inf: nothing clipped)
            m = m.last_threshold
        return float(m) if isinstance(m, torch.Tensor) else m

    def _check_double_clip(self, fused_unscale: bool) -> None:
        if self._double_clip is None:
            return
        # scaler.unscale_ (called before the monitor) changes every gradient once, legitimately
        allowed = 1 if self._amp_active() and not fused_unscale else 0
        name = self._double_clip.changed(allowed)
        if name is not None and not self._double_clip_warned:
            self._double_clip_warned = True
            warn(clipping.double_clip_message(self._call_name, name))

    def _clip_other_modes(self, s: GradStats, max_norm) -> GradStats:
        """per=, ZClip, clip_value and agc (gradfuse.clipping)."""
        if self.agc is not None:
            cf, eps, p = self.agc
            _names, params, _grads = api._with_grads(self._watch.names, self._watch.params)
            clipping.adaptive_clip_grad_(params, cf, eps, p)
            return s
        if self.clip_value is not None:
            names, _params, grads = api._with_grads(self._watch.names, self._watch.params)
            clamped = clipping.clamp_stats_(names, grads, self.clip_value)
            s = s._replace()
            s.clamped, s.clip_value = clamped.clamped, self.clip_value
            return s
        return clipping.monitor_clip_(s, (self._watch.names, self._watch.params),
                                      {"per": self.per, "layer_depth": self.layer_depth}, max_norm)
    def micro_step(self) -> None:
        """Says a micro-batch's backward has finished (gradient accumulation), for the noise
        scale: call it after each ``backward()``; the first micro-batch's squared norm is taken
        by one fused pass on steps that accumulate. Does nothing without ``noise_scale``."""
        if self.enabled and self.dynamics is not None:
            self.dynamics.micro_step(self)

    @property
    def noise_scale(self):
        """The :class:`gradfuse.NoiseScale` estimator, or None."""
        return None if self.dynamics is None else self.dynamics.noise_scale

    def _describe(self, s: GradStats, anomalies: list[str]) -> str:
        d = s.to_dict()
        parts = []
        if "nonfinite" in anomalies:
            bad = [f"{n} (nan={p['nan_count']}, inf={p['inf_count']}, l2={p['l2']:.3g})"
                   for n, p in d["params"].items() if p["nan_count"] or p["inf_count"]]
            parts.append(f"non-finite gradients in {len(bad)} parameter(s): " + ", ".join(bad[:10])
                         + (f", ... {len(bad) - 10} more" if len(bad) > 10 else ""))
        if "explode" in anomalies:
            top = sorted(d["params"].items(), reverse=True,  # NaN first
                         key=lambda kv: kv[1]["l2"] if not math.isnan(kv[1]["l2"]) else math.inf)[:5]
            parts.append(f"total norm {d['total_norm']:.4g} > explode_threshold {self.explode_threshold:g}; "
                         "largest: " + ", ".join(f"{n} (l2={p['l2']:.3g})" for n, p in top))
        return "; ".join(parts)

    def counters(self) -> dict[str, int]:
        """The run's counters so far: ``steps`` (steps taken), ``clipped_steps`` (reads a device
        counter), ``skipped_steps``, ``anomaly_steps``, ``nonfinite_steps``, ``explode_steps``,
        ``amp_overflow_steps``, ``dropped_records``."""
        out = {"steps": self.step_count, "clipped_steps": self.clipped_steps}
        out.update({name: getattr(self, name) for name in COUNTERS})
        out["dropped_records"] = self.dropped_records
        return out

    def record(self, report: StepReport, event: bool = False) -> dict:
        """The record the sinks get for ``report`` (reads its statistics: one transfer)."""
        d = report.stats.to_dict()
        extra = {} if self.dynamics is None else self.dynamics.record(report)
        return {
            "step": report.step,
            "total_norm": d["total_norm"],
            "norm_type": d["norm_type"],
            "max_norm": self._logged_max_norm(report),
            "clip_coef": d["clip_coef"],
            "clipped": d["clipped"],
            "nonfinite": d["nonfinite"],
            "skipped": report.skip,
            "anomalies": report.anomalies,
            "message": report.message,
            "event": event,
            "counters": self.counters(),
            "params": d["params"],
            "layers": report.stats.layers(self.layer_depth),
            **(self._headroom_fields() if self.histogram else {}),
            **extra,
            **self._activation_record(report),
        }

    def _headroom_fields(self) -> dict:
        from gradfuse import headroom
        from gradfuse.api import _named_grads, tensor_stats
        names, _params, grads = _named_grads(self.source)
        h = tensor_stats(dict(zip(names, grads)), histogram=True)
        frac, exps = headroom.layer_record(h.names, h.exponent_histogram, h.headroom, self.layer_depth)
        return {"headroom": frac, "exponents": exps}


    def _activation_record(self, report: StepReport) -> dict:
        out = {}
        if report.first_nonfinite is not None:
            out["first_nonfinite"] = list(report.first_nonfinite)
        if report.activations is not None:
            out["act"] = report.activations.forward.layers(self.layer_depth)
            out["act_grad"] = report.activations.backward.layers(self.layer_depth)
        return out

    def _write(self, report: StepReport, event: bool) -> None:
        if self.sinks:
            self.write(self.record(report, event))

    def write(self, record: dict) -> None:
        """Hands ``record`` to every sink. A sink that raises (a full disk, a closed writer, a
        metrics client that times out: any ``Exception``) does not stop training or the other
        sinks. The rule: its first failure warns once, with the reason; after its k-th
        consecutive failure it sits out the next ``min(2**(k-1), 64)`` records, then is tried
        again; a success resets k. Every record a sink did not write counts in
        :attr:`dropped_records` (per sink: :meth:`sink_health`)."""
        for sink in self.sinks:
            st = self._sink_states.setdefault(id(sink), _SinkState())
            if st.wait > 0:
                st.wait -= 1
                st.dropped += 1
                continue
            try:
                sink.write(record)
            except Exception as e:  # noqa: BLE001 - monitoring must never end the run
                self._sink_failed(sink, st, e, "write")
                st.wait = min(2 ** (st.failures - 1), SINK_MAX_BACKOFF)
            else:
                st.written += 1
                st.failures = 0

    def _sink_failed(self, sink, st: _SinkState, error: Exception, what: str) -> None:
        st.failures += 1
        if what == "write":
            st.dropped += 1
        st.last_error = f"{type(error).__name__}: {error}"
        if not st.warned:
            st.warned = True
            warn(f"gradfuse: sink {type(sink).__name__} failed to {what} ({st.last_error}); training "
                 "goes on, the sink is retried with a back-off and the records it misses are counted "
                 "in GradMonitor.dropped_records (this warning is shown once per sink)")

    def _check_sinks_continue(self, first_step: int) -> None:
        """A fresh monitor writing into a log that already reaches past its first step would
        number steps twice: say how to continue the numbering instead."""
        if self._restored:
            return
        for sink in self.sinks:
            last_step = getattr(sink, "last_step", None)
            try:
                last = last_step() if callable(last_step) else None
            except Exception:  # noqa: BLE001 - a sink's own problem, reported when it writes
                last = None
            if last is not None and last >= first_step:
                warn(f"gradfuse: {type(sink).__name__} already holds records up to step {last} and this "
                     f"monitor starts at step {first_step}. To continue a run's numbering, save "
                     "GradMonitor.state_dict() with your checkpoint and load_state_dict() it on resume.")

    def state_dict(self) -> dict:
        """What a resumed run needs to continue: the next step number and the counters (reads
        the device counter of clipped steps). Save it with the training checkpoint."""
        state = {"version": STATE_VERSION, "step": self.step_count, "clipped_steps": self.clipped_steps}
        state.update({name: getattr(self, name) for name in COUNTERS})
        if isinstance(self.max_norm, clipping.ZClip):
            state["zclip"] = self.max_norm.state_dict()
        if self.dynamics is not None:
            state["dynamics"] = self.dynamics.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`: the next :meth:`step` continues the numbering and counts."""
        missing = {"step", "clipped_steps", *COUNTERS} - set(state)
        if missing:
            raise KeyError(f"gradfuse.GradMonitor.load_state_dict: missing {sorted(missing)}")
        if state.get("version", STATE_VERSION) > STATE_VERSION:
            raise ValueError(f"gradfuse.GradMonitor.load_state_dict: state version {state['version']} "
                             f"is newer than this gradfuse understands ({STATE_VERSION})")
        self.step_count = int(state["step"])
        for name in COUNTERS:
            setattr(self, name, int(state[name]))
        self._clipped_restored = int(state["clipped_steps"])
        if self.dynamics is not None and "dynamics" in state:
            self.dynamics.load_state_dict(state["dynamics"])
        self._clipped = None
        self._restored = True
        if isinstance(self.max_norm, clipping.ZClip) and "zclip" in state:
            self.max_norm.load_state_dict(state["zclip"])

    def flush(self) -> None:
        """Logs the last step if it was not logged, so that the log ends where the run ended
        (its counters cover every step). :meth:`close` does this first."""
        last = self._last_report
        if last is not None and not last.logged and last.stats is not None:
            self._write(last, event=False)
            last.logged = True

    def close(self) -> None:
        """Logs the last step (:meth:`flush`) and closes the sinks (a sink that fails to close
        is warned about, never raised)."""
        if self._act_hooks is not None:
            self._act_hooks.take()  # no hook outlives the monitor
        self.flush()
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close:
                try:
                    close()
                except Exception as e:  # noqa: BLE001
                    self._sink_failed(sink, self._sink_states.setdefault(id(sink), _SinkState()), e, "close")
