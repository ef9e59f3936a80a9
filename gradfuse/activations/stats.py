"""ActivationStats: the statistics of module outputs (or of the gradients with respect to them)
that the hooks of ``gradfuse.activations.capture`` leave, as a table of rows with per-layer
aggregates.

Layer: activations (a capability). Imports ``gradfuse.core`` and ``gradfuse.ops.layout``.
"""
from __future__ import annotations

import math

import torch

from gradfuse.activations.dead_units import dead_counts
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.host_copy import HostCopy
from gradfuse.core.layers import exponents_entry, layer_of, sum_by_key
from gradfuse.ops.layout import M2, NUM_BINS, NUM_COUNT_STATS, NUM_FLOAT_STATS, SUM, SUMSQ


def merged_m2(rows: list[tuple[int, float, float]]) -> float:
    """The sum of squared deviations from the common mean of several rows, each given as
    ``(numel, sum, m2)``: ``sum m2_i + sum n_i (mean_i - mean)^2`` (Chan, Golub and LeVeque),
    with no cancellation between large sums."""
    n = sum(k for k, _, _ in rows)
    if n == 0:
        return 0.0
    mean = sum(s for _, s, _ in rows) / n
    return sum(m2 + (k * (s / k - mean) ** 2 if k else 0.0) for k, s, m2 in rows)


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
        self._extra_copy: HostCopy | None = None  # start_host_copy: the extras and histograms

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

    def start_host_copy(self) -> None:
        """As ``GradStats.start_host_copy``, the per-row extras (``std``, dead units) and the
        exponent histograms too: ``to_dict``, ``layers`` and ``layer_exponents`` then read the copy."""
        if self._host_copy is None:
            super().start_host_copy()
            self._extra_copy = HostCopy([self._extra_packed(), self.exponent_histogram])

    def _extra_host(self) -> list[list[float]]:
        return self._memo("extra_host", self._read_extra)

    def _extra_packed(self) -> torch.Tensor | None:
        if not len(self.names):
            return None
        dt = self.floats.dtype
        return torch.stack([self.std, self.dead_units.to(self.std.device, dt), self.units.to(self.std.device, dt),
                            self.floats[:, SUM], self.floats[:, SUMSQ], self.floats[:, M2]], 1)

    def _read_extra(self) -> list[list[float]]:
        packed = self._extra_packed() if self._extra_copy is None else self._extra_copy.get()[0]
        return [] if packed is None else packed.cpu().tolist()

    def to_dict(self) -> dict:
        """As ``GradStats.to_dict``, each row also with ``module``, ``std``, ``rms``,
        ``dead_units``, ``units`` and ``dead_fraction``."""
        d = super().to_dict()
        for row, module, (std, dead, units, *_sums) in zip(
                d["params"].values(), self.modules, self._extra_host()):
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
        for r, (_std, _dead, _units, s, q, m2) in zip(d["params"].values(), self._extra_host()):
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
        hist = self.exponent_histogram if self._extra_copy is None else self._extra_copy.get()[1]
        keys = [output_layer(m, depth) for m in self.modules]
        sums = sum_by_key(keys, hist)
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


class HookRows:
    """What one hook call left: the rows of one module call (device tensors, no activation;
    ``dead``: per row, the activity vector of its units or its dead-unit count; ``hist``: the
    rows' exponent histograms, or None)."""
    __slots__ = ("module", "names", "floats", "counts", "dead", "units", "hist", "producer")

    def __init__(self, module, names, floats, counts, dead, units, hist=None, producer=None):
        self.module, self.names, self.floats, self.counts = module, names, floats, counts
        self.dead, self.units, self.hist = dead, units, hist
        # backward: the first watched module that output this very value (a block returns its
        # last child's output tensor; the child produced it)
        self.producer = producer


def activation_stats(events: list[HookRows], histogram: bool) -> ActivationStats:
    """The ``ActivationStats`` of the hook calls ``events``, in their order: their rows
    concatenated on the first one's device, the dead units counted (no host read), and with
    ``histogram`` the exponent histograms."""
    names = [n for e in events for n in e.names]
    modules = [e.module for e in events for _ in e.names]
    scope = "rank" if (torch.distributed.is_available() and torch.distributed.is_initialized()
                       and torch.distributed.get_world_size() > 1) else "all"
    if not events:
        out = ActivationStats([], [], torch.zeros((0, NUM_FLOAT_STATS), dtype=torch.float64),
                              torch.zeros((0, NUM_COUNT_STATS), dtype=torch.int64),
                              torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                              scope)
        if histogram:
            out.exponent_histogram = torch.zeros((0, NUM_BINS), dtype=torch.int64)
        return out
    dev = events[0].floats.device
    floats = torch.cat([e.floats.to(dev) for e in events])
    counts = torch.cat([e.counts.to(dev) for e in events])
    dead = dead_counts([a if isinstance(a, int) else a.to(dev) for e in events for a in e.dead])
    units = torch.tensor([u for e in events for u in e.units], dtype=torch.int64)
    out = ActivationStats(names, modules, floats, counts, dead, units.to(dev), scope)
    if histogram:
        out.exponent_histogram = torch.cat([e.hist.to(dev) for e in events])
    return out
