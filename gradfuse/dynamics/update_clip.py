"""Update clipping: each parameter's update limited to an RMS of ``max_rms``, by Adafactor's rule
``w = w_before + c * u`` with ``c = min(1, max_rms / rms(u))``, ``u`` the update the optimizer's
step applies (the rule of Adafactor's update clipping, and of the per-parameter update clipping
OLMo and Marin use against loss spikes).

No host read and no copy of the weights: before the step the fused update op gives ``rms(u)`` per
parameter (``gradfuse.dynamics.update_plan``), ``c`` is computed on the device; after the step
``gradfuse.ops.multi_tensor_update_clip_`` rescales the update just applied, forming
``w_before`` again from the weight, the gradient and the state the step left. A parameter whose
``c`` is not below 1 is not touched. Cost: the pre-step pass (shared with the update statistics
when those are taken) and, after the step, one more pass over the weights, gradients and
optimizer state of each group (a parameter not clipped is left alone: the op does not write it).

The optimizer's step hooks (``register_step_pre_hook`` / ``register_step_post_hook``) carry it:
it works with any loop that calls ``optimizer.step()``, including ``GradScaler.step`` (a step the
scaler skips runs no hook) and ``gradfuse.attach``. A ``gradfuse.optim`` step applies the same
rule inside its own pass (``step(max_update_rms=...)``); ``GradMonitor(fused_step=True)`` hands
it the limit, and an ``UpdateClip`` made with ``hooks=False`` then only counts the coefficients
that step reports (``count``).

Layer: dynamics. Imports ``gradfuse.dynamics.update_plan``.
"""
from __future__ import annotations

import math

import torch

from gradfuse.core.norms import rms_limit_coefficient
from gradfuse.dynamics.update_plan import UpdateRows, clip_applied_updates_, plan_updates, unavailable_reason
from gradfuse.ops.layout import UPDATE_NUMEL, UPDATE_SUMSQ


def update_coefs(rows: UpdateRows, max_rms: float) -> torch.Tensor:
    """``min(1, max_rms / rms(u))`` per row of ``rows`` (float64, on the rows' device; NaN for
    an update that is not finite or an empty parameter: such a parameter is left alone)."""
    return rms_limit_coefficient(rows.floats[:, UPDATE_SUMSQ], rows.counts[:, UPDATE_NUMEL], max_rms)


