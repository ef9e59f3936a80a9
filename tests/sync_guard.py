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
ops, and a test should check that gradfuse's own ops are among them."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
UNDISPATCHED_READS = ("tolist", "numpy")


class HostSync(AssertionError):
    pass


class SyncGuard(TorchDispatchMode):
    def __init__(self, allowed: int | None = 0):
        super().__init__()
        self.allowed = allowed
        self.reads: list[str] = []
        self.seen: list[str] = []
        self._patched = []

    def _read(self, what: str) -> None:
        self.reads.append(what)
        if self.allowed is not None and len(self.reads) > self.allowed:
            raise HostSync(f"host read: {what} (reads so far: {self.reads})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        if func in SYNC_OPS:
            self._read(str(func))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in UNDISPATCHED_READS:
            real = getattr(torch.Tensor, name)
            own = name in torch.Tensor.__dict__

            def read(t, *a, _real=real, _name=name, **k):
                self._read(f"Tensor.{_name}")
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

    def saw_gradfuse_op(self) -> bool:
        return any(name.startswith("gradfuse.") for name in self.seen)
