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

from gradfuse import amp
from gradfuse.api import _check_max_norm, _check_norm_type
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
                 enabled: bool = True, start_step: int = 0, activations: bool = False,
                 trace_nonfinite: bool = False, activation_modules=None, module: nn.Module | None = None):
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
        self.max_norm = None if max_norm is None else _check_max_norm(max_norm)
        self.norm_type = _check_norm_type(norm_type)
        self._watch = watch(model, norm_type=self.norm_type)  # parameters resolved once, not per step
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
        # With no policy to apply before clipping, statistics and clip are one call.
        clip_now = not fused_unscale and self.max_norm is not None and not self._needs_flag()
        if fused_unscale:
            names, grads = amp.optimizer_named_grads(self.optimizer, self._names_by_param)
            s, inv_scale = amp.unscaled_stats(names, grads, self.scaler, self.norm_type)
        elif clip_now:
            s = self._watch.clip_(self.max_norm)
        else:
            s = self._watch.stats()
        report = StepReport(step, stats=s)
        log_now = (self.every > 0 and step % self.every == 0) if log is None else log
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
        if report.anomalies and report.anomalies != ["amp_overflow"]:
            self.anomaly_steps += 1
            report.message = self._describe(s, report.anomalies)
            if code & 1 and capture is not None:  # where the NaN / Inf first appeared
                report.first_nonfinite = capture.first_nonfinite
                origin = capture.describe_nonfinite()
                if origin:
                    report.message = f"{origin}; {report.message}"
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

        clip = self.max_norm is not None and not report.skip and "amp_overflow" not in report.anomalies
        if fused_unscale:  # one multiply: unscale, and clip when due
            s = amp.finish_unscale_(self.scaler, self.optimizer, grads, s, inv_scale,
                                    self.max_norm if clip else None)
        elif clip and not clip_now:
            s = self._watch._clip_to(s, self.max_norm)
        if clip:
            report.stats = s
            self._clipped = s.clipped.to(torch.int64) if self._clipped is None else self._clipped + s.clipped
        if log_now or (report.anomalies and policies):
            self._write(report, event=bool(report.anomalies))
            report.logged = True
        self._last_report = report
        return report

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
        return {
            "step": report.step,
            "total_norm": d["total_norm"],
            "norm_type": d["norm_type"],
            "max_norm": self.max_norm,
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
            **self._activation_record(report),
        }

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
        self._clipped = None
        self._restored = True

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
