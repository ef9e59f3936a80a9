"""A guard against host synchronisation, usable on the CPU: the ops that copy a device value to
the host (``aten._local_scalar_dense``, what ``.item()``, ``bool(t)``, ``int(t)`` and
``float(t)`` dispatch to; ``aten.equal``; ``aten.is_nonzero``) seen by a TorchDispatchMode, and
``Tensor.tolist`` / ``.numpy()``, which read CPU memory without dispatching. On a GPU each of
them would wait for the device.

    with SyncGuard() as guard:         # raises HostSync at the first read
        gradfuse.stats(model)
    with SyncGuard(allowed=None) as g:  # counts only: g.reads
        ...

Under a dispatch mode the C++ list-walk fast paths of gradfuse step aside (the functional path
runs), so what is checked is the path every op of which the mode sees: ``guard.seen`` holds the
ops, and a test should check that gradfuse's own ops are among them.

With ``host_copies=True`` a read of host memory that a step copied without blocking (a
``gradfuse.core.host_copy.HostCopy``, or any tensor computed from such copies and Python values
alone) is counted
in ``copy_reads`` instead: on a GPU it waits for nothing. Everything else stays a read of the
step's tensors."""
import contextlib
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gradfuse.core.host_copy import is_host_copy

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
UNDISPATCHED_READS = ("tolist", "numpy")
FROM_PYTHON = {aten.lift_fresh.default, aten.lift_fresh_copy.default}  # torch.tensor(python values)


def _asker() -> str:
    # The file of the innermost frame that is neither torch's nor this guard's.
    torch_root = os.path.dirname(torch.__file__) + os.sep
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(torch_root)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


class HostSync(AssertionError):
    pass


class SyncGuard(TorchDispatchMode):
    def __init__(self, allowed: int | None = 0, host_copies: bool = False):
        super().__init__()
        self.allowed = allowed
        self.host_copies = host_copies
        self.copy_reads: list[str] = []
        self._derived: dict[int, weakref.ref] = {}  # id -> tensor computed from host copies alone
        self.reads: list[str] = []
        self.read_sites: list[str] = []  # per read: the file of the code that asked for it
        self.seen: list[str] = []
        self._patched = []

    def _host(self, t) -> bool:
        ref = self._derived.get(id(t))
        return is_host_copy(t) or (ref is not None and ref() is t)

    def _read(self, what: str, t=None) -> None:
        if self.host_copies and isinstance(t, torch.Tensor) and self._host(t):
            self.copy_reads.append(what)
            return
        self.reads.append(what)
        self.read_sites.append(_asker())
        if self.allowed is not None and len(self.reads) > self.allowed:
            raise HostSync(f"host read: {what} (reads so far: {self.reads})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if func in SYNC_OPS:
            self._read(str(func), inputs[0] if inputs else None)
        out = func(*args, **(kwargs or {}))
        if self.host_copies:  # computed from host copies alone (or Python values): host memory too
            host = func in FROM_PYTHON or all(self._host(a) for a in inputs)
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    if host:
                        self._derived[id(o)] = weakref.ref(o)
                    else:
                        self._derived.pop(id(o), None)
        return out

    def __enter__(self):
        for name in UNDISPATCHED_READS:
            real = getattr(torch.Tensor, name)
            own = name in torch.Tensor.__dict__

            def read(t, *a, _real=real, _name=name, **k):
                self._read(f"Tensor.{_name}", t)
                return _real(t, *a, **k)
            setattr(torch.Tensor, name, read)
            self._patched.append((name, real, own))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, real, own in reversed(self._patched):
                if own:
                    setattr(torch.Tensor, name, real)
                else:
                    delattr(torch.Tensor, name)
            self._patched.clear()

    def reads_from(self, package) -> list[str]:
        """The reads that code of ``package`` (a module) asked for itself: the innermost caller
        outside torch is one of its files (not a framework's code that gradfuse called back)."""
        root = os.path.dirname(package.__file__) + os.sep
        return [what for what, site in zip(self.reads, self.read_sites) if site.startswith(root)]

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
