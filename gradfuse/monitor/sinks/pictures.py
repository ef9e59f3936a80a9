"""The pictures of the sinks that draw (``TensorBoardSink``, ``WandbSink``, ``MLflowSink`` with
``images_every=N``): a bounded window of the records a sink wrote, drawn every N-th logged step.

Layer: monitor. Imports ``gradfuse.monitor.figures`` (the default pictures) and matplotlib on
first use.
"""
from __future__ import annotations

import collections

_NOT_PICTURED = ("params", "act", "act_grad", "act_exponents", "act_grad_exponents")


class Pictures:
    """The pictures of a sink: a bounded window of the records it wrote, and when they are due.

    The window keeps the records without ``params``, ``act``, ``act_grad`` and their exponent
    histograms. Pictures are due every ``every``-th logged step: a record of a step already
    counted (an anomaly's re-log) is not counted again. A sink that draws calls ``add`` in its
    ``write`` and draws ``figures()`` when it returns True, and in its ``close`` draws once more
    when ``pending``.

    Args:
        every: Draw every this many logged steps (0: never).
        figure_fn: ``figure_fn(records)`` -> a matplotlib Figure or a dict of tag -> Figure;
            None: ``gradfuse.monitor.figures.record_figures``.
        window: How many of the latest records the pictures show.

    Attributes:
        every (int): The interval in logged steps (0: never).
        figure_fn: The drawing function, or None (the default pictures).
        records (collections.deque): The window.
        seen (int): Logged steps counted so far.
        last_step (int | None): The step of the last record kept.
        pending (bool): Records came after the last pictures.

    Raises:
        ValueError: ``every`` < 0 or ``window`` < 1.
    """

    def __init__(self, every: int, figure_fn, window: int):
        if every < 0 or window < 1:
            raise ValueError(f"gradfuse: images_every must be >= 0 and window >= 1, got {every}, {window}")
        self.every = every
        self.figure_fn = figure_fn
        self.records = collections.deque(maxlen=window)
        self.seen = 0
        self.last_step = None
        self.pending = False

    def add(self, record: dict) -> bool:
        """Keeps ``record`` in the window.

        Args:
            record: The record the sink wrote.

        Returns:
            True when pictures are due now (never when ``every`` is 0: nothing is kept then).
        """
        if not self.every:
            return False
        self.records.append({k: v for k, v in record.items() if k not in _NOT_PICTURED})
        if record["step"] == self.last_step:
            self.pending = True
            return False
        self.last_step = record["step"]
        self.seen += 1
        due = self.seen % self.every == 0
        self.pending = not due
        return due

    def figures(self) -> dict:
        """The pictures of the window (clears ``pending``).

        Returns:
            Tag -> matplotlib Figure (a single Figure from ``figure_fn`` gets the tag
            ``grad/gradflow``).
        """
        self.pending = False
        records = list(self.records)
        if self.figure_fn is None:
            from gradfuse.monitor.figures import record_figures
            return record_figures(records)
        out = self.figure_fn(records)
        return out if isinstance(out, dict) else {"grad/gradflow": out}


def close_figure(fig) -> None:
    """Closes a matplotlib Figure once a sink has handed it on (frees pyplot's hold on it).

    Args:
        fig: The Figure.
    """
    import matplotlib.pyplot as plt
    plt.close(fig)
