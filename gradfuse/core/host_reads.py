"""Counting the host's reads of tensor values, on any machine: what would make the host wait for
an accelerator, found on the CPU before a GPU is rented.

A read is an op that copies a tensor's value to the host: ``aten._local_scalar_dense`` (what
``.item()``, ``bool(t)``, ``int(t)`` and ``float(t)`` dispatch to), ``aten.equal`` and
``aten.is_nonzero``, seen by a ``TorchDispatchMode``; and ``Tensor.tolist`` / ``.numpy()``, which
read CPU memory without dispatching (patched on ``torch.Tensor`` while counting). A read of a
host copy that a step started without blocking (``gradfuse.core.host_copy.HostCopy``, or a
tensor computed from such copies and Python values alone) waits for nothing: it is counted apart.

Under a dispatch mode gradfuse's C++ fast paths send every op through the dispatcher (the mode
sees it) and leave out their reads of CPU values, so what is counted is what an accelerator
would run. The CPU shortcuts of the activation hooks (small reads of CPU values, see
``gradfuse.activations.capture``) are counted: count around ``optimizer.step()`` to leave them
out; an accelerator does not take them.

Layer: core. Imports torch and ``gradfuse.core.host_copy``.
"""
from __future__ import annotations

import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gradfuse.core.host_copy import is_host_copy

_aten = torch.ops.aten
READ_OPS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
UNDISPATCHED_READS = ("tolist", "numpy")
_FROM_PYTHON = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}  # torch.tensor(python values)
_TORCH_ROOT = os.path.dirname(torch.__file__) + os.sep


class HostReads(TorchDispatchMode):
    """Counts, while active, the host's reads of tensor values (see the module docstring): on an
    accelerator each would wait for the device's queued work. For one thread's code (the
    ``Tensor.tolist`` / ``.numpy()`` patch sees every thread's).

    Attributes:
        reads (list[str]): Each read of a value that was not copied ahead, by op or method name.
        copy_reads (list[str]): Each read of a host copy made without blocking (waits for nothing).
        sites (list[str]): Per read in ``reads``, the file of the code that asked for it (the
            innermost caller outside torch).

    Example:
        ```python
        with gradfuse.HostReads() as counted:
            loss_fn(model(x), y).backward()
            optimizer.step()
        print(len(counted.reads), "host reads;", len(counted.reads_from(gradfuse)), "by gradfuse")
        ```
    """

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.copy_reads: list[str] = []
        self.sites: list[str] = []
        self._derived: dict[int, weakref.ref] = {}  # id -> tensor computed from host copies alone
        self._patched = []

    def reads_from(self, package) -> list[str]:
        """The reads that code of ``package`` (a module, e.g. ``gradfuse``) asked for itself: the
        innermost caller outside torch is one of its files, not a framework's code it called."""
        root = os.path.dirname(package.__file__) + os.sep
        return [what for what, site in zip(self.reads, self.sites) if site.startswith(root)]

    def _host(self, t) -> bool:
        ref = self._derived.get(id(t))
        return is_host_copy(t) or (ref is not None and ref() is t)

    def _read(self, what: str, t=None) -> None:
        """One read of ``t``'s value (``what``: the op or method)."""
        if isinstance(t, torch.Tensor) and self._host(t):
            self.copy_reads.append(what)
            return
        self.reads.append(what)
        self.sites.append(_asker())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if func in READ_OPS:
            self._read(str(func), inputs[0] if inputs else None)
        out = func(*args, **(kwargs or {}))
        # computed from host copies alone (or Python values): host memory too
        host = func in _FROM_PYTHON or all(self._host(a) for a in inputs)
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


def _asker() -> str:
    # The file of the innermost frame that is neither torch's nor the counter's (this module's,
    # or a method of a HostReads subclass).
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_ROOT)
                                 or frame.f_code.co_filename == __file__
                                 or isinstance(frame.f_locals.get("self"), HostReads)):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


def counting() -> bool:
    """Whether a dispatch mode (a ``HostReads`` among them) sees this thread's ops now: the C++
    fast paths then step aside for the functional path, every op of which it sees."""
    return torch._C._len_torch_dispatch_stack() > 0
