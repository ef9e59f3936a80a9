"""The series of a flight-recorder dump and their bands: the arithmetic behind
:func:`gradfuse.viz.explain.explain` and its picture (the method is in that module's docstring).

``Series`` reads a dump's arrays into Python lists; ``band_traces`` computes, for every quantity and
layer recorded, per step whether the value left its band, its ``z`` and the band (``Trace``);
``first_departure`` finds where a series first left its band.

Layer: viz. Imports ``gradfuse.monitor``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from gradfuse.monitor.flight_dump import FlightDump, load_dump

__all__ = ["DEFAULTS", "QUANTITIES", "REQUIRED_ARRAYS", "REQUIRED_HEADER", "STD_FLOOR", "Series", "Trace",
           "armed_steps", "as_dump", "band_trace", "band_traces", "check_dump", "first_departure",
           "nan_is_nonfinite", "when_text"]

# Each quantity: (its total in ``scalars`` or None, its per-layer field in ``layers`` or None).
QUANTITIES = {"act_rms": (None, "act_rms"), "loss": ("loss", None), "grad_norm": ("grad_norm", "grad_l2"),
              "update_norm": ("update_norm", "update_rms")}
DEFAULTS = {"window": 128, "sigma": 6.0}
STD_FLOOR = 1e-3
REQUIRED_ARRAYS = ("steps", "scalars", "layers")
REQUIRED_HEADER = ("step", "trigger", "layers", "layer_fields", "scalar_fields")


def when_text(steps_before: int) -> str:
    """``"at the trigger"``, ``"3 steps before"`` or ``"2 steps after the trigger"``."""
    if steps_before == 0:
        return "at the trigger"
    k = abs(steps_before)
    return f"{k} step{'s' if k != 1 else ''} " + ("before" if steps_before > 0 else "after the trigger")


def as_dump(dump) -> tuple[FlightDump, str | None]:
    """The dump (a path is loaded) and its path (``None`` for a ``FlightDump``)."""
    if isinstance(dump, FlightDump):
        return dump, None
    return load_dump(dump), os.fspath(dump)


def check_dump(dump: FlightDump, path: str | None) -> None:
    """Raises ``ValueError`` when ``dump`` lacks an array or header entry, or an array's shape
    disagrees with its header."""
    where = path or "flight dump"
    missing = [k for k in REQUIRED_ARRAYS if k not in dump.arrays]
    missing += [f"header {k!r}" for k in REQUIRED_HEADER if k not in dump.header]
    if missing:
        raise ValueError(f"{where}: not a complete flight-recorder dump (missing {', '.join(missing)})")
    if not isinstance(dump.header["step"], int) or isinstance(dump.header["step"], bool):
        raise ValueError(f"{where}: the header's step is {dump.header['step']!r}, not a step number")
    n = dump.arrays["steps"].shape[0]
    s, L, F = len(dump.header["scalar_fields"]), len(dump.header["layers"]), len(dump.header["layer_fields"])
    shapes = {"scalars": (n, s), "layers": (n, L, F)}
    if "spike" in dump.arrays:
        shapes["spike"] = (n, len(dump.header.get("spike_quantities", ["loss", "grad_norm", "update_norm"])))
    for name, shape in shapes.items():
        if tuple(dump.arrays[name].shape) != shape:
            raise ValueError(f"{where}: array {name!r} has shape {tuple(dump.arrays[name].shape)}, "
                             f"the header says {shape}")


class Series:
    """The recorded series of a dump, up to the trigger, as Python lists."""

    def __init__(self, dump: FlightDump):
        h, a = dump.header, dump.arrays
        self.header = h
        steps = [int(s) for s in a["steps"].tolist()]
        self.trigger = int(h["step"])
        self.steps = steps
        self.n = len(steps)
        # recorded steps up to and including the trigger (the history the bands have before it)
        self.upto = sum(1 for s in steps if s <= self.trigger)
        # where the recorder's own bands apply: the trigger step, when the buffer holds it
        self.trigger_index = self.upto - 1 if self.upto and steps[self.upto - 1] == self.trigger else None
        self.layers = list(h["layers"])
        scal = a["scalars"].double().tolist()
        self.scalar_fields = list(h["scalar_fields"])
        self.scalars = {f: [row[j] for row in scal] for j, f in enumerate(self.scalar_fields)}
        lay = a["layers"].double().tolist()
        self.layer_fields = list(h["layer_fields"])
        self.per_layer = {f: {name: [row[i][j] for row in lay] for i, name in enumerate(self.layers)}
                          for j, f in enumerate(self.layer_fields)}
        self.spike = {}
        if "spike" in a:
            sp = a["spike"].bool().tolist()
            for j, q in enumerate(h.get("spike_quantities", ["loss", "grad_norm", "update_norm"])):
                self.spike[q] = [bool(row[j]) for row in sp]
        cfg = h.get("config") or {}
        self.window = int(cfg.get("window") or DEFAULTS["window"])
        self.sigma = float(cfg.get("sigma") or DEFAULTS["sigma"])
        self.bands = h.get("bands") or {}

    def scalar(self, name: str) -> list[float] | None:
        """The series of a scalar field, or ``None`` when not in the dump."""
        return self.scalars.get(name)

    def layer_field(self, name: str) -> dict[str, list[float]] | None:
        """``{layer: series}`` of a per-layer field, or ``None`` when not in the dump."""
        return self.per_layer.get(name)


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var)


@dataclass
class Trace:
    """Per recorded step: out of band or not, ``z``, and the band's mean and standard deviation."""

    out: list[bool]
    z: list[float]
    mean: list[float]
    std: list[float]


