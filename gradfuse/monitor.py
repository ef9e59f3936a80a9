"""GradMonitor: fused gradient statistics every step, logging every N steps, and policies for
non-finite and exploding gradients that name the parameters at fault."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from gradfuse import amp
from gradfuse.api import _check_max_norm, _check_norm_type
from gradfuse.grad_stats import GradStats
from gradfuse.grad_watch import watch

POLICIES = ("raise", "skip", "warn", "ignore")


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


class GradMonitor:
    """Watches a model's gradients during training at the cost of one fused pass per step.

    Args:
        model: the module (or iterable of ``(name, parameter)`` pairs) to watch; held as a
            :func:`gradfuse.watch` handle (see there for when its parameters are re-resolved).
        max_norm: clip by total norm to this value every step (as ``clip_grad_norm_``); None: no clip.
        norm_type: order of the total norm.
        every: log the full statistics to the sinks every ``every`` steps (0: never).
        on_nonfinite: policy when any gradient holds NaN or Inf: ``"raise"``, ``"skip"``,
            ``"warn"`` or ``"ignore"``.
        explode_threshold: total norm above which a step counts as an explosion (None: off).
        on_explode: policy for explosions (same choices).
        sinks: objects with ``write(record: dict)`` (see :mod:`gradfuse.sinks`).
        layer_depth: name parts that make a layer for the per-layer aggregates (``layers.3``).
        scaler: a ``torch.amp.GradScaler``. Either call ``scaler.unscale_(optimizer)`` before
            :meth:`step`, or pass ``optimizer`` too and let the monitor unscale, check and clip
            in one fused pass (one read and one write of the gradients instead of three reads
            and two writes; see :func:`gradfuse.unscale_clip_`).
        optimizer: with ``scaler``: the optimizer whose gradients the monitor unscales.
        enabled: False turns the monitor off: :meth:`step` then does nothing at all.
        start_step: the first step number; default: one past the last step the sinks recorded
            (a resumed run continues its log), else 0.

    Host transfers: none on a step that needs no decision and logs nothing; one 0-d flag on
    steps where a policy must decide; the whole statistics on logging steps and anomalies.
    """

    def __init__(self, model, *, max_norm: float | None = None, norm_type: float = 2.0,
                 every: int = 100, on_nonfinite: str = "raise",
                 explode_threshold: float | None = None, on_explode: str = "warn",
                 sinks=(), layer_depth: int = 2, scaler=None, optimizer=None,
                 enabled: bool = True, start_step: int | None = None):
        for name, value in (("on_nonfinite", on_nonfinite), ("on_explode", on_explode)):
            if value not in POLICIES:
                raise ValueError(f"gradfuse.GradMonitor: {name} must be one of {POLICIES}, got {value!r}")
        if explode_threshold is not None and not explode_threshold > 0:
            raise ValueError(f"gradfuse.GradMonitor: explode_threshold must be > 0, got {explode_threshold!r}")
        if every < 0:
            raise ValueError(f"gradfuse.GradMonitor: every must be >= 0, got {every}")
        self.source = model
        self.max_norm = None if max_norm is None else _check_max_norm(max_norm)
        self.norm_type = _check_norm_type(norm_type)
        self._watch = watch(model, norm_type=self.norm_type)  # parameters resolved once, not per step
        self.every = every
        self.on_nonfinite = on_nonfinite
        self.explode_threshold = explode_threshold
        self.on_explode = on_explode if explode_threshold is not None else "ignore"
        self.sinks = list(sinks)
        self.layer_depth = layer_depth
        self.scaler = scaler
        self.optimizer = optimizer
        if optimizer is not None and scaler is None:
            raise ValueError("gradfuse.GradMonitor: optimizer= is for the fused AMP unscale; pass scaler= too")
        self._names_by_param = ({id(p): n for n, p in model.named_parameters()}
                                if isinstance(model, nn.Module) else None)
        self.enabled = enabled
        if start_step is None:
            last = [s.last_step() for s in self.sinks if getattr(s, "last_step", None)]
            last = [x for x in last if x is not None]
            start_step = max(last) + 1 if last else 0
        self.step_count = start_step
        self.skipped_steps = 0
        self.anomaly_steps = 0
        self.amp_overflow_steps = 0
        self._clipped = None  # device counter: reading it syncs, counting it does not

    @property
    def clipped_steps(self) -> int:
        """Steps on which clipping scaled the gradients (reads a device counter)."""
        return 0 if self._clipped is None else int(self._clipped)

    def _amp_active(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def _needs_flag(self) -> bool:
        return (self.on_nonfinite != "ignore" or self.on_explode != "ignore"
                or self._amp_active())

    @torch.no_grad()
    def step(self) -> StepReport:
        """Takes this step's statistics (and clips when ``max_norm`` is set), applies the policies,
        logs when due, and says whether to skip the optimizer step."""
        step = self.step_count
        self.step_count += 1
        if not self.enabled:
            return StepReport(step)
        fused_unscale = self.optimizer is not None and self._amp_active()
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
        log_now = self.every > 0 and step % self.every == 0

        code = 0
        if len(s) and self._needs_flag():
            flag = s.nonfinite.to(torch.int32)
            if self.explode_threshold is not None:
                flag = flag + 2 * (s.total_norm.double() > self.explode_threshold).to(torch.int32)
            code = int(flag)  # the one host sync of a quiet step that has a policy
        if code & 1 and self._amp_active():
            report.anomalies.append("amp_overflow")
            self.amp_overflow_steps += 1
            code = 0  # the scaler skips this step; leave its gradients alone
        elif code & 1:
            report.anomalies.append("nonfinite")
        if code & 2:
            report.anomalies.append("explode")

        policies = ([self.on_nonfinite] if code & 1 else []) + ([self.on_explode] if code & 2 else [])
        if report.anomalies and report.anomalies != ["amp_overflow"]:
            self.anomaly_steps += 1
            report.message = self._describe(s, report.anomalies)
        if "raise" in policies:
            if fused_unscale:  # leave the gradients unscaled, in true units, for inspection
                amp.finish_unscale_(self.scaler, self.optimizer, grads, s, inv_scale, None)
            self._write(report, s, event=True)
            raise GradientAnomaly(report.message, report)
        # An AMP overflow step is the scaler's to skip: scaler.step/update must still run.
        report.skip = "skip" in policies
        if "skip" in policies:
            self.skipped_steps += 1
        if "warn" in policies:
            warnings.warn(f"gradfuse step {step}: {report.message}", RuntimeWarning, stacklevel=2)

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
            self._write(report, s, event=bool(report.anomalies))
            report.logged = True
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

    def _write(self, report: StepReport, s: GradStats, event: bool) -> None:
        if not self.sinks:
            return
        d = s.to_dict()
        record = {
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
            "params": d["params"],
            "layers": s.layers(self.layer_depth),
        }
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close:
                close()
