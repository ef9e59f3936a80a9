"""gradfuse.watch(): a handle on a model's parameters, resolved once, that takes each step's
statistics and clips at a host cost that does not grow with Python work per parameter.

The functional calls (``gradfuse.stats(model)``, ``gradfuse.clip_(model)``) walk the module
tree in Python every step (the gradients are then read in C++ once the walk gives the names of
an earlier call: gradfuse.core.walk_cache). A ``GradWatch`` does the walk once; each step, C++
(``csrc/watch.cpp``) reads the gradients from the cached parameters, checks them against a plan
made on an earlier step (which parameters have a gradient, each group's device and dtype, the
order of the result's rows), and runs the fused ops, the total norm and the clip coefficient
without Python. Results are bitwise those of the functional calls.

Whatever the fast path does not serve takes the functional path (gradfuse.core.engine) for that step,
with its errors naming the parameters: a step whose gradients differ from the plan (a gradient
became None or appeared, changed dtype or device; a new plan is made from that step), DTensor or
other tensor-subclass gradients, devices without compiled kernels (the reference fallback),
``group=``, torch.compile tracing, and a build of gradfuse._C without this class.

Layer: core. Imports ``gradfuse.ops`` and the core modules below it.
"""
from __future__ import annotations

import torch
from torch import nn

from gradfuse.core import distributed
from gradfuse.core.engine import fused_stats, raise_if_nonfinite, scale_to_max_norm
from gradfuse.core.grad_stats import GradStats, with_shared_names
from gradfuse.core.norms import kernel_takes_order
from gradfuse.core.params import check_max_norm, check_norm_type, named_params, with_grads
from gradfuse.ops import library

# Bumped by global module hooks whenever any module registers a parameter or a submodule (a new
# layer, ``module.weight = nn.Parameter(...)``, ``ModuleList.append``): a watch on a module
# re-resolves its parameters when this moved, at the cost of one integer compare per step.
_registrations = 0
_hooks = None


def _count_registration(*_args) -> None:
    global _registrations
    _registrations += 1


def _install_registration_hooks() -> None:
    global _hooks
    if _hooks is None:
        from torch.nn.modules import module as module_mod
        _hooks = (module_mod.register_module_parameter_registration_hook(_count_registration),
                  module_mod.register_module_module_registration_hook(_count_registration))


def _param_watch_class():
    """torch.classes.gradfuse.ParamWatch, or None when gradfuse._C is missing or predates it."""
    if library.extension is None:
        return None
    try:
        return torch.classes.gradfuse.ParamWatch
    except RuntimeError:
        return None


