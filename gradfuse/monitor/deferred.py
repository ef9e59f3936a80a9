"""The monitor that never blocks (``GradMonitor(blocking=False)``): a step's decision taken on
the device and handed to the optimizer's step as a skip flag, and what the host needs of the step
copied without blocking and read at the next step (``Pending``).

What is decided where: the flag (non-finite, explosion, spike) and the skip on the device, at
the step; everything the host does with it (warnings, counters, a ``"raise"``, dumps, records)
at the next ``step``, ``flush``, ``close`` or ``state_dict``, from the host copies.

Layer: monitor. Imports ``gradfuse.core``, ``gradfuse.clip.zclip`` and the monitor's policies,
device skip and record.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gradfuse.clip.zclip import ZClip
from gradfuse.core.host_copy import HostCopy
from gradfuse.monitor.device_skip import StepHandoff, device_skip_kind
from gradfuse.monitor.policies import skip_bits
from gradfuse.monitor.record import HeadroomTake
from gradfuse.utils import warn


def step_handoff(monitor, optimizer, *, blocking: bool, fused_step: bool) -> tuple[StepHandoff, bool]:
    """The ``StepHandoff`` of ``monitor``'s optimizer steps (with the update clipping of its
    ``dynamics`` when that rides the step), and whether the monitor defers its steps
    (``blocking=False``, unless it must block: ``device_skip_for``)."""
    rides = monitor.dynamics is not None and monitor.dynamics.rides_step
    update_clip = monitor.dynamics.update_clip if rides else None
    hook = None if blocking else device_skip_for(monitor, optimizer, update_clip)
    return hook or StepHandoff([optimizer] if fused_step else [], update_clip), hook is not None


def device_skip_for(monitor, optimizer, update_clip=None) -> StepHandoff | None:
    """The ``StepHandoff`` of a ``blocking=False`` monitor, or None when it must block: a policy
    can skip (or raise) and ``optimizer`` cannot take a skip on the device (warned once, with
    what would avoid it)."""
    can_skip = skip_bits(monitor.on_nonfinite, monitor.on_explode, monitor.on_spike, amp_active=False) != 0
    if optimizer is not None and device_skip_kind(optimizer) is not None:
        return StepHandoff([optimizer], update_clip)
    if not can_skip:
        return StepHandoff([])
    what = "no optimizer=" if optimizer is None else f"a {type(optimizer).__qualname__}"
    warn(f"gradfuse.GradMonitor(blocking=False): with {what}, a policy that skips or raises needs the host to read "
         "its decision before the optimizer steps, so this monitor blocks as with blocking=True. Pass optimizer= "
         "a gradfuse.optim optimizer (gradfuse.optim.from_torch(optimizer) adopts a torch SGD / Adam / AdamW), or "
         "torch's Adam / AdamW with fused=True, or set the policies to 'warn' / 'ignore'")
    return None


def device_skip_flag(flags: torch.Tensor | None, monitor, *, bad_max_norm: bool) -> torch.Tensor | None:
    """The step's skip as a 0-d bool on the device (a policy that skips or raises fired), or None
    when nothing can skip it."""
    bits = skip_bits(monitor.on_nonfinite, monitor.on_explode, monitor.on_spike,
                     amp_active=monitor.scaler is not None and monitor.scaler.is_enabled())
    flag = None if flags is None or not bits else (flags & bits) != 0
    if bad_max_norm and monitor.on_nonfinite == "skip":  # the host knows this one already
        flag = torch.ones((), dtype=torch.bool) if flag is None else torch.ones_like(flag)
    return flag


@dataclass
class Pending:
    """A ``blocking=False`` step the host has not acted on yet: what it needs of the step, as
    host copies started at the step (``start``) and read at the next (``read``)."""

    plan: object  # the step's StepPlan
    report: object  # its StepReport, filled in when settled
    capture: object  # its ActivationCapture, or None
    snapshot: object  # the flight recorder's RecorderSnapshot, or None
    copy: HostCopy  # the flag, the clipped bit and the logged max_norm
    flags: int = 0  # read: the anomaly flags
    clipped: int = 0  # read: 1 when the clip scaled the gradients
    max_norm: float | None = None  # read: the max_norm the record logs

    @classmethod
    def start(cls, plan, report, capture, flags, clipped, snapshot, max_norm_now, *, copy_stats: bool,
              headroom_of=None) -> Pending:
        """Starts the host copies of a step (``copy_stats``: the statistics too, which the
        message of an anomaly and the record read;
        ``headroom_of``: the monitor's source, whose exponent histograms a logging step takes now,
        as the optimizer gets the gradients: when its record is written they are gone)."""
        if copy_stats:
            report.stats.start_host_copy()
        if capture is not None:  # the activation rows and the NaN trace: read when the step settles
            capture.start_host_copy()
        if headroom_of is not None:
            report.headroom = HeadroomTake(headroom_of if plan.log_now else None)
        logged = report.stats.max_norm if report.stats.max_norm is not None else max_norm_now
        logged = getattr(logged, "last_threshold", logged)  # a ZClip: its threshold of the step
        report.settled = False
        return cls(plan, report, capture, snapshot, HostCopy([flags, clipped, logged if isinstance(
            logged, torch.Tensor) else None]), max_norm=None if isinstance(logged, torch.Tensor) else logged)

    def rows_taken(self, step_rows, dynamics, skip, commit) -> None:
        """After the ``gradfuse.optim`` step whose rows are the step's update statistics (None:
        it did not step): they go to ``dynamics``, then the flight recorder's row is written
        (``commit`` returns its snapshot)."""
        dynamics.take_deferred_rows(self.report, step_rows, skip)
        self.snapshot = commit()

    def settled(self, dynamics) -> None:
        """Once the policies have decided the step: tells what counted it on the host before its
        skip was known (a ZClip's ``steps``, the monitor's ``dynamics``) whether it was skipped."""
        if isinstance(self.plan.max_norm, ZClip):
            self.plan.max_norm.settle(self.report.skip)
        if dynamics is not None:
            dynamics.settle(self.report)

    def read(self):
        """Reads the copies (on CUDA, waits for their event: by the next step it has passed);
        returns the step's report."""
        flags, clipped, threshold = self.copy.get()
        self.flags = 0 if flags is None else int(flags.item())
        self.clipped = 0 if clipped is None else int(clipped.item())
        if threshold is not None:
            self.max_norm = float(threshold.item())
        return self.report
