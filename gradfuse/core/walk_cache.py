"""The functional calls at the watch handle's host cost.

``gradfuse.stats(named)``, ``gradfuse.clip_(named, ...)`` and ``gradfuse.clip_grad_norm_(params,
...)`` on a list (or tuple) of parameters or ``(name, parameter)`` pairs: the first call takes
the functional path (gradfuse.core.engine) and leaves a plan here, made from its result as
``gradfuse.GradWatch`` makes one; later calls on a list of the same shape are served in C++
(``csrc/watch.cpp``, ``ListWalk``), which reads each item of the caller's list, checks it against
the plan (its kind, its name, its type: exactly ``torch.Tensor`` or ``nn.Parameter``) and each
gradient as the watch does (present or absent as planned, same device and dtype, plain and dense),
and runs the fused op without per-parameter Python. Results are bitwise the functional path's.

Any difference makes that call take the functional path, with its errors naming the parameter,
and make a new plan: a gradient replaced by one of another dtype, device or layout, set to None
or appearing, an item added, removed or renamed, another list. A plan holds no tensor (the
parameters are the caller's items, read again each call, and released when the call returns)
and no reference to the list or a model: only the names (strings) and the row order; so a
cached plan keeps nothing alive, and a list with recycled ids is checked item by item like any
other. Plans are looked up by the list's length and its first and last names (a few lists of
one model share no key), at most ``_MAX_PLANS`` of them, oldest dropped first.

A module is walked on every call (``gradfuse.core.params.module_parameters``: a change such as
``del model.layer`` is seen at once); the list of its parameters is then served like a list of
tensors, by a plan kept under its names (``module_key``), used only while the walk gives the very
same names. (``gradfuse.watch`` does not walk at all.)

Not served here (the functional path, unchanged): generators, ``group=``,
``histogram=True``, negative orders and -inf, DTensor, sparse, complex or subclass gradients,
devices without compiled kernels, torch.compile tracing, and calls made under a
TorchFunctionMode or TorchDispatchMode (which see the functional path's ops one by one).
"""
from __future__ import annotations

import torch
from torch import nn

from gradfuse.core import distributed
from gradfuse.core.grad_stats import GradStats, with_shared_names
from gradfuse.core.norms import kernel_takes_order
from gradfuse.ops import library

_MAX_PLANS = 8
_TYPES = (torch.Tensor, nn.Parameter)  # the exact item types a plan takes
_RETRY_EVERY = 32  # calls between attempts to plan a list that could not be planned


class _Plan:
    __slots__ = ("walk", "row_names", "skip", "names")

    def __init__(self, walk, row_names, skip=0, names=None):
        self.walk, self.row_names, self.skip = walk, row_names, skip
        self.names = names  # a module's parameter names, which its walk must give again


_plans: dict[tuple, _Plan] = {}
hits = 0  # calls served by a plan (tests read it)


def clear() -> None:
    """Drops every plan (tests; nothing else needs it)."""
    _plans.clear()


def _walk_class():
    """gradfuse._C.ListWalk, or None for a build without it."""
    return getattr(library.extension, "ListWalk", None) if library.extension is not None else None


def _name_of(item):
    return item[0] if type(item) is tuple and len(item) == 2 else None


def _key(source) -> tuple | None:
    """The lookup key of a list the walk may serve, or None (the functional path, no plan)."""
    if type(source) not in (list, tuple) or not source:
        return None
    if (torch.compiler.is_compiling() or torch._C._len_torch_function_stack()
            or torch._C._len_torch_dispatch_stack()):
        return None
    return (len(source), _name_of(source[0]), _name_of(source[-1]))


def module_key(names: list) -> tuple | None:
    """The key of the plan for a module whose walk gave ``names`` (its parameters, as
    gradfuse.core.params.named_params lists them), or None."""
    if _key(names) is None:
        return None
    return ("module", len(names), names[0], names[-1])


