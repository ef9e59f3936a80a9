"""A guard against host synchronisation, usable on the CPU: ``gradfuse.HostReads`` (the reads
that on a GPU would wait for the device: ``.item()`` and what dispatches like it, ``aten.equal``,
``aten.is_nonzero``, ``Tensor.tolist`` / ``.numpy()``), raising at the first one beyond
``allowed``.

    with SyncGuard() as guard:         # raises HostSync at the first read
        gradfuse.stats(model)
    with SyncGuard(allowed=None) as g:  # counts only: g.reads
        ...

Under a dispatch mode the C++ fast paths of gradfuse step aside (the functional path runs), so
what is checked is the path every op of which the mode sees: ``guard.seen`` holds the ops, and a
test should check that gradfuse's own ops are among them.

With ``host_copies=True`` a read of host memory that a step copied without blocking (a
``gradfuse.core.host_copy.HostCopy``, or any tensor computed from such copies and Python values
alone) is counted in ``copy_reads`` instead: on a GPU it waits for nothing. Without it every read
is one of ``reads``. ``reads_from(gradfuse)`` keeps the reads gradfuse's own code asked for."""
import contextlib

import torch

from gradfuse.core.host_reads import HostReads


class HostSync(AssertionError):
    pass


class SyncGuard(HostReads):
    def __init__(self, allowed: int | None = 0, host_copies: bool = False):
        super().__init__()
        self.allowed = allowed
        self.host_copies = host_copies
        self.seen: list[str] = []

    def _host(self, t) -> bool:
        return self.host_copies and super()._host(t)

    def _read(self, what: str, t=None) -> None:
        super()._read(what, t)
        if self.allowed is not None and len(self.reads) > self.allowed:
            raise HostSync(f"host read: {what} (reads so far: {self.reads})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def saw_gradfuse_op(self) -> bool:
        return any(name.startswith("gradfuse.") for name in self.seen)


@contextlib.contextmanager
def as_on_an_accelerator():
    """Every tensor answers ``is_cpu`` False: the one question the activation hooks ask to choose
    their CPU shortcuts (small reads of CPU values, no device sync there) over the path an
    accelerator takes, which must read nothing."""
    assert "is_cpu" not in torch.Tensor.__dict__
    torch.Tensor.is_cpu = property(lambda self: False)
    try:
        yield
    finally:
        del torch.Tensor.is_cpu
