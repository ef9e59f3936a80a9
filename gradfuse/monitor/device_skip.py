"""A monitor's skip applied on the device: the decision of a step (a 0-d bool on the gradients'
device) handed to the optimizer's own step, so that the host never reads it before the step;
and with ``GradMonitor(fused_step=True)`` the clip coefficient, handed to a ``gradfuse.optim``
step as its ``grad_scale`` (the clip then costs no pass of its own), and ``max_update_rms``,
handed to that step as its own (the update clipping then costs no pass after the step).

Which optimizers take it (``device_skip_kind``):

- ``gradfuse.optim.SGD`` / ``Adam`` / ``AdamW``: the ``skip`` argument of its fused pass; no host
  read (its step counters, kept on the host, are set back one step later from a host copy);
- torch's ``Adam`` / ``AdamW`` with ``fused=True``, and ``SGD`` with ``fused=True`` and no
  momentum: ``found_inf``, as a ``GradScaler`` hands it (combined with the scaler's own); no host
  read on CUDA (torch's CPU kernels read it on the CPU, where nothing waits);
- an object with ``takes_found_inf = True`` and torch's step hooks (DeepSpeed's
  ``OverflowPlant``): ``found_inf`` alike, which its step plants for the engine's overflow check;
- any other optimizer: none; the monitor reads its decision before the step.

Torch's fused SGD with momentum is not among them: a skipped first step would leave its
momentum buffers unwritten, and its next step would read them as made.

Layer: monitor. Imports ``gradfuse.optim``.
"""
from __future__ import annotations

import torch

from gradfuse.optim import FusedStep
from gradfuse.optim.fused import check_max_update_rms


def device_skip_kind(optimizer) -> str | None:
    """``"gradfuse.optim"``, ``"torch fused"``, ``"found_inf"`` or None: how ``optimizer``'s step
    takes a skip flag on the device (see the module's table)."""
    if isinstance(optimizer, FusedStep):
        return "gradfuse.optim"
    if getattr(optimizer, "takes_found_inf", False) is True:
        return "found_inf"
    groups = getattr(optimizer, "param_groups", None)
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD) and groups and all(
            g.get("fused") for g in groups):
        if type(optimizer) is torch.optim.SGD and any(g.get("momentum", 0) for g in groups):
            return None
        return "torch fused"
    return None


class StepHandoff:
    """Step pre- and post-hooks on ``optimizers`` that hand each one's next step the flag (and
    the gradient scale) of ``arm``: each optimizer takes them once; the next ``arm`` gives the next
    round's.

    Args:
        optimizers: Optimizers of which ``device_skip_kind`` is not None.
        update_clip: A ``gradfuse.UpdateClip`` made with ``hooks=False``, or None: every step of a
            ``gradfuse.optim`` optimizer among ``optimizers`` gets its ``max_rms`` as
            ``max_update_rms`` (the smaller, when the caller passes one too), and the
            coefficients the step reports (``last_update_coefs``) are counted by it.
    """

    def __init__(self, optimizers, update_clip=None):
        self.optimizers = list(optimizers)
        self._update_clip = update_clip
        self._flag: torch.Tensor | None = None
        self._grad_scale: torch.Tensor | None = None
        self._after = None  # called with the step's rows (optimizer.last_rows) once it stepped
        self._taken: set[int] = set()
        self._found_inf: dict[int, object] = {}  # what found_inf was before this hook set it
        self._handles = []
        for opt in self.optimizers:
            self._handles += [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]

    def arm(self, flag: torch.Tensor | None, grad_scale: torch.Tensor | None = None) -> None:
        """The flag of the coming round of steps (a 0-d bool on the device; None: none), and the
        gradient scale its ``gradfuse.optim`` steps apply as they read the gradients (0-d, or
        one per parameter of the optimizer; None: none)."""
        self._flag, self._grad_scale, self._taken = flag, grad_scale, set()

    def after_step(self, callback) -> None:
        """The coming ``gradfuse.optim`` step also takes its update statistics (``stats=True``),
        and ``callback(optimizer.last_rows)`` runs once it has stepped (``finish`` runs it with
        None if it does not)."""
        self._after = callback

    def finish(self) -> None:
        """Runs a callback of ``after_step`` whose step never came, with None; and settles each
        ``gradfuse.optim`` optimizer's latest skip (``settle_skip``, from its host copy), so that
        what plans the coming update (the update statistics, ``max_update_rms``) reads the step
        counters of a run that did not take a skipped step."""
        callback, self._after = self._after, None
        if callback is not None:
            callback(None)
        for opt in self.optimizers:
            if isinstance(opt, FusedStep):
                opt.settle_skip()

    def _pre(self, optimizer, args, kwargs):
        flag, scale = self._flag, self._grad_scale
        fused = isinstance(optimizer, FusedStep)
        limit = self._update_clip.max_rms if self._update_clip is not None and fused else None
        armed = not (flag is None and scale is None and self._after is None) and id(optimizer) not in self._taken
        if not armed and limit is None:
            return None
        if fused:
            kwargs = dict(kwargs)
            if limit is not None:  # every step, as the hooks of an UpdateClip would clip it
                given = kwargs.get("max_update_rms")
                kwargs["max_update_rms"] = limit if given is None else min(limit, check_max_update_rms(
                    f"gradfuse.optim.{type(optimizer).__name__}", given))
            if not armed:
                return args, kwargs
            self._taken.add(id(optimizer))
            if flag is not None:
                given = kwargs.get("skip")
                kwargs["skip"] = flag if given is None else flag | given.to(flag.device).reshape(()).bool()
            if scale is not None:
                given = kwargs.get("grad_scale")
                kwargs["grad_scale"] = scale if given is None else scale * given.to(scale.device)
            if self._after is not None:
                kwargs["stats"] = True
            return args, kwargs
        self._taken.add(id(optimizer))
        if flag is None:
            return None
        found = optimizer.__dict__.get("found_inf")  # a GradScaler's, when it steps the optimizer
        self._found_inf[id(optimizer)] = found
        mine = flag.to(torch.float32)
        optimizer.found_inf = mine if found is None else torch.maximum(found, mine.to(found.device))
        return None

    def _post(self, optimizer, args, kwargs) -> None:
        if self._update_clip is not None and isinstance(optimizer, FusedStep):  # before the record reads them
            got = optimizer.last_update_coefs
            coefs = (torch.cat([c.coefs.to(got[0].coefs.device) for c in got]) if got
                     else torch.zeros(0, dtype=torch.float64))
            if self._flag is not None:  # a step skipped on the device rescaled nothing
                coefs = torch.where(self._flag.to(coefs.device), 1.0, coefs)
            self._update_clip.count(coefs, [p for c in got for p in c.params])
        if self._after is not None and isinstance(optimizer, FusedStep):
            callback, self._after = self._after, None
            callback(optimizer.last_rows)
        if id(optimizer) not in self._found_inf:
            return
        found = self._found_inf.pop(id(optimizer))
        if found is None:
            optimizer.__dict__.pop("found_inf", None)
        else:
            optimizer.found_inf = found

    def remove(self) -> None:
        """Removes the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
