"""GradStats: the per-parameter gradient statistics of one step, kept on the device. Its text
and HTML tables are drawn by ``gradfuse.core.stats_table``.

Layer: core. Imports ``gradfuse.ops.layout`` and the core's distributed, layers and stats table.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from gradfuse.core.distributed import as_dtensor
from gradfuse.core.host_copy import HostCopy
from gradfuse.core.layers import columns_to_host, layer_of
from gradfuse.core.stats_table import html_table, text_table
from gradfuse.ops.layout import INF, MAXABS, NAN, NUMEL, POWSUM, SUM, SUMSQ, ZERO


class Statistic(NamedTuple):
    """A per-row statistic of ``GradStats``: a property of that name, a key of each row of
    ``to_dict()`` (and of the monitor's records), and a column of ``table()``.

    Attributes:
        name: The property and the key.
        count: An int64 count (read as ``int``), else a float64 value.
        header: Its column's heading in ``table()``; None: not shown there.
        width: The column's width in ``table()``.
        spec: The format of a cell after the width (``".4g"``).
        scale: A cell shows the value times this (100 for a percentage).
    """

    name: str
    count: bool
    header: str | None = None
    width: int = 0
    spec: str = ""
    scale: float = 1.0


# The per-row statistics, in the order of to_dict's rows (and of the records' "params"). Adding one:
# a property of GradStats below computing it from the rows (gradfuse.ops.layout), and its entry here.
STATISTICS: tuple[Statistic, ...] = (
    Statistic("numel", True, "numel", 10),
    Statistic("l2", False, "l2", 10, ".4g"),
    Statistic("linf", False, "linf", 10, ".4g"),
    Statistic("mean", False, "mean", 11, ".3e"),
    Statistic("nan_count", True, "nan", 6),
    Statistic("inf_count", True, "inf", 6),
    Statistic("zero_count", True),
    Statistic("zero_fraction", False, "zero%", 6, ".1f", 100.0),
)
PER_PARAM_FIELDS = tuple(st.name for st in STATISTICS)


class GradStats:
    """Statistics of a set of gradients: per parameter (rows follow ``names``) and in total.

    Every statistic is a tensor on the device of the first gradient and is computed without host
    synchronisation. Reading values as Python numbers ([`to_dict`][gradfuse.GradStats.to_dict],
    [`table`][gradfuse.GradStats.table], [`nonfinite_names`][gradfuse.GradStats.nonfinite_names])
    copies everything to the host in one transfer, once, and caches it. In Jupyter a GradStats
    shows as an HTML table.

    Per parameter (1-d tensors): ``numel``, ``l2``, ``linf``, ``mean``, ``nan_count``,
    ``inf_count``, ``zero_count``, ``zero_fraction`` (float64 / int64). L2 and L-infinity
    follow ``torch.linalg.vector_norm`` (NaN and Inf propagate); an empty gradient has
    ``l2 = linf = mean = zero_fraction = 0``.

    Like torch.nn.utils, the total norm of gradients is the norm of their norms: for
    ``norm_type=0`` that is the number of parameters with a non-zero gradient element
    ([`gradfuse.tensor_stats`][gradfuse.tensor_stats] counts the non-zero elements; so does
    ``norm(0).sum()``).

    Clipping modes ([`gradfuse.clip`](gradfuse.clip.md)): after ``clip_(..., per="param"|"layer")``
    ``clip_coef`` and ``clipped`` are 1-d, one entry per row (``clip_per`` says which); after
    ``clip_(..., value=v)`` ``clamped`` holds the elements changed per row, ``clipped`` is
    ``clamped > 0`` and ``clip_value`` is ``v``.

    Made by [`gradfuse.stats`][gradfuse.stats], [`gradfuse.tensor_stats`][gradfuse.tensor_stats],
    [`gradfuse.clip_`][gradfuse.clip_] and [`GradWatch`][gradfuse.GradWatch]; not constructed
    directly.

    Attributes:
        names (list[str]): The row names: parameter names (``0.weight``), or ``[i]`` / dict keys
            for ``tensor_stats``. With several (device, dtype) groups, rows are ordered group by
            group.
        total_norm (torch.Tensor): 0-d, of order ``norm_type``, in the gradients' dtype as
            ``clip_grad_norm_`` returns it; for DTensor gradients a DTensor with the placements
            torch gives it (``.full_tensor()`` reads it).
        norm_type (float): The order of ``total_norm``.
        clip_coef (torch.Tensor | None): After clipping, the factor applied (at most 1): 0-d, or
            one entry per row after ``per=``; None before clipping.
        max_norm (float | None): The clip threshold used, if any.
        scope (str): ``"all"``, or ``"rank"`` when taken with ``group=``: then the rows are this
            rank's parameters while ``total_norm`` and ``nonfinite`` cover the group.
        exponent_histogram (torch.Tensor | None): With ``histogram=True``: int64 ``[n, 283]``,
            per row the count of elements of each binary exponent (bins in
            [`gradfuse.histogram`](gradfuse.histogram.md)); else None.
        headroom (dict[str, torch.Tensor] | None): With ``histogram=True``: ``{column: float64 [n]}``,
            the fractions that would underflow, become subnormal or overflow per format (columns in
            [`gradfuse.headroom`](gradfuse.headroom.md)); else None.
        clip_per (str | None): ``"param"`` or ``"layer"`` after ``clip_(..., per=...)``.
        clamped (torch.Tensor | None): After ``clip_(..., value=v)``: elements changed per row.
        clip_value (float | None): After ``clip_(..., value=v)``: ``v``.

    Example:
        ```python
        loss.backward()
        s = gradfuse.stats(model)
        s.total_norm                    # 0-d tensor, on the device
        print(s.table(top=5))           # one host transfer
        row = s.to_dict()["params"]["0.weight"]
        ```
    """

    # With histogram=True (gradfuse.numerics.histogram): int64 [n, 283] exponent histogram per
    # row, and the headroom columns {column: float64 [n]} per format (gradfuse.numerics.headroom)
    exponent_histogram: torch.Tensor | None = None
    headroom: dict[str, torch.Tensor] | None = None
    # The clipping modes (gradfuse.clip) set these on the instances they return.
    clip_per: str | None = None
    clamped: torch.Tensor | None = None
    clip_value: float | None = None

    def __init__(self, names: list[str], floats: torch.Tensor, counts: torch.Tensor,
                 norm_type: float, total_norm: torch.Tensor,
                 clip_coef: torch.Tensor | None = None, max_norm: float | None = None,
                 group_nonfinite: torch.Tensor | None = None, dtensor_spec=None,
                 pending_rows=None):
        self._names, self._names_own = names, True  # (see shared_names)
        # With group= (pipeline stages): rows are this rank's parameters, while total_norm and
        # nonfinite cover the whole group.
        self.scope = "rank" if group_nonfinite is not None else "all"
        self._group_nonfinite = group_nonfinite
        self.norm_type = norm_type
        # A plain tensor, the full value on every rank; what gradfuse computes with.
        self.plain_total_norm = total_norm
        self.dtensor_spec = dtensor_spec
        self.total_norm = total_norm if dtensor_spec is None else as_dtensor(total_norm, dtensor_spec)
        self.clip_coef = clip_coef
        self.max_norm = max_norm
        self._rows_f = floats  # float64 rows, columns as gradfuse.ops.layout's FLOAT_COLUMNS
        self._rows_c = counts  # int64 rows, columns as its COUNT_COLUMNS
        # DTensor gradients whose total norm alone was reduced (gradfuse.core.sharded): rows of this
        # rank's shards, reduced over the mesh when first read (a collective on every rank).
        self._pending_rows = pending_rows
        self._host_cache: dict | None = None
        self._host_copy = None  # (HostCopy, layout) once start_host_copy ran
        self._derived: dict = {}  # statistics computed from the rows, once each (_memo)

    def _memo(self, key: str, compute):
        """``compute()``, once per object.

        (functools.cached_property takes a lock that torch.compile cannot trace.)
        """
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    @property
    def names(self) -> list[str]:
        """The row names (see the class docstring)."""
        if not self._names_own:  # a list of the fast paths', copied when first read
            self._names, self._names_own = list(self._names), True
        return self._names

    @names.setter
    def names(self, value: list[str]) -> None:
        self._names, self._names_own = value, True

    def replace(self, **changes) -> GradStats:
        """A copy with some constructor arguments changed (the derived values are recomputed)."""
        args = dict(names=self._names, floats=self._rows_f, counts=self._rows_c,
                    norm_type=self.norm_type, total_norm=self.plain_total_norm, clip_coef=self.clip_coef,
                    max_norm=self.max_norm, group_nonfinite=self._group_nonfinite,
                    dtensor_spec=self.dtensor_spec, pending_rows=self._pending_rows)
        args.update(changes)
        out = GradStats(**args)
        if "names" not in changes:
            out._names_own = self._names_own
        out.exponent_histogram = self.exponent_histogram
        out.headroom = self.headroom
        return out

    def __len__(self) -> int:
        return len(self._names)

    @property
    def floats(self) -> torch.Tensor:
        """The fused op's float64 rows, one per name (columns: ``gradfuse.ops.layout.FLOAT_COLUMNS``)."""
        if self._pending_rows is not None:
            self._rows_f, self._rows_c = self._pending_rows.get()
            self._pending_rows = None
        return self._rows_f

    @property
    def counts(self) -> torch.Tensor:
        """The fused op's int64 rows: NaN, Inf, zero counts, numel (``gradfuse.ops.layout.COUNT_COLUMNS``)."""
        if self._pending_rows is not None:
            _ = self.floats  # reduces both
        return self._rows_c

    # Per-parameter statistics, derived lazily from the fused results (small device ops).
    @property
    def numel(self) -> torch.Tensor:
        """Elements per row (int64 ``[n]``)."""
        return self._memo("numel", lambda: self.counts[:, NUMEL])

    @property
    def l2(self) -> torch.Tensor:
        """L2 norm per row (float64 ``[n]``); NaN and Inf propagate, as ``torch.linalg.vector_norm``."""
        return self._memo("l2", lambda: self.floats[:, SUMSQ].sqrt())

    @property
    def linf(self) -> torch.Tensor:
        """L-infinity norm (max |x|) per row (float64 ``[n]``); NaN propagates."""
        return self._memo("linf", lambda: self.floats[:, MAXABS])

    @property
    def mean(self) -> torch.Tensor:
        """Mean per row (float64 ``[n]``); 0 for an empty tensor."""
        return self._memo("mean", lambda: self.floats[:, SUM] / self.numel.clamp(min=1))

    @property
    def nan_count(self) -> torch.Tensor:
        """NaN elements per row (int64 ``[n]``)."""
        return self._memo("nan_count", lambda: self.counts[:, NAN])

    @property
    def inf_count(self) -> torch.Tensor:
        """+-Inf elements per row (int64 ``[n]``)."""
        return self._memo("inf_count", lambda: self.counts[:, INF])

    @property
    def zero_count(self) -> torch.Tensor:
        """Elements equal to zero per row (int64 ``[n]``)."""
        return self._memo("zero_count", lambda: self.counts[:, ZERO])

    @property
    def zero_fraction(self) -> torch.Tensor:
        """Fraction of elements equal to zero per row (float64 ``[n]``); 0 for an empty tensor."""
        return self._memo("zero_fraction", lambda: self.zero_count.to(self.floats.dtype) / self.numel.clamp(min=1))

    @property
    def nonfinite(self) -> torch.Tensor:
        """Whether any gradient holds a NaN or an Inf element (0-d bool); with ``group=``, over
        the group."""
        return self._memo("nonfinite", self._nonfinite)

    def _nonfinite(self) -> torch.Tensor:
        if self._group_nonfinite is not None:
            return self._group_nonfinite
        if self._pending_rows is not None:  # a NaN/Inf element made the total NaN/Inf
            return ~torch.isfinite(self.plain_total_norm)
        return (self.counts[:, NAN] + self.counts[:, INF]).sum() > 0

    @property
    def clipped(self) -> torch.Tensor | None:
        """After clipping: whether it scaled the gradients (0-d bool; per row for ``per=``; for
        ``value=``, whether clamping changed a row); None before clipping."""
        return self._memo("clipped", self._clipped)

    def _clipped(self) -> torch.Tensor | None:
        if self.clip_coef is None:
            return None if self.clamped is None else self.clamped > 0
        return ~(self.clip_coef >= 1)  # a NaN coefficient scaled the gradients too

    def headroom_dict(self) -> dict[str, dict[str, float]]:
        """``headroom`` as {name: {column: value}}, read in one transfer."""
        if self.headroom is None:
            raise ValueError("no exponent histogram: take the stats with histogram=True")
        return columns_to_host(self.names, self.headroom)

    def norm(self, norm_type: float | None = None) -> torch.Tensor:
        """Per-parameter norm of order ``norm_type`` (default: this object's), float64, as
        ``torch.linalg.vector_norm`` of each gradient. Orders other than 0, 2 and inf need the
        stats to have been taken with that ``norm_type``."""
        p = self.norm_type if norm_type is None else float(norm_type)
        if p == 2.0:
            return self.l2
        if p == math.inf:
            return self.linf
        if p == 0.0:
            return (self.numel - self.zero_count).to(self.floats.dtype)
        if p != self.norm_type:
            raise ValueError(f"per-parameter norms of order {p} need gradfuse.stats(..., "
                             f"norm_type={p}); these stats were taken with norm_type={self.norm_type}")
        if p == 1.0 or p == -math.inf:  # POWSUM holds sum |x| / min |x|
            return self.floats[:, POWSUM]
        return self.floats[:, POWSUM].pow(1.0 / p)

    # Host side: one transfer, cached.
    def _pack(self) -> tuple[list[torch.Tensor], list[str], list[str], int]:
        """What ``_host`` reads, as device tensors: the packed float rows and scalars (and the
        int64 count rows when the floats are not float64), the names of the packed columns, the
        count names, and the number of per-row extras."""
        dev, fdt = self.floats.device, self.floats.dtype
        # float64 holds every count exactly: one transfer. In float32 (a device without
        # float64) the counts go in a second, int64 transfer.
        exact = fdt == torch.float64
        scalars = [self.plain_total_norm.to(dev, fdt).reshape(1), self.nonfinite.to(dev, fdt).reshape(1)]
        per_row = self.clip_coef is not None and self.clip_coef.dim() == 1
        if self.clip_coef is not None:  # per row: the smallest coefficient as the summary
            coef = ((self.clip_coef.amin() if len(self) else self.clip_coef.new_ones(())) if per_row
                    else self.clip_coef)
            scalars.append(coef.to(dev, fdt).reshape(1))
        extra = [self.clip_coef] if per_row else []
        extra += [self.clamped] if self.clamped is not None and exact else []
        scalars += [x.to(dev, fdt).reshape(-1) for x in extra]
        floats = [st.name for st in STATISTICS if not st.count]
        ints = [st.name for st in STATISTICS if st.count]
        names = floats + ints if exact else floats
        cols = [getattr(self, name).to(fdt) for name in names]
        tensors = [torch.cat([torch.stack(cols, 1).reshape(-1)] + scalars)]
        if not exact:
            int_rows = torch.stack([getattr(self, name) for name in ints], 1)
            if self.clamped is not None:
                int_rows = torch.cat([int_rows, self.clamped.to(int_rows.device).reshape(-1, 1)], 1)
            tensors.append(int_rows)
        return tensors, names, ints, len(extra)

    def start_host_copy(self) -> None:
        """Starts copying what ``to_dict`` reads to host memory without waiting for the device
        (pinned memory and an event on CUDA); ``to_dict``, ``layers``, ``table`` and
        ``nonfinite_names`` then read that copy. The monitor that never blocks does this on the
        step, and reads the copy one step later.

        Example:
            ```python
            s = gradfuse.stats(model)
            s.start_host_copy()      # no wait
            ...                      # later: reading s waits for nothing
            print(s.to_dict()["total_norm"])
            ```
        """
        if self._host_cache is None and self._host_copy is None:
            tensors, *layout = self._pack()
            self._host_copy = (HostCopy(tensors), layout)

    def _host(self) -> dict:
        if self._host_cache is None:
            n = len(self.names)
            if self._host_copy is not None:
                copy, (names, ints, n_extra) = self._host_copy
                host = copy.get()
            else:
                tensors, names, ints, n_extra = self._pack()
                host = [t.cpu() for t in tensors]
            exact = len(host) == 1
            packed = host[0].tolist()
            width = len(names)
            rows = [dict(zip(names, packed[i * width:(i + 1) * width])) for i in range(n)]
            clamped = None
            if not exact:
                int_rows = host[1].tolist()
                for r, i in zip(rows, int_rows):
                    r.update(zip(ints, i))
                clamped = [i[len(ints)] for i in int_rows] if self.clamped is not None else None
            per_row = self.clip_coef is not None and self.clip_coef.dim() == 1
            tail = packed[n * width:]
            ncoef = 1 if self.clip_coef is not None else 0
            extra_rows = [tail[2 + ncoef + k * n:2 + ncoef + (k + 1) * n] for k in range(n_extra)]
            if self.clamped is not None and exact:
                clamped = extra_rows[-1]
            self._host_cache = {
                "row_coef": extra_rows[0] if per_row else None,
                "row_clamped": clamped,
                "rows": rows,
                "total_norm": tail[0],
                "nonfinite": bool(tail[1]),
                "clip_coef": tail[2] if self.clip_coef is not None else None,
            }
        return self._host_cache

    def to_dict(self) -> dict:
        """All statistics as Python numbers, read in one transfer.

        Returns:
            dict: ``{"total_norm", "norm_type", "nonfinite", "scope", "clip_coef", "clipped",
                "max_norm", "params": {name: {numel, l2, linf, mean, nan_count, inf_count,
                zero_count, zero_fraction}}}``; after ``per=`` each row also has ``clip_coef`` and
                ``clipped``, and the dict ``clip_per`` and ``clipped_params``; after ``value=`` each row
                has ``clamped`` and ``clipped``, and the dict ``clip_value``, ``clamped`` and
                ``clipped_params``.
        """
        h = self._host()
        params = {}
        for name, row in zip(self.names, h["rows"]):
            params[name] = {st.name: int(row[st.name]) if st.count else row[st.name] for st in STATISTICS}
        extra = {}
        if h["row_coef"] is not None:  # per-parameter / per-layer clipping
            for name, c in zip(self.names, h["row_coef"]):
                params[name].update(clip_coef=c, clipped=not (c >= 1))
            extra = {"clip_per": self.clip_per,
                     "clipped_params": sum(1 for c in h["row_coef"] if not c >= 1)}
        if h["row_clamped"] is not None:  # clipping by value
            for name, k in zip(self.names, h["row_clamped"]):
                params[name].update(clamped=int(k), clipped=k > 0)
            extra = {"clip_value": self.clip_value, "clamped": int(sum(h["row_clamped"])),
                     "clipped_params": sum(1 for k in h["row_clamped"] if k > 0)}
        coef = h["clip_coef"]
        return {
            "total_norm": h["total_norm"],
            "norm_type": self.norm_type,
            "nonfinite": h["nonfinite"],
            "scope": self.scope,
            "clip_coef": coef,
            "clipped": None if coef is None else not (coef >= 1),
            "max_norm": self.max_norm,
            "params": params,
            **extra,
        }

    def layers(self, depth: int | None = None) -> dict[str, dict]:
        """Statistics aggregated by layer, from the fused per-parameter results (no new pass):
        l2 of the concatenated gradients, max linf, summed counts, overall mean and zero fraction.
        A layer is the module path up to the first block index (``transformer.h.3`` for
        ``transformer.h.3.attn.c_attn.weight``, ``lm_head`` for ``lm_head.weight``), or with
        ``depth`` the first ``depth`` name parts (``layers.3`` at depth 2)."""
        out: dict[str, dict] = {}
        for name, r in self.to_dict()["params"].items():
            key = layer_of(name, depth)
            agg = out.setdefault(key, {"numel": 0, "sumsq": 0.0, "linf": 0.0, "sum": 0.0,
                                       "nan_count": 0, "inf_count": 0, "zero_count": 0,
                                       "params": 0})
            agg["numel"] += r["numel"]
            agg["sumsq"] += r["l2"] ** 2
            agg["linf"] = r["linf"] if math.isnan(r["linf"]) or r["linf"] > agg["linf"] else agg["linf"]
            agg["sum"] += r["mean"] * r["numel"]
            agg["nan_count"] += r["nan_count"]
            agg["inf_count"] += r["inf_count"]
            agg["zero_count"] += r["zero_count"]
            agg["params"] += 1
        for agg in out.values():
            n = max(agg["numel"], 1)
            agg["l2"] = math.sqrt(agg.pop("sumsq"))
            agg["mean"] = agg.pop("sum") / n
            agg["zero_fraction"] = agg["zero_count"] / n
        return out

    def nonfinite_names(self) -> list[str]:
        """Names of the parameters whose gradient holds a NaN or an Inf.

        Returns:
            list[str]: In row order; empty when every gradient is finite.
        """
        return [name for name, row in zip(self.names, self._host()["rows"]) if row["nan_count"] or row["inf_count"]]

    def table(self, top: int | None = None, sort_by: str = "l2") -> str:
        """A fixed-width table of the per-parameter statistics, largest ``sort_by`` first
        (NaN first of all), limited to ``top`` rows, with the totals below."""
        if sort_by not in PER_PARAM_FIELDS:
            raise ValueError(f"sort_by must be one of {PER_PARAM_FIELDS}, got {sort_by!r}")
        d = self.to_dict()
        return text_table(d, STATISTICS, sort_by, top, self.nonfinite_names() if d["nonfinite"] else [])

    def _repr_html_(self, max_rows: int = 100) -> str:
        """Jupyter's view: the rows of ``to_dict`` as an HTML table (largest ``l2`` first,
        at most ``max_rows``), the totals below; one transfer."""
        return html_table(self.to_dict(), type(self).__name__, PER_PARAM_FIELDS, max_rows)

    def __repr__(self) -> str:
        return (f"GradStats({len(self.names)} parameters, norm_type={self.norm_type}, "
                f"device={self.floats.device})")


def with_shared_names(names: list[str], *args, **kwargs) -> GradStats:
    """``GradStats(names, *args, **kwargs)`` for ``names`` that the caller keeps and never changes
    in place (a plan's row names): the result's own copy is made when its ``names`` are first
    read, not on every step (a step that reads no name costs no copy of 10 000 of them)."""
    s = GradStats(names, *args, **kwargs)
    s._names_own = False
    return s