class GradWatch:
    """A model's parameters, resolved once, for per-step [`stats`][gradfuse.GradWatch.stats] and
    [`clip_`][gradfuse.GradWatch.clip_].

    Create with [`gradfuse.watch`][gradfuse.watch]. Each call reads the current gradients
    (``zero_grad`` may have replaced them) and returns what
    ``gradfuse.stats(source, norm_type=...)`` / ``gradfuse.clip_(source, ...)`` would, bit for
    bit; from the second call on, in C++ without per-parameter Python.

    When a watched module changes: registering a parameter or submodule anywhere
    (``model.head = nn.Linear(...)``, ``model.fc.weight = nn.Parameter(...)``,
    ``ModuleList.append``) is seen by global registration hooks, and the next call re-resolves
    the parameters. Changes that bypass registration are not seen: ``del model.layer``,
    ``model.fc.weight = None``, writing ``module._parameters`` directly,
    ``torch.utils.swap_tensors`` on a parameter; call [`refresh`][gradfuse.GradWatch.refresh]
    after those. An iterable source is listed once, at ``gradfuse.watch``.

    Attributes:
        names (list[str]): The watched parameters' names (with or without a gradient).
        params (list[torch.Tensor]): The watched parameters, in the order of ``names``.
        norm_type (float): The order of the norms.
        group: The process group of ``group=``, or None.
        last_path (str | None): What served the last call: ``"fast"`` (C++) or ``"python"``.
        in_pieces (bool): False: ``named_grads`` gives whole gradients (True for a watch of
            gradients held in pieces across ranks, DeepSpeed ZeRO's fragments).

    Example:
        ```python
        g = gradfuse.watch(model)
        loss.backward()
        s = g.clip_(max_norm=1.0)      # == gradfuse.clip_(model, 1.0)
        print(g.last_path)
        ```
    """

    in_pieces = False

    def __init__(self, source, *, norm_type: float = 2.0, group=None):
        self.norm_type = check_norm_type(norm_type)
        self.group = group
        if isinstance(source, nn.Module):
            _install_registration_hooks()
            self._module, self._items = source, None
        else:
            self._module = None
            self._items = [source] if isinstance(source, torch.Tensor) else list(source)
        self.last_path: str | None = None  # "fast" or "python": what served the last call
        self.refresh()

    def refresh(self) -> None:
        """Resolves the parameters again (see the class docstring for when that is needed).

        Returns:
            None.
        """
        source = self._module if self._module is not None else self._items
        self.names, self.params = named_params(source)
        self._resolved_at = _registrations
        self._row_names: list[str] | None = None  # names in the rows of a fast-path result
        cls = _param_watch_class()
        index = {name: i for i, name in enumerate(self.names)}
        # Rows are matched to parameters by name: duplicated names (possible in a user's list of
        # pairs) and group= (a collective per call) always take the functional path.
        self._index = index if len(index) == len(self.names) else None
        # Negative orders and -inf take the functional path's per-tensor arithmetic.
        usable = (cls is not None and self._index is not None and self.group is None
                  and kernel_takes_order(self.norm_type))
        self._fast = cls(self.params) if usable else None

    def __len__(self) -> int:
        return len(self.params)

    def __repr__(self) -> str:
        return f"GradWatch({len(self)} parameters, norm_type={self.norm_type})"

    def stats(self, *, rows: bool = True) -> GradStats:
        """Statistics of the current gradients: ``gradfuse.stats(source, norm_type=...)``.

        Args:
            rows: False: for DTensor gradients only the total norm is reduced now (one scalar
                all-reduce per sharded mesh dimension, as torch's clip_grad_norm_); the per-parameter
                rows are reduced when first read, which every rank must then do.

        Returns:
            GradStats: The statistics, bitwise those of [`gradfuse.stats`][gradfuse.stats].

        Raises:
            gradfuse.core.params.GradientTypeError: a gradient of an integer or bool dtype, sparse or
                complex.
        """
        if self._fast_ready():
            out = self._fast.stats(self.norm_type)
            if out:
                self.last_path = "fast"
                return with_shared_names(self._row_names, out[0], out[1], self.norm_type, out[2])
        return self._python_stats(rows)

    @torch.no_grad()
    def clip_(self, max_norm: float, error_if_nonfinite: bool = False, *,
              rows: bool = True) -> GradStats:
        """Clips the current gradients in place by total norm:
        ``gradfuse.clip_(source, max_norm, norm_type, error_if_nonfinite)``.

        Args:
            max_norm: The largest total norm; a non-negative number.
            error_if_nonfinite: Raise when the total norm is NaN or Inf, naming the parameters.
            rows: As for [`stats`][gradfuse.GradWatch.stats].

        Returns:
            GradStats: The statistics from before clipping, with ``clip_coef`` and ``clipped``.

        Raises:
            RuntimeError: ``error_if_nonfinite=True`` and the total norm is NaN or Inf.
            ValueError: ``max_norm`` is negative or NaN.
        """
        max_norm = check_max_norm(max_norm)
        if not error_if_nonfinite and self._fast_ready():
            out = self._fast.clip(self.norm_type, max_norm)
            if out:
                self.last_path = "fast"
                return with_shared_names(self._row_names, out[0], out[1], self.norm_type, out[2],
                                         clip_coef=out[3], max_norm=max_norm)
        s = self.stats(rows=rows)
        if len(s) and error_if_nonfinite:
            raise_if_nonfinite(s)
        return self.clip_to(s, max_norm)

    @torch.no_grad()
    def scale_by(self, coef: torch.Tensor) -> bool:
        """Scales this step's gradients in place by the 0-d ``coef`` where it is < 1 (for gradfuse.ZClip),
        without per-parameter Python.

        Args:
            coef: A 0-d tensor on the gradients' device.

        Returns:
            bool: False, and nothing touched, when the fast path cannot (the caller then scales
                through gradfuse.core.engine).
        """
        if not self._fast_ready():
            return False
        try:
            return bool(self._fast.scale_by(coef))
        except (AttributeError, RuntimeError):  # a gradfuse._C built before scale_by
            return False

    def named_grads(self) -> tuple[list[str], list[torch.Tensor]]:
        """(names, gradients) of the watched parameters that have a gradient now: what the
        monitor's clipping modes scale.

        Returns:
            tuple: The names and the gradients, in the order of ``names``.
        """
        names, _params, grads = with_grads(self.names, self.params)
        return names, grads

    def _fast_ready(self) -> bool:
        if self._module is not None and self._resolved_at != _registrations:
            self.refresh()
        return (self._fast is not None and self._row_names is not None
                and not torch.compiler.is_compiling())

    def _python_stats(self, rows: bool = True) -> GradStats:
        """The functional path for this step; then a plan for the fast path from its result."""
        self.last_path = "python"
        names, _params, grads = with_grads(self.names, self.params)
        s = fused_stats(names, grads, self.norm_type, self.group, rows=rows)
        self._row_names = None
        if (self._fast is not None and len(s) and not torch.compiler.is_compiling()
                and not distributed.may_have_dtensors(grads)):
            rows = [self._index[name] for name in s.names]
            compiled = [t for t in ("cpu", "cuda") if library.has_kernel(t)]
            if self._fast.plan(rows, s.plain_total_norm, compiled):
                self._row_names = list(s.names)  # s.names is the caller's to change; this one is never changed
        return s

    @torch.no_grad()
    def clip_to(self, s: GradStats, max_norm: float) -> GradStats:
        """Scales the gradients ``s`` was taken of, this step, so that their total norm is at most ``max_norm``.

        Used by GradMonitor (stats, then policies, then clip).

        Args:
            s: This step's statistics of the watched gradients.
            max_norm: The largest total norm.

        Returns:
            GradStats: ``s`` with ``clip_coef`` (and ``clipped``) set.
        """
        if self._fast_ready():
            out = self._fast.clip_to(s.total_norm, max_norm)
            if out:
                return s.replace(clip_coef=out[0], max_norm=max_norm)
        _names, _params, grads = with_grads(self.names, self.params)
        if distributed.may_have_dtensors(grads):  # DTensor: scale this rank's shard
            grads = [distributed.local_tensor(g) for g in grads]
        return scale_to_max_norm(s, grads, max_norm)


