"""The monitor's sinks as one set: each record fanned out to every sink, and the bookkeeping that
keeps a failing sink from stopping training.

The rule: a sink that raises (a full disk, a closed writer, a metrics client that times out: any
``Exception``) does not stop training or the other sinks. Its first failure warns once, with the
reason; after its k-th consecutive failure it sits out the next ``min(2**(k-1), 64)`` records,
then is tried again; a success resets k. Every record a sink did not write is counted.

Layer: monitor. Imports ``gradfuse.utils`` only.
"""
from __future__ import annotations

from gradfuse.utils import warn

# A failing sink sits out 1, 2, 4, ... records after each consecutive failure, at most this many.
SINK_MAX_BACKOFF = 64


class SinkState:
    """Failure bookkeeping of one sink."""
    __slots__ = ("written", "dropped", "failures", "wait", "warned", "last_error")

    def __init__(self):
        self.written = self.dropped = self.failures = self.wait = 0
        self.warned = False
        self.last_error: str | None = None


class SinkSet:
    """Fan-out to ``sinks`` (a list, shared with its owner: sinks appended to it are written
    too) with the failure rule of this module."""

    def __init__(self, sinks: list):
        self.sinks = sinks
        self._states: dict[int, SinkState] = {}

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def _state(self, sink) -> SinkState:
        return self._states.setdefault(id(sink), SinkState())

    def write(self, record: dict) -> None:
        """Hands ``record`` to every sink, under the rule of this module."""
        for sink in self.sinks:
            st = self._state(sink)
            if st.wait > 0:
                st.wait -= 1
                st.dropped += 1
                continue
            try:
                sink.write(record)
            except Exception as e:  # noqa: BLE001 - monitoring must never end the run
                self._failed(sink, st, e, "write")
                st.wait = min(2 ** (st.failures - 1), SINK_MAX_BACKOFF)
            else:
                st.written += 1
                st.failures = 0

    def start(self, config: dict) -> None:
        """Hands the monitor's configuration to every sink that has ``on_start(config)`` (a
        tracker's run config), once, before the first record; a sink that raises is warned about
        and counted in its ``failures``, never raised."""
        for sink in self.sinks:
            on_start = getattr(sink, "on_start", None)
            if callable(on_start):
                try:
                    on_start(dict(config))
                except Exception as e:  # noqa: BLE001 - monitoring must never end the run
                    self._failed(sink, self._state(sink), e, "start")

    def _failed(self, sink, st: SinkState, error: Exception, what: str) -> None:
        st.failures += 1
        if what == "write":
            st.dropped += 1
        st.last_error = f"{type(error).__name__}: {error}"
        if not st.warned:
            st.warned = True
            warn(f"gradfuse: sink {type(sink).__name__} failed to {what} ({st.last_error}); training "
                 "goes on, the sink is retried with a back-off and the records it misses are counted "
                 "in GradMonitor.dropped_records (this warning is shown once per sink)")

    @property
    def dropped(self) -> int:
        """Records that some sink did not write (it raised, or sat out its back-off)."""
        return sum(st.dropped for st in self._states.values())

    def health(self) -> list[dict]:
        """Per sink, in order: ``sink`` (its class name), ``written``, ``dropped``, ``failures``
        (consecutive), ``retry_in`` (records it still sits out) and ``last_error``."""
        out = []
        for sink in self.sinks:
            st = self._states.get(id(sink)) or SinkState()
            out.append({"sink": type(sink).__name__, "written": st.written, "dropped": st.dropped,
                        "failures": st.failures, "retry_in": st.wait, "last_error": st.last_error})
        return out

    def warn_if_numbering_twice(self, first_step: int) -> None:
        """A fresh monitor writing into a log that already reaches past its first step would
        number steps twice: say how to continue the numbering instead."""
        for sink in self.sinks:
            last_step = getattr(sink, "last_step", None)
            try:
                last = last_step() if callable(last_step) else None
            except Exception:  # noqa: BLE001 - a sink's own problem, reported when it writes
                last = None
            if last is not None and last >= first_step:
                warn(f"gradfuse: {type(sink).__name__} already holds records up to step {last} and this "
                     f"monitor starts at step {first_step}. To continue a run's numbering, save "
                     "GradMonitor.state_dict() with your checkpoint and load_state_dict() it on resume.")

    def close(self) -> None:
        """Closes every sink that has ``close()``; one that fails is warned about, never raised."""
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close:
                try:
                    close()
                except Exception as e:  # noqa: BLE001
                    self._failed(sink, self._state(sink), e, "close")
