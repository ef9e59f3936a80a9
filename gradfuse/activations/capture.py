"""Activations and the gradients with respect to them: fused statistics per module, taken in hooks
without a host sync, sampled by the monitor, and the first non-finite value traced to its module.

    with gradfuse.capture_activations(model) as cap:
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
    print(cap.forward.table())          # one row per module output: l2, mean, std, dead units, ...
    print(cap.backward.to_dict()["params"]["layers.3.relu"]["dead_units"])

Rows and names
    One row per module call and output tensor. Names are those of ``named_modules()`` (the model
    itself is ``(root)``); a module whose output holds several tensors gets one row per floating
    tensor: ``name[0]`` for tuples and lists, ``name.logits`` for dicts, dataclasses and Hugging
    Face ``ModelOutput``. Integer, bool and other non-tensor outputs are left out (no error).
    A module called several times in one forward (weight sharing, loops, gradient accumulation)
    gets one row per call: ``name``, ``name#1``, ``name#2``, ... (per-layer aggregates, as the
    monitor logs them, add the calls up).

When statistics are taken
    The forward row is the module's output at the moment its forward hook runs. An in-place
    module (``nn.ReLU(inplace=True)``) therefore reports the value after its own in-place update,
    and the module before it reports its output before that update. The backward row is the
    gradient with respect to that same value (a tensor hook, registered in the forward hook:
    autograd keeps it with the value it was registered on even when a later in-place op changes
    the tensor), so in-place modules need no special care and no ``register_full_backward_hook``
    is used (it refuses in-place modules).

Dead units
    ``units``: features of the last dimension, or channels (dimension 1) for outputs of
    convolutions, batch/instance/group norms and pooling, and for any output of 4 or more
    dimensions (NCHW images); ``dead_units``: how many of them are exactly zero for every example
    and position of the batch (NaN counts as not zero). Counted by
    ``gradfuse.activations.dead_units``.

Cost and memory
    Per hook: the fused statistics op on the output (or gradient) and, for dead units, one
    ``abs().sum()`` over all but the unit dimension; results stay in small device tensors that are read in one
    transfer when asked for. No hook keeps a reference to an activation or a gradient.
    A hook that sees the very value the previous hook on the same side saw (a block returning its
    last child's output tensor, unchanged: same object, same ``_version``, same unit dimension)
    reuses that hook's rows instead of reading the tensor again; an in-place module bumps the
    version, so its value is read anew. On the CPU, where reading a CPU tensor is no device sync,
    exact shortcuts skip most dead-unit passes (see ``gradfuse.activations.dead_units``), and
    the trace mode reads one plain sum per output (finite: no NaN, no Inf; else the fused op
    counts). On an accelerator nothing is read in a hook.
    With ``histogram=True`` each hook also runs the fused exponent-histogram op over the same
    tensors (one call; its int64 rows stay on the device, read only when asked for, as
    ``ActivationStats.exponent_histogram`` and per layer ``layer_exponents()``).

Results
    ``cap.forward`` and ``cap.backward`` are ``ActivationStats`` (``gradfuse.activations.stats``);
    ``first_nonfinite`` and ``describe_nonfinite()`` come from the NaN / Inf counts every row
    holds (``gradfuse.activations.trace``).

Errors
    A hook never raises into the forward or the backward: a module whose output the statistics
    cannot take (a tensor subclass, an odd device) is warned about once, naming it, and left out.
    Hooks are removed when the ``with`` block exits, also when it raises.

Layer: activations (a capability). Imports ``gradfuse.ops``, ``gradfuse.core.host_copy`` and the
activations' own modules.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import sys
import warnings
import weakref
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from gradfuse import ops
from gradfuse.activations.dead_units import unit_activity_rows, unit_dim
from gradfuse.activations.stats import ActivationStats, HookRows, activation_stats
from gradfuse.activations.trace import describe_origin, nonfinite_counts, nonfinite_origin
from gradfuse.core.host_copy import HostCopy
from gradfuse.ops.layout import NUM_COUNT_STATS

ROOT_NAME = "(root)"
_MAX_DEPTH = 4  # how deep nested outputs (tuples of tuples, ...) are looked into


def _floating_outputs(output, prefix: str = "", depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(suffix, tensor) for every floating-point tensor in a module's output."""
    if isinstance(output, torch.Tensor):
        return [(prefix, output)] if output.is_floating_point() else []
    if depth >= _MAX_DEPTH or output is None or isinstance(output, (str, bytes, int, float, bool)):
        return []
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(output, Mapping):  # dicts, Hugging Face ModelOutput
        for key, value in output.items():
            out += _floating_outputs(value, f"{prefix}.{key}", depth + 1)
    elif isinstance(output, (tuple, list)):
        if hasattr(output, "_fields"):  # namedtuple
            for key, value in zip(output._fields, output):
                out += _floating_outputs(value, f"{prefix}.{key}", depth + 1)
        else:
            for i, value in enumerate(output):
                out += _floating_outputs(value, f"{prefix}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for f in dataclasses.fields(output):
            out += _floating_outputs(getattr(output, f.name, None), f"{prefix}.{f.name}", depth + 1)
    return out


def resolve_modules(model: nn.Module, modules) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module of ``modules`` (names or module objects of ``model``;
    None: all of them, the model itself named ``(root)``). Raises ValueError naming close matches
    for an unknown name, or for a module that is not part of ``model``; TypeError for anything
    else."""
    named = list(model.named_modules())
    if modules is None:
        return [(name or ROOT_NAME, m) for name, m in named]
    if isinstance(modules, (str, nn.Module)):
        modules = [modules]
    by_name = {name: m for name, m in named}
    by_id = {id(m): name for name, m in named}
    out = []
    for item in modules:
        if isinstance(item, str):
            key = "" if item == ROOT_NAME else item
            if key not in by_name:
                close = difflib.get_close_matches(item, [n for n in by_name if n], n=3)
                names = [n for n in by_name if n]
                hint = (f"; did you mean {', '.join(map(repr, close))}?" if close else
                        f"; its modules: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}")
                raise ValueError(f"gradfuse.capture_activations: the model has no module named "
                                 f"{item!r}{hint}")
            out.append((item if key else ROOT_NAME, by_name[key]))
        elif isinstance(item, nn.Module):
            if id(item) not in by_id:
                raise ValueError(f"gradfuse.capture_activations: the module {type(item).__name__} "
                                 f"({item.__class__.__module__}) is not part of the model "
                                 f"{type(model).__name__}; pass one of model.modules() or its name")
            out.append((by_id[id(item)] or ROOT_NAME, item))
        else:
            raise TypeError(f"gradfuse.capture_activations: modules must hold module names or "
                            f"modules, got {type(item).__name__}")
    return out


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` runs under torch.compile (``torch.compile(model)`` or ``model.compile()``)."""
    dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing is compiled
    if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


class ActivationCapture:
    """Watches the forward and backward passes of a model; see [`capture_activations`][gradfuse.capture_activations].

    Attributes:
        forward (ActivationStats): Statistics of the module outputs, in execution order.
        backward (ActivationStats): Statistics of the gradients with respect to the outputs.
        first_nonfinite (tuple[str, str] | None): None, or ``("forward" | "backward", module
            name)``; ``describe_nonfinite()`` says it in words.
        skipped (dict[str, str]): Modules left out, with the reason.

    Example:
        ```python
        with gradfuse.capture_activations(model, modules=["0", "2"]) as cap:
            model(x).sum().backward()
        print(cap.skipped, cap.first_nonfinite)
        ```
    """

    def __init__(self, model: nn.Module, modules=None, grads: bool = True,
                 trace_nonfinite: bool = False, stats: bool = True, training_only: bool = False,
                 histogram: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"gradfuse.capture_activations: model must be an nn.Module, got "
                            f"{type(model).__name__}")
        if is_compiled(model):
            raise ValueError(
                "gradfuse.capture_activations: the model is compiled with torch.compile; hooks "
                "registered and removed on sampled steps would change what torch.compile guards on "
                "and recompile it. Capture activations on the uncompiled model (e.g. an eval copy), "
                "or leave activations=False / trace_nonfinite=False for compiled models.")
        self.model = model
        self.grads = grads
        self.trace_nonfinite = trace_nonfinite
        self.full = stats  # False: only the non-finite counts (trace mode)
        self.histogram = histogram  # with the statistics, the exponent histograms
        self.training_only = training_only
        self._watched = resolve_modules(model, modules)
        self._handles: list = []
        self._tensor_handles: list = []
        self._fwd: list[HookRows] = []
        self._bwd: list[HookRows] = []
        self._calls: dict[str, int] = {}
        self.skipped: dict[str, str] = {}
        self._cache: dict = {}
        self._trace_copy: HostCopy | None = None  # start_host_copy: the non-finite counts
        self._ops: dict = {}
        self._memo: list = [None, None]  # forward, backward: (weakref, version, unit dim, rows)
        self._zero_counts: dict = {}
        self._armed = False
        # (id, version) of output tensors -> the module that output them first; the weak values
        # keep no tensor alive and drop ids that a freed tensor could hand on
        self._alive: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._producer: dict = {}

    # -- hooks ---------------------------------------------------------------------------------
    def arm(self) -> ActivationCapture:
        """Registers the hooks (the ``with`` block does this). Arming twice does nothing.

        Returns:
            This capture.

        Example:
            ```python
            cap = gradfuse.capture_activations(model).arm()
            model(x).sum().backward()
            cap.disarm()
            print(cap.forward.table(top=5))
            ```
        """
        if self._armed:
            return self
        self._armed = True
        try:
            for name, module in self._watched:
                self._handles.append(module.register_forward_hook(self._forward_hook(name, module)))
        except BaseException:
            self.disarm()
            raise
        return self

    def disarm(self) -> None:
        """Removes every hook this capture registered (the ``with`` block does this)."""
        handles, self._handles = self._handles, []
        tensor_handles, self._tensor_handles = self._tensor_handles, []
        for h in handles + tensor_handles:
            h.remove()
        self._armed = False
        self._alive = weakref.WeakValueDictionary()
        self._producer = {}
        self._memo = [None, None]

    @property
    def hook_count(self) -> int:
        """Hooks this capture holds registered now (module forward hooks and tensor hooks)."""
        return len(self._handles) + len(self._tensor_handles)

    def __enter__(self) -> ActivationCapture:
        return self.arm()

    def __exit__(self, *exc) -> None:
        self.disarm()

    def _fail(self, name: str, where: str, error: BaseException) -> None:
        if name not in self.skipped:
            self.skipped[name] = f"{where}: {type(error).__name__}: {error}"
            warnings.warn(f"gradfuse: activation statistics of module {name!r} left out ({where} "
                          f"hook: {type(error).__name__}: {error}); training goes on (warned once "
                          "per module)", RuntimeWarning, stacklevel=2)

    def _forward_hook(self, name: str, module: nn.Module):
        def hook(_module, _args, output):
            if name in self.skipped or (self.training_only and not torch.is_grad_enabled()):
                return None
            try:
                self._record_forward(name, module, output)
            except Exception as e:  # noqa: BLE001 - a hook must never break the forward
                self._fail(name, "forward", e)
            return None
        return hook

    def _stats_op(self, device: torch.device):
        """The rows with the sum of squared deviations (``multi_tensor_moments``; trace mode,
        which needs only the NaN / Inf counts: ``multi_tensor_stats``), as ``op(tensors)``."""
        op = self._ops.get(device)
        if op is None:  # resolved once per device: the op's Python wrapper costs as much as a small op
            if not self.full:
                stats = (torch.ops.gradfuse.multi_tensor_stats.default if ops.use_compiled(device)
                         else ops.reference.multi_tensor_stats)
                op = functools.partial(stats, norm_type=2.0)
            elif ops.op_compiled("multi_tensor_moments", device):
                op = torch.ops.gradfuse.multi_tensor_moments.default
            else:
                op = ops.reference.multi_tensor_moments
            self._ops[device] = op
        return op

    def _trace_rows_cpu(self, tensors: list[torch.Tensor]):
        """Trace mode on the CPU: the NaN / Inf counts with one plain sum per tensor. A sum is
        finite exactly when every element is finite, unless it overflows; so a finite sum means
        no NaN and no Inf (counts of 0, exact), and a non-finite one takes the fused op for the
        exact counts. Reading the sum costs no device sync on the CPU."""
        if all(math.isfinite(t.sum().item()) for t in tensors):
            zeros = self._zero_counts.get(len(tensors))
            if zeros is None:  # shared: rows are only ever read through torch.cat (a copy)
                zeros = torch.zeros((len(tensors), NUM_COUNT_STATS), dtype=torch.int64)
                self._zero_counts[len(tensors)] = zeros
            return None, zeros, None
        return None

    def _rows(self, tensors: list[torch.Tensor], dims: list[int]):
        # the tensors are detached: nothing here is recorded by autograd
        if not self.full and all(t.is_cpu for t in tensors):
            rows = self._trace_rows_cpu(tensors)
            if rows is not None:
                return rows
        try:
            floats, counts = self._stats_op(tensors[0].device)(tensors)
        except RuntimeError:  # several dtypes or devices: one call each
            if len(tensors) == 1:
                raise
            parts = [self._stats_op(t.device)([t]) for t in tensors]
            dev = tensors[0].device
            floats = torch.cat([f.to(dev) for f, _ in parts])
            counts = torch.cat([c.to(dev) for _, c in parts])
        if not self.full:
            return floats, counts, None
        return floats, counts, unit_activity_rows(tensors, dims, counts)

    def _histogram_rows(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """The exponent histograms of one hook's tensors (int64 ``[n, NUM_BINS]`` on the first
        one's device, nothing read on the host), or None when not asked for: one fused call, or
        one per tensor when they mix dtypes or devices."""
        if not (self.full and self.histogram):
            return None
        try:
            return ops.multi_tensor_exponent_histogram(tensors)
        except RuntimeError:  # several dtypes or devices: one call each
            if len(tensors) == 1:
                raise
            dev = tensors[0].device
            return torch.cat([ops.multi_tensor_exponent_histogram([t]).to(dev) for t in tensors])

    def _rows_memo(self, original: torch.Tensor, tensors: list[torch.Tensor], dims: list[int], side: int):
        """``_rows`` and ``_histogram_rows``, reusing the last hook's rows when this hook sees
        the very same value: a block returns its last child's output tensor, and the hooks of
        both get its gradient."""
        if len(tensors) != 1:
            return self._rows(tensors, dims) + (self._histogram_rows(tensors),)
        t = original  # the hook's own object (tensors holds detached views, new per hook)
        memo = self._memo[side]
        if memo is not None and memo[0]() is t and memo[1] == t._version and memo[2] == dims[0]:
            return memo[3]
        rows = self._rows(tensors, dims) + (self._histogram_rows(tensors),)
        self._memo[side] = (weakref.ref(t), t._version, dims[0], rows)
        return rows

    def _record_forward(self, name: str, module: nn.Module, output) -> None:
        outs = _floating_outputs(output)
        if not outs:
            return
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        base = name if call == 0 else f"{name}#{call}"
        tensors = [t.detach() for _, t in outs]
        dims = [unit_dim(module, t) for t in tensors]
        units = [t.shape[d] if t.dim() else 0 for t, d in zip(tensors, dims)]
        names = [base + suffix for suffix, _ in outs]
        floats, counts, dead, hist = self._rows_memo(outs[0][1], tensors, dims, 0)
        self._fwd.append(HookRows(name, names, floats, counts, dead, units, hist))
        if not self.grads:
            return
        for (_suffix, t), row, d, u in zip(outs, names, dims, units):
            if t.requires_grad:
                key = (id(t), t._version)  # an in-place op makes a new value of the same tensor
                if self._alive.get(key) is not t:
                    self._alive[key] = t
                    self._producer[key] = name
                hook = self._grad_hook(name, row, d, u, self._producer[key])
                self._tensor_handles.append(t.register_hook(hook))

    def _grad_hook(self, name: str, row: str, dim: int, units: int, producer: str):
        def hook(grad):
            if name in self.skipped or grad is None:
                return None
            try:
                floats, counts, dead, hist = self._rows_memo(grad, [grad.detach()], [dim], 1)
                self._bwd.append(HookRows(name, [row], floats, counts, dead, [units], hist, producer))
            except Exception as e:  # noqa: BLE001 - a hook must never break the backward
                self._fail(name, "backward", e)
            return None
        return hook

    # -- results -------------------------------------------------------------------------------
    def _stats(self, events: list[HookRows]) -> ActivationStats:
        if not self.full:
            raise RuntimeError("gradfuse: this capture only traces non-finite values "
                               "(stats=False); it has no statistics")
        return activation_stats(events, self.histogram)

    @property
    def forward(self) -> ActivationStats:
        """Statistics of the module outputs, one row per module call and output tensor."""
        key = ("forward", len(self._fwd))
        if key not in self._cache:
            self._cache[key] = self._stats(self._fwd)
        return self._cache[key]

    @property
    def backward(self) -> ActivationStats:
        """Statistics of the gradients with respect to the module outputs, in the order backward
        computed them (``grads=False``: no rows)."""
        key = ("backward", len(self._bwd))
        if key not in self._cache:
            self._cache[key] = self._stats(self._bwd)
        return self._cache[key]

    def start_host_copy(self) -> None:
        """Starts copying what the results read (the statistics, the non-finite counts) to host
        memory without waiting for the device; ``forward``, ``backward`` and the non-finite
        origin then read that copy. A monitor that never blocks calls it at the step and reads
        the capture one step later. Call it after the backward (the rows are complete)."""
        if self.full:
            self.forward.start_host_copy()
            self.backward.start_host_copy()
        self._trace_copy = HostCopy([nonfinite_counts(self._fwd, self._bwd)])

    def nonfinite_origin(self) -> dict | None:
        """Where the first non-finite value appeared (None: nowhere). Reads the per-module
        counts in one transfer. A dict: ``kind`` ("forward" or "backward"), ``module``, ``row``
        (the output holding it), ``nan``, ``inf``, and for backward ``gradient_of`` (the module
        output whose gradient first held it) and ``entered`` (True when no watched module's
        backward ran before it: the non-finite gradient came from the loss or from code outside
        the watched modules).

        Returns:
            None, or ``{"kind", "module", "row", "nan", "inf"}`` (and for backward
                ``"gradient_of"``, ``"entered"``).
        """
        if "origin" in self._cache:
            return self._cache["origin"]
        counts = None if self._trace_copy is None else self._trace_copy.get()[0]
        origin = nonfinite_origin(self._fwd, self._bwd, counts)
        self._cache["origin"] = origin
        return origin

    @property
    def first_nonfinite(self) -> tuple[str, str] | None:
        """None, or ``("forward" | "backward", module name)``: the first module, in execution
        order, whose forward output, or whose backward's result, held a NaN or an Inf."""
        o = self.nonfinite_origin()
        return None if o is None else (o["kind"], o["module"])

    def describe_nonfinite(self) -> str | None:
        """The origin in words (None when everything was finite).

        Returns:
            A sentence naming the module where the first NaN / Inf appeared, or None.

        Example:
            ```python
            with gradfuse.capture_activations(model, trace_nonfinite=True) as cap:
                model(x).sum().backward()
            print(cap.describe_nonfinite())
            ```
        """
        return describe_origin(self.nonfinite_origin())


def capture_activations(model: nn.Module, modules: Iterable[str | nn.Module] | str | nn.Module | None = None,
                        grads: bool = True, trace_nonfinite: bool = False,
                        histogram: bool = False) -> ActivationCapture:
    """A context manager that watches the forward and backward passes run inside it.

    ``first_nonfinite`` is the first module in execution order whose forward output held a NaN or
    an Inf, else the module whose backward first handed back a non-finite gradient (the last
    module, in backward order, whose own output gradient was still finite; when none was, the
    non-finite gradient came from the loss, and the module whose output gradient held it is
    named). See the module docstring of ``gradfuse.activations.capture`` for names, in-place
    modules, dead units and cost.

    Args:
        model: the module whose submodules are watched.
        modules: which modules (names as in ``named_modules()``, or module objects of ``model``);
            None: every module, leaves and blocks (those whose output holds no floating tensor
            give no row).
        grads: also the gradients with respect to the outputs (tensor hooks); False: forward only.
        trace_nonfinite: accepted for symmetry with [`GradMonitor`][gradfuse.GradMonitor]:
            ``first_nonfinite`` is always available, from the NaN / Inf counts every row has.
        histogram: also the exponent histogram of every row (one more fused op per hook, over
            the same tensors): ``cap.forward.exponent_histogram`` and
            ``cap.backward.exponent_histogram``, int64 ``[n, 283]``, summed per layer by
            ``layer_exponents()``; False: None.

    Returns:
        ActivationCapture: Use it in a ``with`` block; the hooks are removed when it exits, also
            on an exception.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` is compiled with ``torch.compile`` (hooks registered and removed on
            sampled steps would change what it guards on).

    Example:
        ```python
        with gradfuse.capture_activations(model) as cap:
            loss = loss_fn(model(x), y)
            loss.backward()
        print(cap.forward.table())            # module outputs
        print(cap.backward.table())           # gradients with respect to them
        cap.first_nonfinite                   # None, or ("forward" | "backward", module name)
        ```
    """
    return ActivationCapture(model, modules, grads=grads, trace_nonfinite=trace_nonfinite,
                             histogram=histogram)