def watch(source, *, norm_type: float = 2.0, group=None) -> GradWatch:
    """A handle on the parameters of ``source``, resolved once, for every step's statistics and clipping.

    Args:
        source: An ``nn.Module``, a tensor, or an iterable of parameters or of
            ``(name, parameter)`` pairs.
        norm_type: As for [`gradfuse.stats`][gradfuse.stats].
        group: As for [`gradfuse.stats`][gradfuse.stats].

    Returns:
        GradWatch: The handle; see it for when the parameters are resolved again.

    Raises:
        ValueError: ``norm_type`` is NaN or not a number.
        gradfuse.core.params.ParametersTypeError: ``source`` holds something that is not a tensor.

    Example:
        ```python
        g = gradfuse.watch(model)
        for batch in loader:
            loss = model(batch).mean(); loss.backward()
            s = g.clip_(max_norm=1.0)   # == gradfuse.clip_(model, 1.0), without per-parameter Python
            optimizer.step(); optimizer.zero_grad()
        ```
    """
    return GradWatch(source, norm_type=norm_type, group=group)


def watch_source(model, norm_type: float, caller: str) -> tuple[object, GradWatch, dict[int, str]]:
    """What a monitor watches, resolved once: ``model`` as it is kept (an iterable made a list,
    iterated every step), its ``GradWatch`` (one given is used as it is), and the name of each
    parameter by ``id``.

    Raises:
        ValueError: ``model`` is a ``GradWatch`` of another ``norm_type`` (``caller`` names who
            asked).
    """
    if not isinstance(model, (nn.Module, torch.Tensor, GradWatch)):
        model = list(model)
    if isinstance(model, GradWatch):  # e.g. a FragmentWatch of DeepSpeed ZeRO's gradient fragments
        if model.norm_type != norm_type:
            raise ValueError(f"{caller}: the watch given has norm_type={model.norm_type}, the monitor "
                             f"norm_type={norm_type}")
        handle = model
    else:
        handle = watch(model, norm_type=norm_type)
    named = model.named_parameters() if isinstance(model, nn.Module) else (
        [] if isinstance(model, torch.Tensor) else
        list(zip(model.names, model.params)) if isinstance(model, GradWatch) else model)
    return model, handle, {id(item[1]): item[0] for item in named if isinstance(item, tuple)}