def band_trace(values: list[float], n: int, window: int, sigma: float, min_history: int,
           nonfinite_nan: list[bool] | None = None, forced: list[bool] | None = None,
           trigger_band: dict | None = None, trigger_index: int | None = None) -> Trace:
    """Per recorded step up to ``n``: out of band or not, z, and the band (see the module doc)."""
    out, zs, means, stds = [False] * n, [math.nan] * n, [math.nan] * n, [math.nan] * n
    for i in range(n):
        x = values[i]
        if math.isnan(x) and not (nonfinite_nan and nonfinite_nan[i]):
            continue  # not recorded at this step
        history = [values[j] for j in range(max(0, i - window), i) if math.isfinite(values[j]) and not out[j]]
        mean = std = math.nan
        if len(history) >= min_history:
            mean, std = _mean_std(history)
        elif i == trigger_index and trigger_band and int(trigger_band.get("count") or 0) >= min_history \
                and math.isfinite(trigger_band.get("mean", math.nan)) \
                and math.isfinite(trigger_band.get("std", math.nan)):
            mean, std = float(trigger_band["mean"]), float(trigger_band["std"])
        means[i], stds[i] = mean, std
        if not math.isfinite(x):
            zs[i], out[i] = math.inf, True
            continue
        if math.isfinite(mean):
            scale = max(std, STD_FLOOR * abs(mean))
            z = (x - mean) / scale if scale > 0 else (math.inf if x > mean else 0.0)
            zs[i] = z
            out[i] = z > sigma
        if forced and forced[i]:
            out[i] = True  # z stays NaN without a band
    return Trace(out, zs, means, stds)


def first_departure(trace: Trace, n: int, start: int) -> int | None:
    """The index where ``trace`` first left its band from ``start`` on, followed back to the start
    of its run of out-of-band steps; ``None`` when it stayed in its band."""
    first = next((i for i in range(start, n) if trace.out[i]), None)
    if first is None:
        return None
    i = first
    while i > 0:  # back to the start of the run of out-of-band steps (missing values do not end it)
        j = i - 1
        while j >= 0 and math.isnan(trace.z[j]) and not trace.out[j]:
            j -= 1
        if j < 0 or not trace.out[j]:
            break
        i = j
    return i




def nan_is_nonfinite(series: Series, values: list[float], counts: list[float] | None, need_earlier: bool) -> list[bool]:
    """Per step, whether a NaN in ``values`` there would be a non-finite value rather than "not
    recorded": ``counts`` positive there, and with ``need_earlier`` a value recorded before."""
    out = []
    seen = False
    for i in range(series.n):
        c = counts[i] if counts is not None else math.nan
        out.append(bool(math.isfinite(c) and c > 0 and (seen or not need_earlier)))
        seen = seen or math.isfinite(values[i])
    return out


def armed_steps(series: Series) -> list[float]:
    """Per step, 1.0 where any layer's activation RMS was recorded (an armed step), else 0.0."""
    act = series.layer_field("act_rms") or {}
    return [float(any(math.isfinite(v[i]) for v in act.values())) for i in range(series.n)]


def band_traces(series: Series, min_history: int) -> dict:
    """{quantity: (total (values, trace) or None, {layer: (values, trace)})} for each quantity
    that has any value in the buffer."""
    n, w, sg = series.n, series.window, series.sigma
    nonfinite = series.scalar("nonfinite")
    grad_nf = series.layer_field("grad_nonfinite")
    armed = armed_steps(series)
    skipped = series.scalar("skipped")
    out = {}
    for q, (total_name, layer_field) in QUANTITIES.items():
        total, layers = None, {}
        values = series.scalar(total_name) if total_name else None
        if values is not None:
            values = list(values)
            if q == "update_norm" and skipped is not None:  # a skipped step makes no update
                values = [math.nan if s == 1.0 else v for v, s in zip(values, skipped)]
            nf = None
            if q in ("grad_norm", "loss"):
                nf = nan_is_nonfinite(series, values, nonfinite, need_earlier=(q == "loss"))
            if any(math.isfinite(v) or (nf and nf[i]) for i, v in enumerate(values[:n])):
                total = (values, band_trace(values, n, w, sg, min_history, nf, series.spike.get(q),
                                        series.bands.get(q), series.trigger_index))
        per_layer = series.layer_field(layer_field) if layer_field else None
        if per_layer is not None:
            for name, values in per_layer.items():
                values = list(values)
                if q == "update_norm" and skipped is not None:
                    values = [math.nan if s == 1.0 else v for v, s in zip(values, skipped)]
                nf = None
                if q == "grad_norm" and grad_nf is not None:
                    nf = nan_is_nonfinite(series, values, grad_nf[name], need_earlier=False)
                elif q == "act_rms":
                    nf = nan_is_nonfinite(series, values, armed, need_earlier=True)
                if any(math.isfinite(v) or (nf and nf[i]) for i, v in enumerate(values[:n])):
                    layers[name] = (values, band_trace(values, n, w, sg, min_history, nf))
        if total is not None or layers:
            out[q] = (total, layers)
    return out
