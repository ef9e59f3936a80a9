"""The optimizer's step itself as the one pass: ``gradfuse.optim.SGD``, ``Adam`` and ``AdamW`` are
torch's optimizers whose ``step()`` runs one fused multi-tensor pass per (device, dtype) that reads
weight, gradient and state once and writes them once, bit for bit as torch's own step, with
optional extras inside the same pass (a gradient scale, a skip flag, update clipping, the
update's statistics). ``from_torch`` adopts an existing torch optimizer.

Layer: optim (a capability beside clip, numerics, activations and dynamics). Imports
``gradfuse.ops`` and ``gradfuse.core``.
"""
from gradfuse.optim.fused import StepCoefs, StepRows
from gradfuse.optim.optimizers import SGD, Adam, AdamW, FusedStep, from_torch

__all__ = ["SGD", "Adam", "AdamW", "FusedStep", "StepCoefs", "StepRows", "from_torch"]
