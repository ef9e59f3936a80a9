"""Copies of device values to host memory that nobody waits for: what a step hands the host to
read one step later.

On CUDA the copies go into pinned buffers on the current stream, with an event recorded after
them; by the time the host reads them (the next step) the event has long passed, so the read does
not wait for the work queued since. On the CPU the copy is a copy (nothing waits there either);
reading it is still a read of the copy, not of the step's tensors, which is what
``is_host_copy`` lets a test tell apart.

Layer: core. Imports torch only.
"""
from __future__ import annotations

import torch

_MARK = "_gradfuse_host_copy"


class HostCopy:
    """Host copies of ``tensors`` (device tensors, or None), started now, read with ``get``.

    Args:
        tensors: The tensors to copy (each detached; None entries stay None).

    Example:
        ```python
        copy = HostCopy([flag, total_norm])   # no wait
        ...                                   # the next step
        flag_host, norm_host = copy.get()     # host tensors
        ```
    """

    def __init__(self, tensors):
        self._event = None
        self._copies = []
        for t in tensors:
            if t is None:
                self._copies.append(None)
                continue
            t = t.detach()
            if t.device.type == "cuda":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
            else:
                host = t.to("cpu", copy=True)
            setattr(host, _MARK, True)
            self._copies.append(host)
        if any(t is not None and t.device.type == "cuda" for t in tensors):
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        """Whether the copies have arrived (always on the CPU)."""
        return self._event is None or self._event.query()

    def get(self) -> list:
        """The host tensors, in the order given (waits for the copies' event on CUDA: by the
        next step it has passed)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._copies


def is_host_copy(t) -> bool:
    """Whether ``t`` is host memory made to be read without waiting for a device: a
    ``HostCopy``'s tensor, or the values ``read_host_resident`` reads."""
    return bool(getattr(t, _MARK, False))


def read_host_resident(tensors: list[torch.Tensor]) -> list[float]:
    """The values of tensors the host keeps (an optimizer's step counters, which torch keeps on
    the CPU unless ``capturable`` or ``fused``), as floats, in one read: of host memory, which
    waits for no device (``is_host_copy`` says so of it). Counters found on a device (a state
    saved by a ``fused=True`` optimizer) are read from there, which waits."""
    try:  # the usual case, one op: one-element counters of one shape on one device
        values = torch.stack(tensors).reshape(-1)
    except RuntimeError:
        values = None
    if values is None or values.numel() != len(tensors):
        values = torch.stack([t.reshape(()).to("cpu", torch.float64) for t in tensors])
    if values.device.type == "cpu" and all(t.device.type == "cpu" for t in tensors):
        setattr(values, _MARK, True)
    return values.tolist()
