"""A skip decided on the device, handed to DeepSpeed ZeRO (stages 1 to 3) as DeepSpeed's own
overflow step, with no host read of gradfuse's: ``OverflowPlant`` is the optimizer a
``blocking=False`` monitor on the engine is given.

The monitor's step hooks hand it the step's skip flag as ``found_inf`` (as they hand it to torch's
fused Adam); around DeepSpeed's step it writes one element of a gradient fragment as
``where(flag, NaN, value)`` and puts the value back after the step. DeepSpeed's overflow check,
reduced over the ranks, sees the NaN of a skipped step on every rank and skips it its own way
(``engine.skipped_steps``, the LR scheduler held); a step not skipped reads its gradients as they
were. Nothing of gradfuse's stays in the buffers DeepSpeed keeps across steps, and no fill pass
runs over the gradients.

Layer: integrations. Imports torch only.
"""
from __future__ import annotations

import collections

import torch
from torch.utils.hooks import RemovableHandle


class OverflowPlant:
    """Takes a step's device skip flag as ``found_inf`` and plants it, for DeepSpeed's overflow
    check, around the engine optimizer's step.

    Args:
        plant: ``plant(flag)`` sets one element of this rank's gradient fragments to NaN where the
            0-d ``flag`` is nonzero (on the device) and returns ``(element, value)`` to put back
            after the step, or None where the rank holds no element.
    """

    takes_found_inf = True  # device_skip_kind: the monitor's step hooks hand it found_inf
    found_inf: torch.Tensor | None = None  # set by those hooks for one step

    def __init__(self, plant):
        self._plant = plant
        self._pre_hooks: collections.OrderedDict = collections.OrderedDict()
        self._post_hooks: collections.OrderedDict = collections.OrderedDict()

    def register_step_pre_hook(self, hook) -> RemovableHandle:
        """``hook(plant, args, kwargs)`` before each step, as ``torch.optim.Optimizer``'s."""
        handle = RemovableHandle(self._pre_hooks)
        self._pre_hooks[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook) -> RemovableHandle:
        """``hook(plant, args, kwargs)`` after each step, as ``torch.optim.Optimizer``'s."""
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = hook
        return handle

    def step(self, inner, *args, **kwargs):
        """Runs DeepSpeed's step ``inner(*args, **kwargs)`` with the monitor's flag planted for
        its overflow check; returns what it returns."""
        for hook in list(self._pre_hooks.values()):
            hook(self, args, kwargs)
        planted = None if self.found_inf is None else self._plant(self.found_inf)
        try:
            return inner(*args, **kwargs)
        finally:
            if planted is not None:
                element, value = planted
                element.copy_(value)
            for hook in list(self._post_hooks.values()):
                hook(self, args, kwargs)
