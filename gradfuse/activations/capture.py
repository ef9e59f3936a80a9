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
    and position of the batch (NaN counts as not zero).

Cost and memory
    Per hook: the fused statistics op on the output (or gradient) and, for dead units, one
    ``abs().sum()`` over all but the unit dimension; results stay in small device tensors that are read in one
    transfer when asked for. No hook keeps a reference to an activation or a gradient.
    A hook that sees the very value the previous hook on the same side saw (a block returning its
    last child's output tensor, unchanged: same object, same ``_version``, same unit dimension)
    reuses that hook's rows instead of reading the tensor again; an in-place module bumps the
    version, so its value is read anew. On the CPU, where reading a CPU tensor is no device sync:
    the dead-unit pass is skipped when the zero count decides it (``_known_dead``), when a
    small corner of the batch (the first image's first 64 pixels, the first 16 positions) holds a
    non-zero in every unit (``_probe_alive``), or when one slice across all units holds no
    zero (``_one_slice_alive``; tried first when under 5% of the elements are zero), all
    exact, and
    the trace mode reads one plain sum per output (finite: no NaN, no Inf; else the fused op
    counts). On an accelerator nothing is read in a hook.
    With ``histogram=True`` each hook also runs the fused exponent-histogram op over the same
    tensors (one call; its int64 rows stay on the device, read only when asked for, as
    ``ActivationStats.exponent_histogram`` and per layer ``layer_exponents()``).

Errors
    A hook never raises into the forward or the backward: a module whose output the statistics
    cannot take (a tensor subclass, an odd device) is warned about once, naming it, and left out.
    Hooks are removed when the ``with`` block exits, also when it raises.

Layer: activations (a capability). Imports ``gradfuse.ops`` and ``gradfuse.core``.
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
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.layers import exponents_entry, layer_of, sum_by_key
from gradfuse.ops.layout import INF, M2, NAN, NUM_BINS, NUM_COUNT_STATS, NUM_FLOAT_STATS, SUM, SUMSQ, ZERO

ROOT_NAME = "(root)"
_CHANNEL_MODULES = (nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase, nn.GroupNorm,
                    nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                    nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)
_MAX_DEPTH = 4  # how deep nested outputs (tuples of tuples, ...) are looked into


def unit_dim(module: nn.Module, t: torch.Tensor) -> int:
    """The dimension whose entries are a module's units (see the module docstring)."""
    if t.dim() >= 4 or (t.dim() >= 2 and isinstance(module, _CHANNEL_MODULES)):
        return 1
    return t.dim() - 1


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


def merged_m2(rows: list[tuple[int, float, float]]) -> float:
    """The sum of squared deviations from the common mean of several rows, each given as
    ``(numel, sum, m2)``: ``sum m2_i + sum n_i (mean_i - mean)^2`` (Chan, Golub and LeVeque),
    with no cancellation between large sums."""
    n = sum(k for k, _, _ in rows)
    if n == 0:
        return 0.0
    mean = sum(s for _, s, _ in rows) / n
    return sum(m2 + (k * (s / k - mean) ** 2 if k else 0.0) for k, s, m2 in rows)


def _unit_activity(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Per entry along ``dim``, the sum of |x| over everything else: 0 exactly when the unit is
    zero everywhere (a sum of non-negative numbers is 0 only if each is; NaN and Inf are not 0).
    ``abs().sum()`` runs 3-4x faster on the CPU than ``count_nonzero`` or ``ne(0).any()`` over
    the leading dimensions. An empty or 0-d tensor has no units to count."""
    if t.dim() == 0 or t.numel() == 0:
        return torch.ones(0, dtype=torch.int64, device=t.device)
    a = t.abs()
    if t.dim() == 1:
        return a
    return a.sum(dim=tuple(d for d in range(t.dim()) if d != dim))


def _dead_counts(activity: list) -> torch.Tensor:
    """Dead units per row, from the rows' activity vectors: three device ops for all rows. A row
    may instead hold its dead-unit count as an int (known without the per-unit pass, see
    ``_known_dead``)."""
    if any(isinstance(a, int) for a in activity):
        known = [a if isinstance(a, int) else None for a in activity]
        vectors = [a for a in activity if not isinstance(a, int)]
        counted = iter(_dead_counts(vectors).tolist()) if vectors else iter(())
        dev = vectors[0].device if vectors else "cpu"
        return torch.tensor([next(counted) if k is None else k for k in known], dtype=torch.int64,
                            device=dev)
    lengths = [len(a) for a in activity]
    if not activity or not sum(lengths):
        return torch.zeros(len(activity), dtype=torch.int64,
                           device=activity[0].device if activity else "cpu")
    dead = torch.cat(activity).eq(0).to(torch.int64).cumsum(0)
    ends = torch.tensor(lengths, device=dead.device).cumsum(0)
    at_end = torch.cat([dead.new_zeros(1), dead])[ends]
    return at_end.diff(prepend=at_end.new_zeros(1))


def _known_dead(t: torch.Tensor, dim: int, zeros: int) -> int | None:
    """The number of dead units when the zero count alone decides it, else None. A dead unit is
    ``numel / units`` zeros: with fewer zeros in the whole output no unit can be dead (0), with
    every element zero all are. Exact; used on the CPU only, where reading the count (a CPU
    tensor) costs no device sync, to skip the per-unit pass (most outputs of GELU, tanh,
    convolutions and norms, and their gradients, hold no zero at all)."""
    if t.dim() == 0 or t.numel() == 0:
        return 0
    units = t.shape[dim]
    if zeros < t.numel() // units:
        return 0
    if zeros == t.numel():
        return units
    return None


def _one_slice_alive(t: torch.Tensor, dim: int) -> bool:
    """True when one slice holding one element of every unit (index 0 of every other dimension)
    has no zero: then every unit is alive (a dead unit is zero everywhere, also there). Exact; a
    tiny read, tried on the CPU before the per-unit pass (a gradient whose last position is all
    zero, as a causal LM's is, has many zeros but no dead unit)."""
    if t.dim() == 0 or t.numel() == 0:
        return True
    v = t[(0,) * dim + (slice(None),) + (0,) * (t.dim() - dim - 1)]
    return int(torch.count_nonzero(v)) == v.numel()


_FEW_ZEROS = 0.05  # below this zero fraction the one-slice test is tried before the probe
_PROBE_INNER = 64  # entries after the unit dimension (pixels) the probe reads per row at most
_PROBE_PER_UNIT = 16  # elements per unit the probe reads at least


def _probe_alive(t: torch.Tensor, dim: int) -> bool | None:
    """True when a small corner of the tensor already holds a non-zero in every unit: then no
    unit is dead (a dead unit is zero everywhere, also there). Exact; CPU only (reads the
    result). With ``rows`` the entries of the dimensions before ``dim`` (examples, positions)
    and ``inner`` those after it (pixels), the corner is the first ``m <= 64`` inner entries of
    the first ``k`` rows, at least 16 elements per unit, at most a quarter of the rows: 64
    pixels of the first image for a conv output, 16 positions of a transformer's hidden state.
    The full per-unit pass runs only when a unit is still all zero there. A ReLU output (half
    its elements zero) or a dropout output (a tenth) defeats the zero count and the one-slice
    test but not this. None when the probe does not apply (unit dimension first, too few rows,
    not contiguous): the caller tries the one-slice test instead (the corner holds that slice)."""
    if dim == 0 or t.dim() < 2 or not t.is_contiguous():
        return None
    units = t.shape[dim]
    rows = math.prod(t.shape[:dim])
    inner = math.prod(t.shape[dim + 1:])
    if rows < 4 or units == 0 or inner == 0:
        return None
    m = min(inner, _PROBE_INNER)
    k = min(-(-_PROBE_PER_UNIT // m), rows // 4)
    if inner == 1:  # (positions, units): the first k rows, contiguous
        activity = t.view(rows, units)[:k].abs().sum(0)
    elif k == 1:  # (units, pixels) of the first image
        activity = t.view(rows, units, inner)[0, :, :m].abs().sum(1)
    else:
        activity = t.view(rows, units, inner)[:k, :, :m].abs().sum(dim=(0, 2))
    return int(torch.count_nonzero(activity)) == units


def output_layer(module: str, depth: int | None = None) -> str:
    """The layer of a module's output rows, as ``GradStats.layers`` groups parameters: the
    module path up to its first block index (``depth``: that many leading name parts)."""
    return layer_of(module + ".out", depth)


class ActivationStats(GradStats):
    """[`GradStats`][gradfuse.GradStats] of module outputs (or of the gradients with respect to them).

    Every column GradStats has (``l2``, ``linf``, ``mean``, NaN / Inf / zero counts,
    ``zero_fraction``), plus ``std`` and ``rms`` per row, and per row the dead units. Rows are
    named after the module (``name``, ``name[0]`` for tuple outputs, ``name#1`` for a second call),
    in execution order (backward order for gradients). Made by
    [`capture_activations`][gradfuse.capture_activations] (``cap.forward``, ``cap.backward``).

    Attributes:
        modules (list[str]): The module name of each row, as in ``named_modules()`` (the model
            itself is ``(root)``).
        dead_units (torch.Tensor): int64 ``[n]``: units (features of the last dimension, or
            channels for conv, norm and pooling outputs and outputs of 4+ dimensions) that are
            exactly zero for every example and position of the batch.
        units (torch.Tensor): int64 ``[n]``: the units of each row.
        scope (str): ``"all"``, or ``"rank"`` under torch.distributed with several ranks:
            activations are this rank's.
        exponent_histogram (torch.Tensor | None): With ``histogram=True``: int64 ``[n, 283]``,
            per row the count of elements of each binary exponent (bins in
            [`gradfuse.histogram`](gradfuse.histogram.md)); else None. ``layer_exponents()``
            sums it per layer.

    Example:
        ```python
        with gradfuse.capture_activations(model) as cap:
            model(x).square().mean().backward()
        print(cap.forward.std, cap.forward.dead_units)
        ```
    """

    def __init__(self, names: list[str], modules: list[str], floats: torch.Tensor,
                 counts: torch.Tensor, dead_units: torch.Tensor, units: torch.Tensor,
                 scope: str = "all"):
        total = floats[:, SUMSQ].sum().sqrt() if len(names) else torch.zeros((), dtype=torch.float64)
        super().__init__(names, floats, counts, 2.0, total)
        self.modules = modules
        self.dead_units = dead_units
        self.units = units
        self.scope = scope

    @property
    def std(self) -> torch.Tensor:
        """Standard deviation per row (float64 ``[n]``, unbiased as ``torch.std``; NaN for fewer
        than two elements)."""
        return self._memo("std", self._std)

    def _std(self) -> torch.Tensor:
        # M2, the sum of squared deviations, comes from the kernels' shifted accumulation: no
        # cancellation however far the values sit from zero
        n = self.numel.to(self.floats.dtype)
        return torch.where(n > 1, self.floats[:, M2] / (n - 1), math.nan).sqrt()

    @property
    def rms(self) -> torch.Tensor:
        """Root mean square per row: ``l2 / sqrt(numel)``."""
        return self.l2 / self.numel.clamp(min=1).to(self.floats.dtype).sqrt()

    def _extra_host(self) -> list[list[float]]:
        return self._memo("extra_host", self._read_extra)

    def _read_extra(self) -> list[list[float]]:
        if not len(self.names):
            return []
        dt = self.floats.dtype
        packed = torch.stack([self.std, self.dead_units.to(self.std.device, dt),
                              self.units.to(self.std.device, dt),
                              self.floats[:, SUM], self.floats[:, SUMSQ], self.floats[:, M2]], 1)
        return packed.cpu().tolist()

    def to_dict(self) -> dict:
        """As ``GradStats.to_dict``, each row also with ``module``, ``std``, ``rms``,
        ``dead_units``, ``units`` and ``dead_fraction``."""
        d = super().to_dict()
        for (name, row), module, (std, dead, units, *_sums) in zip(
                d["params"].items(), self.modules, self._extra_host()):
            row.update(module=module, std=std, rms=row["l2"] / math.sqrt(max(row["numel"], 1)),
                       dead_units=int(dead), units=int(units), dead_fraction=dead / units if units else 0.0)
        return d

    def layers(self, depth: int | None = None) -> dict[str, dict]:
        """Per layer (module path up to its first block index, as ``GradStats.layers`` groups
        parameters; ``depth``: that many leading name parts), over every row of its modules:
        ``numel``, ``l2``, ``rms``, ``linf``, ``mean``, ``std``, NaN / Inf / zero counts,
        ``zero_fraction``, ``dead_units``, ``units``, ``dead_fraction`` and ``rows``. The layer's
        ``std`` merges its rows' means and sums of squared deviations (Chan et al.), as stable as
        each row's."""
        d = self.to_dict()
        out: dict[str, dict] = {}
        for (name, r), (_std, _dead, _units, s, q, m2) in zip(d["params"].items(), self._extra_host()):
            key = output_layer(r["module"], depth)
            agg = out.setdefault(key, {"numel": 0, "sum": 0.0, "sumsq": 0.0, "moments": [],
                                       "linf": 0.0, "nan_count": 0, "inf_count": 0, "zero_count": 0,
                                       "dead_units": 0, "units": 0, "rows": 0})
            agg["numel"] += r["numel"]
            agg["sum"] += s
            agg["sumsq"] += q
            agg["moments"].append((r["numel"], s, m2))
            agg["linf"] = r["linf"] if math.isnan(r["linf"]) or r["linf"] > agg["linf"] else agg["linf"]
            for k in ("nan_count", "inf_count", "zero_count", "dead_units", "units"):
                agg[k] += r[k]
            agg["rows"] += 1
        for agg in out.values():
            n = agg["numel"]
            s, q = agg.pop("sum"), agg.pop("sumsq")
            agg["l2"] = math.sqrt(q)
            agg["rms"] = math.sqrt(q / max(n, 1))
            agg["mean"] = s / max(n, 1)
            agg["std"] = math.sqrt(merged_m2(agg.pop("moments")) / (n - 1)) if n > 1 else math.nan
            agg["zero_fraction"] = agg["zero_count"] / max(n, 1)
            agg["dead_fraction"] = agg["dead_units"] / agg["units"] if agg["units"] else 0.0
        return out

    def layer_exponents(self, depth: int | None = None) -> dict[str, dict] | None:
        """The exponent histograms summed per layer (layers as ``layers`` groups rows), each as
        ``{"first_bin": b, "counts": [...]}`` without its empty ends, as a monitor record's
        ``exponents``; read in one transfer. None without ``histogram=True``."""
        if self.exponent_histogram is None:
            return None
        keys = [output_layer(m, depth) for m in self.modules]
        sums = sum_by_key(keys, self.exponent_histogram.cpu().tolist())
        return {layer: exponents_entry(counts) for layer, counts in sums.items()}

    def table(self, top: int | None = None, sort_by: str | None = None) -> str:
        """A fixed-width table in execution order (or largest ``sort_by`` first)."""
        d = self.to_dict()["params"]
        items = list(d.items())
        if sort_by is not None:
            items.sort(key=lambda kv: (math.isnan(kv[1][sort_by]), kv[1][sort_by]), reverse=True)
        shown = items if top is None else items[:top]
        width = max([len("module output")] + [len(n) for n, _ in shown])
        head = (f"{'module output':<{width}}  {'numel':>9}  {'rms':>9}  {'mean':>10}  {'std':>9}"
                f"  {'linf':>9}  {'nan':>5}  {'inf':>5}  {'zero%':>6}  {'dead/units':>11}")
        lines = [head, "-" * len(head)]
        for name, r in shown:
            lines.append(f"{name:<{width}}  {r['numel']:>9}  {r['rms']:>9.3g}  {r['mean']:>10.3e}"
                         f"  {r['std']:>9.3g}  {r['linf']:>9.3g}  {r['nan_count']:>5}  {r['inf_count']:>5}"
                         f"  {100 * r['zero_fraction']:>6.1f}  {str(r['dead_units']) + '/' + str(r['units']):>11}")
        if len(shown) < len(items):
            lines.append(f"... {len(items) - len(shown)} more rows")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"ActivationStats({len(self.names)} rows, device={self.floats.device})"


class _Event:
    """What one hook call left: the rows of one module call (device tensors, no activation;
    ``dead``: per row, the activity vector of its units; ``hist``: the rows' exponent
    histograms, or None)."""
    __slots__ = ("module", "names", "floats", "counts", "dead", "units", "hist", "producer")

    def __init__(self, module, names, floats, counts, dead, units, hist=None, producer=None):
        self.module, self.names, self.floats, self.counts = module, names, floats, counts
        self.dead, self.units, self.hist = dead, units, hist
        # backward: the first watched module that output this very value (a block returns its
        # last child's output tensor; the child produced it)
        self.producer = producer


def resolve_modules(model: nn.Module, modules) -> list[tuple[str, nn.Module]]:
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
        self._fwd: list[_Event] = []
        self._bwd: list[_Event] = []
        self._calls: dict[str, int] = {}
        self.skipped: dict[str, str] = {}
        self._cache: dict = {}
        self._ops: dict = {}
        self._memo: list = [None, None]  # forward, backward: (weakref, version, unit dim, rows)
        self._zero_counts: dict = {}
        self._armed = False
        # (id, version) of output tensors -> the module that output them first; the weak values
        # keep no tensor alive and drop ids that a freed tensor could hand on
        self._alive: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._producer: dict = {}

    # -- hooks ---------------------------------------------------------------------------------
    def arm(self) -> "ActivationCapture":
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

    def __enter__(self) -> "ActivationCapture":
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
                zeros = self._zero_counts[len(tensors)] = torch.zeros((len(tensors), NUM_COUNT_STATS), dtype=torch.int64)
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
        if not counts.is_cpu:  # no host read in a hook on an accelerator
            return floats, counts, [_unit_activity(t, d) for t, d in zip(tensors, dims)]
        dead = []
        for t, d, row in zip(tensors, dims, counts.tolist()):
            known = _known_dead(t, d, row[ZERO]) if t.is_cpu else None
            if known is None and t.is_cpu:
                # Few zeros (a causal LM's gradient: its last position): one slice, the cheaper
                # test, usually decides; many (ReLU, dropout): it fails, the corner probe first.
                if row[ZERO] < _FEW_ZEROS * t.numel():
                    alive = _one_slice_alive(t, d) or _probe_alive(t, d)
                else:
                    alive = _probe_alive(t, d)
                    if alive is None:
                        alive = _one_slice_alive(t, d)
                if alive:
                    known = 0
            dead.append(_unit_activity(t, d) if known is None else known)
        return floats, counts, dead

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
        self._fwd.append(_Event(name, names, floats, counts, dead, units, hist))
        if not self.grads:
            return
        for (suffix, t), row, d, u in zip(outs, names, dims, units):
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
                self._bwd.append(_Event(name, [row], floats, counts, dead, [units], hist, producer))
            except Exception as e:  # noqa: BLE001 - a hook must never break the backward
                self._fail(name, "backward", e)
            return None
        return hook

    # -- results -------------------------------------------------------------------------------
    def _stats(self, events: list[_Event]) -> ActivationStats:
        if not self.full:
            raise RuntimeError("gradfuse: this capture only traces non-finite values "
                               "(stats=False); it has no statistics")
        names = [n for e in events for n in e.names]
        modules = [e.module for e in events for _ in e.names]
        scope = "rank" if (torch.distributed.is_available() and torch.distributed.is_initialized()
                           and torch.distributed.get_world_size() > 1) else "all"
        if not events:
            out = ActivationStats([], [], torch.zeros((0, NUM_FLOAT_STATS), dtype=torch.float64),
                                  torch.zeros((0, NUM_COUNT_STATS), dtype=torch.int64),
                                  torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                  scope)
            if self.histogram:
                out.exponent_histogram = torch.zeros((0, NUM_BINS), dtype=torch.int64)
            return out
        dev = events[0].floats.device
        floats = torch.cat([e.floats.to(dev) for e in events])
        counts = torch.cat([e.counts.to(dev) for e in events])
        dead = _dead_counts([a if isinstance(a, int) else a.to(dev) for e in events for a in e.dead])
        units = torch.tensor([u for e in events for u in e.units], dtype=torch.int64)
        out = ActivationStats(names, modules, floats, counts, dead, units.to(dev), scope)
        if self.histogram:
            out.exponent_histogram = torch.cat([e.hist.to(dev) for e in events])
        return out

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

    def _nonfinite_rows(self) -> tuple[list, list]:
        """Per row of forward and backward: (event index, row index, nan, inf); one transfer."""
        events = self._fwd + self._bwd
        if not events:
            return [], []
        dev = events[0].counts.device
        counts = torch.cat([e.counts[:, [NAN, INF]].to(dev) for e in events]).cpu().tolist()
        rows, k = [], 0
        for i, e in enumerate(events):
            for j in range(len(e.names)):
                rows.append((i, j, counts[k][0], counts[k][1]))
                k += 1
        n_fwd = sum(len(e.names) for e in self._fwd)
        return rows[:n_fwd], [(i - len(self._fwd), j, a, b) for i, j, a, b in rows[n_fwd:]]

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
        fwd, bwd = self._nonfinite_rows()
        origin = None
        for i, j, nan, inf in fwd:
            if nan or inf:
                e = self._fwd[i]
                origin = {"kind": "forward", "module": e.module, "row": e.names[j],
                          "nan": int(nan), "inf": int(inf)}
                break
        if origin is None:
            for k, (i, j, nan, inf) in enumerate(bwd):
                if not (nan or inf):
                    continue
                e = self._bwd[i]
                # The gradient just before was finite: the backward of the module that produced
                # that value ran next and handed back the first non-finite gradient.
                culprit = self._bwd[bwd[k - 1][0]].producer if k else e.module
                origin = {"kind": "backward", "module": culprit, "row": e.names[j],
                          "gradient_of": e.names[j], "nan": int(nan), "inf": int(inf),
                          "entered": k == 0}
                break
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
        o = self.nonfinite_origin()
        if o is None:
            return None
        counts = f"{o['nan']} NaN" + (f", {o['inf']} Inf" if o["inf"] else "") if o["nan"] else f"{o['inf']} Inf"
        if o["kind"] == "forward":
            where = o["row"] if o["row"] != o["module"] else o["module"]
            return f"first non-finite value in the forward output of {where} ({counts})"
        if o["entered"]:
            return (f"first non-finite value in backward: the gradient arriving at the output of "
                    f"{o['gradient_of']} ({counts}), from the loss or code outside the watched modules")
        return (f"first non-finite value in the backward of {o['module']} (or code right after it "
                f"in forward): the gradient it handed back to the output of {o['gradient_of']} "
                f"holds {counts}, while its own output gradient was finite")


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
