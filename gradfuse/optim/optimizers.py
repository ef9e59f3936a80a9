"""``gradfuse.optim.SGD``, ``Adam`` and ``AdamW``: torch's optimizers with the step in one fused
pass (``gradfuse.optim.fused``), and ``from_torch`` to adopt an existing torch optimizer.

Layer: optim. Imports ``gradfuse.optim.fused``.
"""
from __future__ import annotations

import functools
import weakref

import torch

from gradfuse.optim.fused import (
    StepCoefs,
    StepRows,
    check_max_update_rms,
    fused_step,
    refuse_unsupported,
    settle_skip,
    with_amp_scaling,
)


class FusedStep:
    """What the three optimizers add to torch's: ``step`` as one fused pass per (device, dtype),
    with optional extras inside it. Mixed in before the torch class, so ``isinstance``, the LR
    schedulers, ``param_groups``, ``add_param_group``, the step hooks, ``zero_grad`` and
    ``state_dict`` are torch's own. A ``GradScaler`` hands the step its scale and its found-Inf
    flag, as it does torch's fused Adam (``_step_supports_amp_scaling``): ``scaler.step(optimizer)``
    then unscales inside the step and skips an overflow on the device, with no host read."""

    _step_supports_amp_scaling = True

    @property
    def last_rows(self) -> list[StepRows]:
        """The update-statistics rows of the latest ``step(stats=True)``, one entry per (sharding
        layout, device, dtype) group (``gradfuse.optim.StepRows``; a DTensor parameter's rows are
        those of the whole tensor); empty before any step, after a step without statistics, and in
        a copy (``state_dict``, pickle and deepcopy carry torch's state only)."""
        return self.__dict__.get("_step_rows", [])

    @property
    def last_update_coefs(self) -> list[StepCoefs]:
        """The update-clipping coefficients of the latest ``step(max_update_rms=...)``, one entry
        per (sharding layout, device, dtype) group (``gradfuse.optim.StepCoefs``, on the device:
        a parameter whose coefficient is below 1 had its update rescaled); empty before any step,
        after a step without ``max_update_rms``, and in a copy."""
        return self.__dict__.get("_step_coefs", [])

    def add_param_group(self, param_group: dict) -> None:
        """Torch's ``add_param_group``, then the fused step's checks of the new group (a refused
        group is not added)."""
        super().add_param_group(param_group)
        try:
            refuse_unsupported(self, self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def settle_skip(self) -> None:
        """Brings the host's side up to date with the ``skip`` flag of the latest step: a step
        the flag skipped leaves the step counters where they were and makes no state. The flag is
        read from a host copy made at that step without blocking (on a GPU, by the next step it
        has arrived); until then ``state`` shows the counters advanced. ``step`` and
        ``state_dict`` call it first; call it before reading ``state`` yourself."""
        settle_skip(self)

    def state_dict(self) -> dict:
        """Torch's ``state_dict``, after ``settle_skip``."""
        settle_skip(self)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Torch's ``load_state_dict``, refusing what the fused step does not do (as the
        constructor). A state dict of torch's ``fused=True`` optimizer loads: its groups then say
        ``fused=None``, since this optimizer steps with its own fused pass."""
        for group in state_dict["param_groups"]:
            refuse_unsupported(self, {**group, "fused": None, "params": []})
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if group.get("fused"):
                group["fused"] = None

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None,
             max_update_rms: float | None = None, stats: bool = False):
        """Performs a single optimization step: torch's, bit for bit, in one pass over weight,
        gradient and state per (device, dtype) group.

        Args:
            closure (Callable, optional): Re-evaluates the model and returns the loss.
            grad_scale (torch.Tensor, optional): One element: every gradient is multiplied by it as
                it is read (rounded to the gradient's dtype, as ``p.grad.mul_(grad_scale)`` before
                the step would round it). ``p.grad`` itself keeps its value. Or float64 ``[N]``,
                one scale per parameter in ``param_groups`` order (a per-layer clip's
                coefficients), each gradient times its own.
            skip (torch.Tensor, optional): One element, read on the device only; nonzero: the step
                is not taken: weights and state are not written, and the step counters (kept on
                the host, as torch keeps them) and a first step's state are set back when the
                host reads the flag's copy, at the next ``step`` or ``state_dict`` (see
                ``settle_skip``).
            max_update_rms (float, optional): Each parameter's update limited to this RMS
                (``w = w_before + min(1, max_update_rms / rms(u)) * u``); costs a first read-only
                pass, since a tensor's coefficient needs its whole update (a DTensor's: over all
                its shards, one all-reduce of the rows per sharded mesh dimension). The
                coefficients: ``last_update_coefs``.
            stats (bool): Also compute the update-statistics rows (``last_rows``) in the same pass
                (a DTensor's summed over its shards, as for the coefficients).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, skip = with_amp_scaling(self, grad_scale, skip)
        limit = check_max_update_rms(f"gradfuse.optim.{type(self).__name__}", max_update_rms)
        self._step_rows, self._step_coefs = fused_step(self, grad_scale=grad_scale, skip=skip,
                                                       max_update_rms=limit, stats=stats)
        return loss


class SGD(FusedStep, torch.optim.SGD):
    """``torch.optim.SGD`` with its step fused (``FusedStep``); same arguments, state and
    results."""


class Adam(FusedStep, torch.optim.Adam):
    """``torch.optim.Adam`` with its step fused (``FusedStep``); same arguments, state and
    results."""


class AdamW(FusedStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` with its step fused (``FusedStep``); same arguments, state and
    results."""


_FUSED = {torch.optim.SGD: SGD, torch.optim.Adam: Adam, torch.optim.AdamW: AdamW}


def from_torch(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Makes an existing ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` step in one fused pass, in
    place: the same object (its param groups, state, hooks and any scheduler attached stay),
    now an instance of the ``gradfuse.optim`` class. Returns it.

    Raises:
        TypeError: ``optimizer`` is not exactly one of the three torch classes.
        ValueError: its ``step`` is wrapped by something other than an LR scheduler.
        ValueError: a setting the fused step does not take (``differentiable``, ``fused``,
            ``capturable``, complex parameters), named.
    """
    if isinstance(optimizer, FusedStep):
        return optimizer
    fused = _FUSED.get(type(optimizer))
    if fused is None:
        raise TypeError(f"gradfuse.optim.from_torch takes a torch.optim.SGD, Adam or AdamW, got "
                        f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
    for group in optimizer.param_groups:
        refuse_unsupported(fused.__new__(fused), group)
    wrapped = optimizer.__dict__.get("step")  # an instance-level wrapper of the torch class's step
    if wrapped is not None and not getattr(wrapped, "_wrapped_by_lr_sched", False):
        raise ValueError("gradfuse.optim.from_torch: the optimizer's step is wrapped by something other than an "
                         "LR scheduler; adopt the optimizer before wrapping its step")
    optimizer.__class__ = fused
    optimizer._patch_step_function()  # torch's step hooks, on the fused class's step
    if wrapped is not None:
        optimizer.step = _scheduler_wrapper(optimizer)
    return optimizer


def _scheduler_wrapper(optimizer):
    """An LR scheduler's wrapper of ``step`` (torch.optim.lr_scheduler's ``patch_track_step_called``:
    marks ``_opt_called``), now of the fused class's step."""
    opt_ref = weakref.ref(optimizer)
    func = type(optimizer).step

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        opt = opt_ref()
        opt._opt_called = True
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    return wrapper