class UpdateClip:
    """Limits the RMS of each parameter's update by ``optimizers`` to ``max_rms`` (module docstring).

    Made by ``gradfuse.clip_update_rms`` (plain loops) or ``GradMonitor(max_update_rms=...)``.
    The pre-step hook plans the update of the optimizer about to step (unless ``prepare`` was
    given this step's rows already: the monitor's pass), the post-step hook rescales it.

    Args:
        optimizers: The optimizers (SGD, Adam, AdamW and subclasses).
        max_rms: The largest RMS an update may have, > 0.
        hooks: False: no step hooks; the optimizers' own step applies the limit (a
            ``gradfuse.optim`` step given ``max_update_rms``), and whoever hands it the limit
            passes each step's coefficients to ``count``.

    Attributes:
        max_rms (float): The limit.
        clipped (torch.Tensor): int64 0-d on the device: parameter updates rescaled so far
            (reading it syncs).
        clipped_steps (torch.Tensor): int64 0-d on the device: optimizer steps that rescaled at
            least one parameter's update.
        last_coefs (torch.Tensor | None): The coefficients of the latest step, per planned
            parameter (``last_params``); 1 where nothing was rescaled.
        last_params (list): The parameters of ``last_coefs``.

    Raises:
        ValueError: ``max_rms`` not > 0.
        NotImplementedError: an optimizer whose update gradfuse does not know.
    """

    def __init__(self, optimizers, max_rms: float, hooks: bool = True):
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        self.optimizers = list(optimizers)
        if not (isinstance(max_rms, (int, float)) and not isinstance(max_rms, bool) and max_rms > 0
                and math.isfinite(max_rms)):
            raise ValueError(f"gradfuse: max_update_rms must be a finite number > 0, got {max_rms!r}")
        for opt in self.optimizers:
            reason = unavailable_reason(opt)
            if reason:
                raise NotImplementedError(reason.replace("update ratios are", "update clipping is"))
        self.max_rms = float(max_rms)
        self.clipped = None
        self.clipped_steps = None
        self.last_coefs: torch.Tensor | None = None
        self.last_params: list = []
        self._prepared: dict[int, tuple[UpdateRows, torch.Tensor]] = {}
        self._taken: dict[int, tuple[UpdateRows, torch.Tensor]] = {}
        self._handles = []
        for opt in self.optimizers if hooks else ():
            self._handles.append(opt.register_step_pre_hook(self._pre_step))
            self._handles.append(opt.register_step_post_hook(self._post_step))

    def coefs(self, rows: UpdateRows) -> torch.Tensor:
        """The coefficients of ``rows`` (``update_coefs``)."""
        return update_coefs(rows, self.max_rms)

    def prepare(self, rows: UpdateRows, coefs: torch.Tensor | None = None) -> torch.Tensor:
        """Hands the coming step the rows already planned (so the pre-step hook plans nothing);
        returns their coefficients. Rows of an optimizer that then does not step are dropped at
        the next ``prepare``."""
        coefs = self.coefs(rows) if coefs is None else coefs
        self._prepared = {id(opt): (rows, coefs) for opt in self.optimizers}
        self.count(coefs, rows.params)
        return coefs

    def cancel(self) -> None:
        """Drops the rows ``prepare`` handed over (the optimizer will not step this time)."""
        self._prepared.clear()

    def count(self, coefs: torch.Tensor, params: list) -> None:
        """Counts a step whose coefficients are ``coefs`` (of ``params``; below 1: rescaled) on
        the device, no host read, and keeps them as ``last_coefs`` / ``last_params``."""
        n = (coefs < 1).sum()
        step = (n > 0).to(torch.int64)
        self.clipped = n if self.clipped is None else self.clipped + n.to(self.clipped.device)
        self.clipped_steps = step if self.clipped_steps is None else self.clipped_steps + step.to(
            self.clipped_steps.device)
        self.last_coefs, self.last_params = coefs, params

    def _pre_step(self, optimizer, args, kwargs) -> None:
        got = self._prepared.pop(id(optimizer), None)
        if got is None:
            with torch.no_grad():
                rows = plan_updates([optimizer])
                coefs = self.coefs(rows)
            self.count(coefs, rows.params)
            got = (rows, coefs)
        self._taken[id(optimizer)] = got

    def _post_step(self, optimizer, args, kwargs) -> None:
        got = self._taken.pop(id(optimizer), None)
        if got is not None:
            clip_applied_updates_(got[0], got[1], optimizer)

    def counts(self) -> dict[str, int]:
        """``{"update_clipped_params": parameter updates rescaled, "update_clipped_steps": steps with
        one}`` so far, as ints (reads the device counters: one sync)."""
        if self.clipped is None:
            return {"update_clipped_params": 0, "update_clipped_steps": 0}
        n, s = torch.stack([self.clipped.cpu(), self.clipped_steps.cpu()]).tolist()
        return {"update_clipped_params": int(n), "update_clipped_steps": int(s)}

    def remove(self) -> None:
        """Removes the optimizer hooks: later steps are not clipped."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._prepared.clear()
        self._taken.clear()


def clip_update_rms(optimizer, max_rms: float) -> UpdateClip:
    """Limits every later ``optimizer.step()`` so that each parameter's update has an RMS of at
    most ``max_rms``: ``w = w_before + min(1, max_rms / rms(u)) * u`` (Adafactor's update
    clipping), with no host read and no copy of the weights.

    For plain loops; ``GradMonitor(max_update_rms=...)`` and ``gradfuse.attach`` do the same
    and log it. Cost: one fused pass over the weights, the gradients and the optimizer state
    before each step, and one more after it (see ``gradfuse.dynamics.update_clip``).

    Args:
        optimizer: A ``torch.optim.SGD``, ``Adam`` or ``AdamW`` (or a subclass), or a list of them.
        max_rms: The largest RMS of one parameter's update, > 0.

    Returns:
        The ``UpdateClip``: its counters (``counts()``), ``last_coefs``, and ``remove()``.

    Raises:
        ValueError: ``max_rms`` not > 0.
        NotImplementedError: another optimizer.

    Example:
        ```python
        limit = gradfuse.clip_update_rms(optimizer, max_rms=1e-3)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step()          # each parameter's update limited to RMS 1e-3
            optimizer.zero_grad()
        print(limit.counts())
        ```
    """
    return UpdateClip(optimizer, max_rms)