def stats(source, p: float, names: list | None = None) -> GradStats | None:
    """``gradfuse.stats(source, norm_type=p)`` from a plan, or None (take the functional path).
    ``names``: ``source`` is the list of a module's parameters, walked with these names."""
    plan = _ready(source, p, names)
    out = plan.walk.stats(source, p) if plan is not None else None
    if out is None:
        return None
    _hit()
    return with_shared_names(plan.row_names, out[0], out[1], p, out[2])


def clip(source, p: float, max_norm: float, names: list | None = None) -> GradStats | None:
    """``gradfuse.clip_(source, max_norm, p)`` (no error_if_nonfinite) from a plan, or None with
    nothing touched. ``names``: as for ``stats``."""
    plan = _ready(source, p, names)
    out = plan.walk.clip(source, p, max_norm) if plan is not None else None
    if out is None:
        return None
    _hit()
    return with_shared_names(plan.row_names, out[0], out[1], p, out[2], clip_coef=out[3],
                             max_norm=max_norm)


def clip_to(source, s: GradStats, max_norm: float, names: list | None = None) -> GradStats | None:
    """Scales the gradients ``s`` (from ``stats`` on ``source``) was taken of, as
    gradfuse.core.engine.scale_to_max_norm; None with nothing touched. ``names``: as for ``stats``."""
    plan = _ready(source, s.norm_type, names)
    out = plan.walk.clip_to(source, s.plain_total_norm, max_norm) if plan is not None else None
    if out is None:
        return None
    _hit()
    return s.replace(clip_coef=out[0], max_norm=max_norm)


def _hit() -> None:
    global hits
    hits += 1


def _ready(source, p: float, names: list | None = None) -> _Plan | None:
    if not kernel_takes_order(p):
        return None
    key = _key(source) if names is None else module_key(names)
    plan = _plans.get(key) if key is not None else None
    if plan is None or plan.walk is None or (names is not None and plan.names != names):
        return None
    return plan


def planned(source, p: float, names: list, params: list, grads: list, s: GradStats, *,
            module: bool = False) -> None:
    """After a functional call on ``source`` (``names``, ``params``: every item, as
    gradfuse.core.params.named_params gives them; ``grads``: those present; ``s``: the result): a plan for the
    next calls, when the walk can serve them. ``module``: ``source`` is ``params``, a module's
    parameters, and the plan is kept under their ``names``."""
    key = _key(source) if not module else module_key(names)
    if key is None or not kernel_takes_order(p) or not len(s):
        return  # (no gradient yet: nothing to plan, and nothing to remember)
    cls = _walk_class()
    if cls is None:
        return
    old = _plans.get(key)
    if old is not None and old.walk is None and old.skip > 0:  # could not plan: retry later
        old.skip -= 1
        return
    walk = _make(cls, source, names, params, grads, s)
    _plans.pop(key, None)
    while len(_plans) >= _MAX_PLANS:
        _plans.pop(next(iter(_plans)))
    _plans[key] = _Plan(walk, list(s.names) if walk is not None else None,
                        skip=0 if walk is not None else _RETRY_EVERY,
                        names=list(names) if module and walk is not None else None)


def _make(cls, source, names, params, grads, s):
    """A planned ListWalk for ``source``, or None."""
    if s.dtensor_spec is not None or distributed.may_have_dtensors(grads):
        return None
    if any(type(t) not in _TYPES for t in params):
        return None
    kinds = [None if type(item) in _TYPES else _name_of(item) for item in source]
    if any(k is None and type(item) not in _TYPES or k is not None and type(k) is not str
           for k, item in zip(kinds, source)):
        return None
    index = {name: i for i, name in enumerate(names)}
    if len(index) != len(names):  # rows are matched to items by name
        return None
    rows = [index[name] for name in s.names]
    compiled = [t for t in ("cpu", "cuda") if library.has_kernel(t)]
    walk = cls(kinds, _TYPES)
    return walk if walk.plan(source, rows, s.plain_total_norm, compiled) else None
