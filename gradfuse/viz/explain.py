"""What a flight-recorder dump says about a spike: which quantity left its band first, in which
layers, how many steps before the trigger, and in what order the others followed.

``explain(dump)`` returns the diagnosis as data (:class:`Diagnosis`); ``Diagnosis.text()`` is what
``python -m gradfuse explain DUMP`` prints and ``Diagnosis.to_dict()`` what ``--json`` prints;
``plot_dump(dump, path)`` draws the traces around the trigger with their bands (``--plot``).

How a departure is found. Each quantity is a series over the recorded steps, oldest first (when
a dump holds steps after its trigger, they are diagnosed too, with a negative ``steps_before``).
The totals ``loss``, ``grad_norm`` and ``update_norm`` come from the dump's ``scalars``; the
per-layer series from its ``layers`` array: ``grad_l2`` (the layers of ``grad_norm``),
``update_rms`` (the layers of ``update_norm``) and ``act_rms`` (a per-layer quantity only).

At each recorded step the band of a series is ``mean +- sigma * std`` (``std`` unbiased) of its
values at the ``window`` recorded steps before it, leaving out the values that are missing or were
themselves outside their band, so a series that stays high is measured against its level before
the jump. ``window`` and ``sigma`` are the recorder's (the dump's ``config``). A band needs
``min_history`` values (default 5), fewer than the recorder's warm-up because a buffer holds only
K steps: the earliest part of the buffer is the baseline. ``std`` is floored at ``1e-3 * |mean|``
so that a constant series does not make every rounding difference a departure. Where the buffer
holds too few values before the trigger, the totals there use the recorder's own bands (the
header's ``bands``, over its longer history) when those hold ``min_history`` values. Every step is
otherwise measured against the buffer, the totals as their layers: the recorder's band, over up to
``window`` steps the buffer may not hold, can be much wider early in training (its spike marks
still count, below).

A value leaves its band when it is above it (upward only, as in the recorder's spike rule: a drop
is no departure), when the recorder marked it a spike (the ``spike`` array), or when it is
non-finite: ``+-inf``, or a ``NaN`` the dump shows to be a value: ``grad_norm`` on a step with a
``nonfinite`` count, a layer's ``grad_l2`` with a ``grad_nonfinite`` count, ``loss`` on a step with
a ``nonfinite`` count once the loss was recorded, a layer's ``act_rms`` recorded before on a step
where another layer's was recorded. Any other ``NaN`` means "not recorded"; a step the monitor
skipped made no update.

The event of a quantity is its first departure (of the total or of any of its layers) from the
``lookback``-th recorded step before the trigger on (default 16: the trigger, the 15 steps before
it and any after it); when the series was already out of its band just before that span, the
event starts where that run of out-of-band steps began. Events are ordered by step; at one step in
the order a training step computes them: ``act_rms``, ``loss``, ``grad_norm``, ``update_norm``.
A layer's first departure is found the same way; an event's layers are sorted by first departure,
then by ``z``, largest first.

Layer: viz. Imports ``gradfuse.monitor`` and ``gradfuse.utils``; matplotlib on first use (plot).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from gradfuse.monitor.flight_dump import FlightDump, load_dump
from gradfuse.utils import require

__all__ = ["Departure", "Diagnosis", "Event", "NonFiniteOrigin", "dump_figure", "explain", "plot_dump"]

# Each quantity: (its total in ``scalars`` or None, its per-layer field in ``layers`` or None).
QUANTITIES = {"act_rms": (None, "act_rms"), "loss": ("loss", None), "grad_norm": ("grad_norm", "grad_l2"),
              "update_norm": ("update_norm", "update_rms")}
# Ties at one step, in the order a training step computes them.
ORDER = list(QUANTITIES)
DEFAULTS = {"window": 128, "sigma": 6.0}
STD_FLOOR = 1e-3
REQUIRED_ARRAYS = ("steps", "scalars", "layers")
REQUIRED_HEADER = ("step", "trigger", "layers", "layer_fields", "scalar_fields")


@dataclass
class Departure:
    """Where one series first left its band.

    Attributes:
        layer: The layer (as the dump's ``layers`` names it), or ``None`` for the total.
        step: The step it left its band.
        steps_before: The trigger step minus ``step`` (negative after the trigger).
        z: ``(value - mean) / std`` against its band there; ``inf`` for a non-finite value;
            ``nan`` for a spike the recorder marked where the buffer holds too few values for a
            band.
        value: The value there (``inf`` or ``nan`` when non-finite).
        mean: The band's centre there (``nan`` without a band).
        std: The band's standard deviation there (``nan`` without a band).
    """

    layer: str | None
    step: int
    steps_before: int
    z: float
    value: float
    mean: float
    std: float


@dataclass
class Event:
    """A quantity that left its band before or at the trigger.

    Attributes:
        quantity: ``"update_norm"``, ``"grad_norm"``, ``"loss"`` or ``"act_rms"``.
        step: The first step it left its band (its total or any of its layers).
        steps_before: The trigger step minus ``step`` (negative after the trigger).
        z: The z-score at ``step`` of what left the band then: the total when it did, else the
            first of ``layers``.
        total: The total's departure (``None`` when the total stayed in its band, or for
            ``act_rms``, which has no total).
        layers: The layers that left their band, by first departure, then ``z`` (largest first).
    """

    quantity: str
    step: int
    steps_before: int
    z: float
    total: Departure | None = None
    layers: list[Departure] = field(default_factory=list)


@dataclass
class NonFiniteOrigin:
    """Where the first non-finite value came from.

    Attributes:
        step: The first step with non-finite gradients or activations in the buffer (``None``
            when none has).
        module: The module that produced the first non-finite value, when it was traced (the
            trigger's ``first_nonfinite``), else ``None``.
        phase: ``"forward"`` or ``"backward"`` when traced, else ``None``.
        layers: The layers whose gradients held non-finite values at ``step``.
        traced: Whether ``module`` comes from a trace.
        activations: The layers whose activation RMS was non-finite at ``step`` (on a step the
            activations were recorded), in the dump's layer order: without a trace, the first of
            them is the nearest the dump comes to the module that made the value (a non-finite
            activation reaches every layer after it, and the backward pass every gradient).
    """

    step: int | None
    module: str | None
    phase: str | None
    layers: list[str]
    traced: bool
    activations: list[str] = field(default_factory=list)


@dataclass
class Diagnosis:
    """The explanation of a flight-recorder dump (see the module docstring for the method).

    Attributes:
        step: The trigger step.
        kind: What triggered the dump: ``"spike"``, ``"nonfinite"``, ``"explode"`` or ``"manual"``.
        anomalies: The anomalies of the trigger step.
        message: The trigger's message.
        quantities: The spike quantities that tripped at the trigger (may be empty).
        events: The quantities that left their band, in the order they left it.
        nonfinite: Where the first non-finite value came from, or ``None`` when no gradient was
            non-finite and none was traced.
        history: Recorded steps up to and including the trigger.
        enough_history: Whether the buffer held ``min_history`` steps before the trigger.
        missing: The quantities with no value in the buffer (not recorded, not diagnosed).
        window: The band's window (recorded steps).
        sigma: The band's half-width in standard deviations.
        min_history: Values a band needs.
        lookback: Recorded steps up to the trigger in which departures are looked for.
        path: The dump's file, when read from one.
    """

    step: int
    kind: str
    anomalies: list[str]
    message: str
    quantities: list[str]
    events: list[Event]
    nonfinite: NonFiniteOrigin | None
    history: int
    enough_history: bool
    missing: list[str]
    window: int
    sigma: float
    min_history: int
    lookback: int
    path: str | None = None

    def first(self) -> Event | None:
        """The event that came first, or ``None``."""
        return self.events[0] if self.events else None

    def to_dict(self) -> dict:
        """The diagnosis as plain JSON data (``python -m gradfuse explain --json``): non-finite
        numbers (an infinite ``z``, a ``NaN`` value) become ``None``."""
        return _jsonable(asdict(self))

    def text(self) -> str:
        """The explanation ``python -m gradfuse explain`` prints: the trigger, then which quantity
        left its band first, in which layers, how many steps before, and the order of the others,
        then where the first non-finite value came from."""
        head = f"step {self.step}: {self.kind}"
        if self.quantities:
            head += f" ({', '.join(self.quantities)})"
        elif self.anomalies and self.anomalies != [self.kind]:
            head += f" ({', '.join(self.anomalies)})"
        lines = []
        if self.events:
            parts = []
            for i, e in enumerate(self.events):
                when = _when(e.steps_before)
                where = f"step {e.step}, {_z(e.z)}"
                if QUANTITIES[e.quantity][0] is not None and _total_differs(e):
                    where += ("; the total within its band" if e.total is None else
                              f"; the total from step {e.total.step}, {_z(e.total.z)}")
                if i == 0:
                    s = f"{e.quantity} left its band first, {when} ({where})"
                elif e.step == self.events[i - 1].step:
                    s = f"then {e.quantity} at the same step ({where})"
                else:
                    s = f"then {e.quantity}, {when} ({where})"
                if e.layers:
                    s += ", in " + _layers_text(e)
                parts.append(s)
            lines.append(head + ". " + "; ".join(parts) + ".")
        elif self.enough_history:
            lines.append(head + f". No quantity left its band in the {min(self.lookback, self.history)} "
                                "recorded steps up to the trigger.")
        else:
            lines.append(head + ".")
        if not self.enough_history:
            k = max(self.history - 1, 0)
            lines.append(f"Not enough history: {k} recorded step{'s' if k != 1 else ''} before the trigger, "
                         f"{self.min_history} needed for a band; only the recorder's own spike marks and "
                         "bands, and non-finite values, are used.")
        nf = self.nonfinite
        if nf is not None:
            if nf.activations:
                where = f"in the activations of {', '.join(nf.activations)}"
                where += f" and the gradients of {', '.join(nf.layers)}" if nf.layers else ""
            else:
                where = f"in the gradients of {', '.join(nf.layers) or 'no single layer'}"
            at = f"step {nf.step} ({_when(self.step - nf.step)}), {where}" if nf.step is not None else ""
            if nf.traced:
                s = f"The first non-finite value came from {nf.module} ({nf.phase})"
                s += f"; non-finite values at {at}." if at else "."
            else:
                s = f"Non-finite values first at {at} (the module was not traced)."
            lines.append(s)
        if self.missing:
            lines.append(f"Not recorded: {', '.join(self.missing)}.")
        return "\n".join(lines)


def _total_differs(event: Event) -> bool:
    """Whether an event's total left its band later than the event's first layer, or never."""
    return event.total is None or event.total.step != event.step


def _jsonable(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _when(steps_before: int) -> str:
    if steps_before == 0:
        return "at the trigger"
    k = abs(steps_before)
    return f"{k} step{'s' if k != 1 else ''} " + ("before" if steps_before > 0 else "after the trigger")


def _z(z: float) -> str:
    if math.isnan(z):
        return "marked a spike by the recorder, no band here"
    if math.isinf(z):
        return "non-finite"
    return f"z={z:.1f}" if abs(z) < 1e4 else f"z={z:.3g}"


def _layers_text(event: Event, most: int = 4) -> str:
    out = []
    for d in event.layers[:most]:
        s = d.layer
        bits = [] if d.step == event.step else [f"step {d.step}"]
        bits.append(_z(d.z))
        out.append(f"{s} ({', '.join(bits)})")
    if len(event.layers) > most:
        out.append(f"and {len(event.layers) - most} more")
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------
# The dump as series


def _as_dump(dump) -> tuple[FlightDump, str | None]:
    if isinstance(dump, FlightDump):
        return dump, None
    return load_dump(dump), os.fspath(dump)


def _check(dump: FlightDump, path: str | None) -> None:
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


class _Series:
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
        return self.scalars.get(name)

    def layer_field(self, name: str) -> dict[str, list[float]] | None:
        return self.per_layer.get(name)


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var)


@dataclass
class _Trace:
    out: list[bool]
    z: list[float]
    mean: list[float]
    std: list[float]


def _trace(values: list[float], n: int, window: int, sigma: float, min_history: int,
           nonfinite_nan: list[bool] | None = None, forced: list[bool] | None = None,
           trigger_band: dict | None = None, trigger_index: int | None = None) -> _Trace:
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
    return _Trace(out, zs, means, stds)


def _first_departure(trace: _Trace, n: int, start: int) -> int | None:
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


def _departure(series: _Series, trace: _Trace, values: list[float], i: int, layer: str | None) -> Departure:
    step = series.steps[i]
    return Departure(layer=layer, step=step, steps_before=series.trigger - step, z=trace.z[i], value=values[i],
                     mean=trace.mean[i], std=trace.std[i])


def _nonfinite_nan(series: _Series, values: list[float], counts: list[float] | None, need_earlier: bool) -> list[bool]:
    """Per step, whether a NaN in ``values`` there would be a non-finite value rather than "not
    recorded": ``counts`` positive there, and with ``need_earlier`` a value recorded before."""
    out = []
    seen = False
    for i in range(series.n):
        c = counts[i] if counts is not None else math.nan
        out.append(bool(math.isfinite(c) and c > 0 and (seen or not need_earlier)))
        seen = seen or math.isfinite(values[i])
    return out


def _armed(series: _Series) -> list[float]:
    """Per step, 1.0 where any layer's activation RMS was recorded (an armed step), else 0.0."""
    act = series.layer_field("act_rms") or {}
    return [float(any(math.isfinite(v[i]) for v in act.values())) for i in range(series.n)]


def _traces(series: _Series, min_history: int) -> dict:
    """{quantity: (total (values, trace) or None, {layer: (values, trace)})} for each quantity
    that has any value in the buffer."""
    n, w, sg = series.n, series.window, series.sigma
    nonfinite = series.scalar("nonfinite")
    grad_nf = series.layer_field("grad_nonfinite")
    armed = _armed(series)
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
                nf = _nonfinite_nan(series, values, nonfinite, need_earlier=(q == "loss"))
            if any(math.isfinite(v) or (nf and nf[i]) for i, v in enumerate(values[:n])):
                total = (values, _trace(values, n, w, sg, min_history, nf, series.spike.get(q),
                                        series.bands.get(q), series.trigger_index))
        per_layer = series.layer_field(layer_field) if layer_field else None
        if per_layer is not None:
            for name, values in per_layer.items():
                values = list(values)
                if q == "update_norm" and skipped is not None:
                    values = [math.nan if s == 1.0 else v for v, s in zip(values, skipped)]
                nf = None
                if q == "grad_norm" and grad_nf is not None:
                    nf = _nonfinite_nan(series, values, grad_nf[name], need_earlier=False)
                elif q == "act_rms":
                    nf = _nonfinite_nan(series, values, armed, need_earlier=True)
                if any(math.isfinite(v) or (nf and nf[i]) for i, v in enumerate(values[:n])):
                    layers[name] = (values, _trace(values, n, w, sg, min_history, nf))
        if total is not None or layers:
            out[q] = (total, layers)
    return out


def explain(dump, *, lookback: int = 16, min_history: int = 5) -> Diagnosis:
    """Explains a flight-recorder dump: which quantity left its band first, in which layers, how
    many steps before the trigger, and the order in which the others followed (the method is in
    this module's docstring).

    Args:
        dump: A dump's path, or a :class:`~gradfuse.monitor.flight_dump.FlightDump`
            (``gradfuse.load_dump``).
        lookback: Recorded steps up to and including the trigger in which departures are looked
            for (a run out of band that began before them is followed back to its start).
        min_history: Values a band needs; with fewer recorded steps before the trigger the
            diagnosis says there is not enough history.

    Returns:
        The :class:`Diagnosis`.

    Raises:
        ValueError: ``dump`` is not a flight-recorder dump, or lacks its arrays.
    """
    dump, path = _as_dump(dump)
    _check(dump, path)
    series = _Series(dump)
    trigger = series.header.get("trigger") or {}
    n, start = series.n, max(0, series.upto - lookback)
    traces = _traces(series, min_history)
    events = []
    for q, (total, layers) in traces.items():
        t_dep = None
        if total is not None:
            i = _first_departure(total[1], n, start)
            if i is not None:
                t_dep = _departure(series, total[1], total[0], i, None)
        l_deps = []
        for name, (values, trace) in layers.items():
            i = _first_departure(trace, n, start)
            if i is not None:
                l_deps.append(_departure(series, trace, values, i, name))
        l_deps.sort(key=lambda d: (d.step, -d.z if not math.isnan(d.z) else math.inf))
        if t_dep is None and not l_deps:
            continue
        first = min([d.step for d in l_deps] + ([t_dep.step] if t_dep else []))
        z = t_dep.z if t_dep is not None and t_dep.step == first else l_deps[0].z
        events.append(Event(quantity=q, step=first, steps_before=series.trigger - first, z=z, total=t_dep,
                            layers=l_deps))
    events.sort(key=lambda e: (e.step, ORDER.index(e.quantity)))
    missing = [q for q in QUANTITIES if q not in traces]
    return Diagnosis(step=series.trigger, kind=str(trigger.get("kind", "manual")),
                     anomalies=list(trigger.get("anomalies") or []), message=str(trigger.get("message") or ""),
                     quantities=list(trigger.get("quantities") or []), events=events,
                     nonfinite=_nonfinite_origin(series, trigger), history=series.upto,
                     enough_history=series.upto - 1 >= min_history,
                     missing=missing, window=series.window, sigma=series.sigma, min_history=min_history,
                     lookback=lookback, path=path)


def _nonfinite_origin(series: _Series, trigger: dict) -> NonFiniteOrigin | None:
    traced = trigger.get("first_nonfinite")
    counts = series.layer_field("grad_nonfinite") or {}
    total = series.scalar("nonfinite")
    act = series.layer_field("act_rms") or {}
    act_nf = {name: _nonfinite_nan(series, v, _armed(series), need_earlier=True) for name, v in act.items()}
    step, layers, acts = None, [], []
    for i in range(series.n):
        here = [name for name, c in counts.items() if math.isfinite(c[i]) and c[i] > 0]
        acts = [name for name, v in act.items() if math.isinf(v[i]) or (math.isnan(v[i]) and act_nf[name][i])]
        if here or acts or (total is not None and math.isfinite(total[i]) and total[i] > 0):
            step, layers = series.steps[i], here
            break
    if traced:
        phase, module = traced
        return NonFiniteOrigin(step=step, module=str(module), phase=str(phase), layers=layers, traced=True,
                               activations=acts)
    if step is None:
        return None
    return NonFiniteOrigin(step=step, module=None, phase=None, layers=layers, traced=False, activations=acts)


# ---------------------------------------------------------------------------------------------
# The picture


def plot_dump(dump, path: str | os.PathLike, window: int | None = None, *, dpi: int = 100,
              lookback: int = 16) -> str:
    """Draws the traces of a dump around its trigger into ``path`` (PNG): one panel per quantity
    recorded, the totals (loss, grad_norm, update_norm) with their band (mean +- sigma * std, as
    :func:`explain` computes it) and, per layer, ``grad_l2``, ``update_rms`` and ``act_rms``: the
    layers :func:`explain` names in colour with the band of the first of them, the others in grey.
    Departures are dotted, non-finite values marked on the top edge, the trigger step a red line.

    Args:
        dump: A dump's path or a ``FlightDump``.
        path: Where to write the picture.
        window: Recorded steps before the trigger to draw (default: all of them).
        dpi: Resolution.
        lookback: As for :func:`explain` (which layers are named).

    Returns:
        The path written.
    """
    fig = dump_figure(dump, window=window, lookback=lookback)
    import matplotlib.pyplot as plt
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return os.fspath(path)


PANELS = [("loss", "loss", None), ("grad_norm", "total gradient norm", None),
          ("update_norm", "total update norm", None), ("grad_norm", "gradient L2 per layer", "grad_l2"),
          ("update_norm", "update RMS per layer", "update_rms"), ("act_rms", "activation RMS per layer", "act_rms")]


def dump_figure(dump, window: int | None = None, *, lookback: int = 16, min_history: int = 5):
    """The figure :func:`plot_dump` draws (a matplotlib ``Figure``), of a dump's path or a
    ``FlightDump``; ``lookback`` and ``min_history`` as for :func:`explain`."""
    matplotlib = require("matplotlib", "matplotlib", "plot_dump")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradfuse.monitor.figures import FONT

    dump, path = _as_dump(dump)
    _check(dump, path)
    diagnosis = explain(dump, lookback=lookback, min_history=min_history)
    series = _Series(dump)
    traces = _traces(series, min_history)
    events = {e.quantity: e for e in diagnosis.events}
    n = series.n
    lo = 0 if window is None else max(0, series.upto - 1 - window)
    hi = n
    panels = []
    for q, title, field_name in PANELS:
        if q not in traces:
            continue
        total, layers = traces[q]
        if field_name is None and total is not None:
            panels.append((q, title, {None: total}))
        elif field_name is not None and layers:
            panels.append((q, title, layers))
    rows = max(len(panels), 1)
    fig, axes = plt.subplots(rows, 1, figsize=(9, 1.0 + 2.1 * rows), sharex=True, squeeze=False,
                             layout="constrained")
    axes = axes[:, 0]
    colours = plt.get_cmap("tab10").colors
    steps_all = series.steps
    for ax, (q, title, lines) in zip(axes, panels):
        event = events.get(q)
        named = [d.layer for d in event.layers] if event else []
        finite, bands = [], []
        for key, (values, trace) in lines.items():
            xs = steps_all[lo:hi]
            ys = values[lo:hi]
            if key is None:
                style = {"color": "k", "lw": 1.5, "label": q}
                band_of = True
            elif key in named[:len(colours)]:
                style = {"color": colours[named.index(key)], "lw": 1.6, "label": key, "zorder": 3}
                band_of = key == named[0]
            else:
                style = {"color": "0.7", "lw": 0.8, "zorder": 1}
                band_of = False
            shown = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]  # sparse series stay joined
            ax.plot([x for x, _ in shown], [y for _, y in shown], marker=".", ms=3, **style)
            finite += [y for _, y in shown]
            if band_of:
                bx, blo, bhi = [], [], []
                for i in range(lo, n):
                    m, s = trace.mean[i], trace.std[i]
                    if math.isfinite(m) and math.isfinite(s):
                        half = series.sigma * max(s, STD_FLOOR * abs(m))
                        bx.append(steps_all[i])
                        blo.append(m - half)
                        bhi.append(m + half)
                if bx:  # drawn once the scale is known (on a log scale its lower edge is cut)
                    bands.append((bx, blo, bhi, style["color"], f"band of {key or q}: mean ± {series.sigma:g} std"))
            outs = [i for i in range(lo, n) if trace.out[i] and math.isfinite(values[i])]
            if outs and (key is None or key in named):
                ax.scatter([steps_all[i] for i in outs], [values[i] for i in outs], s=28,
                           facecolor="none", edgecolor=style["color"], lw=1.3, zorder=4)
            bad = [steps_all[i] for i in range(lo, n) if trace.out[i] and not math.isfinite(values[i])]
            if bad:
                ax.scatter(bad, [1.0] * len(bad), transform=ax.get_xaxis_transform(), marker="v", s=40,
                           color="tab:red", clip_on=False, zorder=5,
                           label="non-finite" if key is None or key == (named[:1] or [None])[0] else None)
        log = finite and min(finite) > 0 and max(finite) > 10 * min(finite)  # log scale for a jump of 10x or more
        if log:
            ax.set_yscale("log")
        for bx, blo, bhi, colour, label in bands:
            if log:
                blo = [max(v, min(finite) / 2) for v in blo]
            ax.fill_between(bx, blo, bhi, color=colour, alpha=0.15, lw=0, label=label)
        ax.axvline(series.trigger, color="tab:red", ls="--", lw=1.2,
                   label=f"trigger: step {series.trigger} ({diagnosis.kind})" if ax is axes[0] else None)
        if event is not None:
            title += f": left its band {_when(event.steps_before)} (step {event.step})"
        ax.set_title(title, fontsize=FONT["title"], loc="left")
        others = len(lines) - len([k for k in lines if k in named[:len(colours)]])
        if None not in lines and others:
            label = f"other layers ({others})" if named else f"layers ({others}), all within their bands"
            ax.plot([], [], color="0.7", lw=0.8, label=label)
        ax.legend(fontsize=FONT["legend"], loc="best", ncols=2)
        ax.grid(True, which="both", alpha=0.2)
        ax.tick_params(labelsize=FONT["tick"])
    if not panels:
        axes[0].text(0.5, 0.5, "no quantity recorded in this dump", ha="center", va="center",
                     transform=axes[0].transAxes, fontsize=FONT["label"])
    axes[-1].set_xlabel("step", fontsize=FONT["label"])
    first = diagnosis.first()
    head = f"flight recorder, step {diagnosis.step}: {diagnosis.kind}"
    if first is not None:
        head += f"; {first.quantity} left its band first, {_when(first.steps_before)}"
    fig.suptitle(head, fontsize=FONT["title"] + 1)
    return fig
