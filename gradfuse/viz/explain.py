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

The series and their bands are computed in ``gradfuse.viz.bands``, the picture is drawn in
``gradfuse.viz.explain_plot``.

Layer: viz. Imports ``gradfuse.viz.bands`` and ``gradfuse.viz.explain_plot``; matplotlib on first
use (plot).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from gradfuse.viz import explain_plot
from gradfuse.viz.bands import (
    QUANTITIES,
    Series,
    Trace,
    armed_steps,
    as_dump,
    band_traces,
    check_dump,
    first_departure,
    nan_is_nonfinite,
    when_text,
)

__all__ = ["Departure", "Diagnosis", "Event", "NonFiniteOrigin", "dump_figure", "explain", "plot_dump"]

# Ties at one step, in the order a training step computes them.
ORDER = list(QUANTITIES)


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
                when = when_text(e.steps_before)
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
            at = f"step {nf.step} ({when_text(self.step - nf.step)}), {where}" if nf.step is not None else ""
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


def _departure(series: Series, trace: Trace, values: list[float], i: int, layer: str | None) -> Departure:
    step = series.steps[i]
    return Departure(layer=layer, step=step, steps_before=series.trigger - step, z=trace.z[i], value=values[i],
                     mean=trace.mean[i], std=trace.std[i])


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
    dump, path = as_dump(dump)
    check_dump(dump, path)
    series = Series(dump)
    trigger = series.header.get("trigger") or {}
    n, start = series.n, max(0, series.upto - lookback)
    traces = band_traces(series, min_history)
    events = []
    for q, (total, layers) in traces.items():
        t_dep = None
        if total is not None:
            i = first_departure(total[1], n, start)
            if i is not None:
                t_dep = _departure(series, total[1], total[0], i, None)
        l_deps = []
        for name, (values, trace) in layers.items():
            i = first_departure(trace, n, start)
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


def _nonfinite_origin(series: Series, trigger: dict) -> NonFiniteOrigin | None:
    traced = trigger.get("first_nonfinite")
    counts = series.layer_field("grad_nonfinite") or {}
    total = series.scalar("nonfinite")
    act = series.layer_field("act_rms") or {}
    act_nf = {name: nan_is_nonfinite(series, v, armed_steps(series), need_earlier=True) for name, v in act.items()}
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


def dump_figure(dump, window: int | None = None, *, lookback: int = 16, min_history: int = 5):
    """The figure :func:`plot_dump` draws (a matplotlib ``Figure``), of a dump's path or a
    ``FlightDump``; ``lookback`` and ``min_history`` as for :func:`explain`."""
    pyplot = explain_plot.pyplot()  # matplotlib first: without it no dump is read
    dump, path = as_dump(dump)
    check_dump(dump, path)
    diagnosis = explain(dump, lookback=lookback, min_history=min_history)
    return explain_plot.figure(pyplot, dump, diagnosis, window=window, min_history=min_history)
