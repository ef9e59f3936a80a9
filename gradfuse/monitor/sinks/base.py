"""``Sink``: what ``GradMonitor`` needs of the objects it writes its records to.

Layer: monitor. Imports nothing of gradfuse.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    """Where ``GradMonitor`` writes its records: any object with ``write(record)``.

    ``write`` is the whole protocol, so ``isinstance(obj, gradfuse.Sink)`` is True for every
    object with a ``write`` member (a runtime check sees that the member is there, not its
    signature). A sink need not inherit from ``Sink``; the monitor takes any object in
    ``sinks=`` and checks nothing when it is made. Three more methods are optional and not part
    of the protocol: the monitor looks each one up on the sink and calls it only when it is
    there.

    What the monitor calls, and when:

    - ``last_step()`` (optional) -> the last step the sink already holds, or None: once, at
      the monitor's first ``step`` (the first while ``enabled``), unless ``load_state_dict``
      restored the monitor. When that step is at or past the monitor's first step, the monitor
      warns that steps would be numbered twice. An exception from ``last_step`` is ignored.
    - ``on_start(config: dict)`` (optional): once, at that same first ``step``, before the
      first record, on the ranks that write: a copy of ``GradMonitor.config()`` with
      ``start_step`` added (a tracker's run config).
    - ``write(record: dict)``: on every logging step (``every``), on a step with an anomaly
      of the model (logging step or not; before a ``"raise"`` policy raises; a GradScaler
      overflow is the scaler's, not one of these), on ``flush`` / ``close``
      for a last step not yet logged, and on every ``GradMonitor.write``. Under
      ``torch.distributed`` only the ranks of ``sink_ranks`` write; with ``"all"`` the record
      has a ``rank`` key. The record's keys are listed on the Data reference page.
    - ``close()`` (optional): once, from ``GradMonitor.close()`` (and so from
      ``Attachment.detach``), after the last record.

    A failing sink never stops training. When ``write``, ``on_start`` or ``close`` raises an
    ``Exception`` (not a ``BaseException`` such as ``KeyboardInterrupt``), the monitor catches
    it, goes on with the other sinks and the step, and warns once per sink, with the reason.
    A ``write`` that raises loses its record: after the sink's k-th consecutive failure it
    sits out the next ``min(2**(k-1), 64)`` records, then is tried again, and a success
    resets k. Every record a sink did not write, failed or sat out, counts in
    ``GradMonitor.dropped_records``; ``GradMonitor.sink_health()`` gives each sink's
    ``written``, ``dropped``, ``failures`` (consecutive), ``retry_in`` and ``last_error``. A
    failing ``on_start`` or ``close`` counts in ``failures`` and ``last_error`` only.

    Example:
        ```python
        class PrintSink:
            def write(self, record):
                print(record["step"], record["total_norm"])

        assert isinstance(PrintSink(), gradfuse.Sink)
        monitor = gradfuse.GradMonitor(model, every=10, sinks=[PrintSink()])
        ```
    """

    def write(self, record: dict) -> None:
        """Takes one record (a dict; its keys are listed on the Data reference page).

        Args:
            record: The record, as ``GradMonitor.record`` builds it (with ``rank`` under
                ``sink_ranks="all"``). The sink may keep it, but must not change it: every
                sink gets the same dict.
        """
