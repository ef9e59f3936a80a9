"""The monitor's policies: from a step's statistics to a decision, as pure functions.

A step is anomalous when a gradient holds NaN or Inf (``"nonfinite"``; under an enabled
GradScaler that is the scaler's overflow, ``"amp_overflow"``, not an anomaly of the model), when
the total norm exceeds ``explode_threshold`` (``"explode"``), when a ``max_norm`` schedule
gave a bad value (``"max_norm"``), or, with a flight recorder, when the loss, the gradient norm or
the update norm spiked (``"spike"``). Each anomaly has a policy: ``"raise"``, ``"skip"`` (the
optimizer step), ``"warn"`` or ``"ignore"``; a spike's also ``"dump"`` (a dump, no warning).

Layer: monitor. Imports torch and ``gradfuse.core``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gradfuse.core.grad_stats import GradStats

POLICIES = ("raise", "skip", "warn", "ignore")
SPIKE_POLICIES = (*POLICIES, "dump")
NONFINITE, EXPLODE, SPIKE = 1, 2, 4  # the bits of anomaly_flags


def check_policy(name: str, value: str, choices: tuple[str, ...] = POLICIES) -> str:
    """Returns ``value`` if it is one of ``choices`` (``POLICIES``).

    Raises:
        ValueError: ``value`` is not; the message names the argument ``name``.
    """
    if value not in choices:
        raise ValueError(f"gradfuse.GradMonitor: {name} must be one of {choices}, got {value!r}")
    return value


def anomaly_flags(s: GradStats, explode_threshold: float | None, spiked: torch.Tensor | None = None) -> torch.Tensor:
    """A 0-d int32 device tensor: ``NONFINITE`` when a gradient holds NaN or Inf, plus
    ``EXPLODE`` when the total norm exceeds ``explode_threshold``, plus ``SPIKE`` when
    ``spiked`` (the flight recorder's 0-d bool) is true; reading it is the one host sync of a
    quiet step that has a policy."""
    flag = s.nonfinite.to(torch.int32)
    if explode_threshold is not None:
        flag = flag + EXPLODE * (s.plain_total_norm.to(s.floats.dtype) > explode_threshold).to(torch.int32)
    if spiked is not None:
        flag = flag + SPIKE * spiked.to(flag.device, torch.int32)
    return flag


def skip_bits(on_nonfinite: str, on_explode: str, on_spike: str, *, amp_active: bool) -> int:
    """The bits of ``anomaly_flags`` whose policy keeps the optimizer from stepping (``"skip"``,
    and ``"raise"``, whose step is not taken either), for a skip decided on the device. Under an
    enabled GradScaler a non-finite gradient is the scaler's to skip."""
    bits = 0
    for bit, policy in ((NONFINITE, on_nonfinite), (EXPLODE, on_explode), (SPIKE, on_spike)):
        if policy in ("skip", "raise") and not (bit == NONFINITE and amp_active):
            bits |= bit
    return bits


@dataclass
class Decision:
    """What a step's anomalies call for: ``anomalies`` (in the order found) and the
    ``policies`` they fired."""
    anomalies: list[str] = field(default_factory=list)
    policies: list[str] = field(default_factory=list)

    @property
    def raises(self) -> bool:
        """Whether a fired policy raises."""
        return "raise" in self.policies

    @property
    def skips(self) -> bool:
        """Whether a fired policy skips the optimizer step."""
        return "skip" in self.policies

    @property
    def warns(self) -> bool:
        """Whether a fired policy warns."""
        return "warn" in self.policies

    @property
    def counts_as_anomaly(self) -> bool:
        """Whether the step is an anomaly of the model (an AMP overflow alone is the scaler's)."""
        return bool(self.anomalies) and self.anomalies != ["amp_overflow"]


def decide(flags: int, *, amp_active: bool, bad_max_norm: bool, on_nonfinite: str,
           on_explode: str, on_spike: str = "ignore") -> Decision:
    """The decision for a step whose ``anomaly_flags`` read ``flags``. Under an enabled
    GradScaler, non-finite gradients are its overflow: the scaler skips that step and lowers its
    scale, so no policy applies (and the gradients are left to it). A bad ``max_norm`` from a
    schedule is under ``on_nonfinite``; a spike under ``on_spike``."""
    d = Decision()
    spiked = bool(flags & SPIKE)
    if flags & NONFINITE and amp_active:
        d.anomalies.append("amp_overflow")
        flags = 0
    elif flags & NONFINITE:
        d.anomalies.append("nonfinite")
        d.policies.append(on_nonfinite)
    if flags & EXPLODE:
        d.anomalies.append("explode")
        d.policies.append(on_explode)
    if bad_max_norm:
        d.anomalies.append("max_norm")
        d.policies.append(on_nonfinite)
    if spiked:
        d.anomalies.append("spike")
        d.policies.append(on_spike)
    return d


def describe(s: GradStats, anomalies: list[str], explode_threshold: float | None) -> str:
    """The message of an anomalous step, naming the parameters at fault (reads ``s``: one
    transfer)."""
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
        parts.append(f"total norm {d['total_norm']:.4g} > explode_threshold {explode_threshold:g}; "
                     "largest: " + ", ".join(f"{n} (l2={p['l2']:.3g})" for n, p in top))
    return "; ".join(parts)
