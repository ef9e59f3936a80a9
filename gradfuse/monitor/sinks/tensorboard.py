"""``TensorBoardSink``: records through a ``torch.utils.tensorboard.SummaryWriter``.

Layer: monitor. Imports ``gradfuse.monitor.sinks.record_metrics`` and
``gradfuse.monitor.sinks.pictures``.
"""
from __future__ import annotations

from gradfuse.monitor.sinks.pictures import Pictures
from gradfuse.monitor.sinks.record_metrics import exponent_histograms, metrics


class TensorBoardSink:
    """Records through a ``torch.utils.tensorboard.SummaryWriter``.

    The scalars of ``metrics`` (total norm, clip coefficient and clip events, per layer L2
    norm, zero fraction, non-finite count, ...), anomalies as text (``grad/anomaly``), and

    - ``histograms=True`` (default): with ``GradMonitor(histogram=True)``, per layer the gradient
      exponent histogram ``grad_exponent/<layer>`` (``add_histogram_raw``; the value axis is
      log2|g|: bucket limits ``e + 1``, see ``exponent_buckets``), and with
      ``activations=True`` too those of the module outputs, ``activation_exponent/<layer>``,
      and of the gradients with respect to them, ``activation_grad_exponent/<layer>`` (the
      same axis);
    - ``images_every=N`` (default 0: none): every N-th logged step the pictures of the last
      ``window`` records (``add_figure``; tags ``grad/gradflow`` and ``grad/exponents`` by
      default, or what ``figure_fn(records)`` returns: a Figure, or a dict of tag -> Figure).

    Scalars are logged at the record's step; the writer is flushed after each record and on
    ``close`` (which draws the pictures once more when records came after the last ones; the
    writer itself is left open). The metric names are listed on the Data reference page.

    Args:
        writer: A ``torch.utils.tensorboard.SummaryWriter`` (or an object with its
            ``add_scalar``, ``add_text``, ``add_histogram_raw``, ``add_figure`` and ``flush``).
        histograms: Log the exponent histograms (when the records carry ``exponents``,
            ``act_exponents``, ``act_grad_exponents``).
        images_every: Draw the pictures every this many logged steps (0: never; drawing takes
            about a second).
        figure_fn: ``figure_fn(records)`` -> a matplotlib Figure or a dict of tag -> Figure;
            None: ``gradfuse.monitor.figures.record_figures``.
        window: How many of the latest records the pictures show.

    Attributes:
        writer: The writer.
        histograms (bool): Whether exponent histograms are logged.

    Raises:
        ValueError: ``images_every`` < 0 or ``window`` < 1.
        ImportError: when drawing the default pictures without matplotlib
            (``pip install matplotlib``); raised in ``write`` (the monitor warns and counts
            the record as dropped). ``SummaryWriter`` itself needs ``pip install tensorboard``.

    Example:
        ```python
        from torch.utils.tensorboard import SummaryWriter
        sink = gradfuse.TensorBoardSink(SummaryWriter("runs/exp1"), images_every=10)
        monitor = gradfuse.GradMonitor(model, every=50, histogram=True, sinks=[sink])
        ```
    """

    def __init__(self, writer, histograms: bool = True, images_every: int = 0, figure_fn=None,
                 window: int = 500):
        self.writer = writer
        self.histograms = histograms
        self._pictures = Pictures(images_every, figure_fn, window)

    def write(self, record: dict) -> None:
        """Writes ``record``'s scalars, anomaly text and histograms, and the pictures when due;
        flushes the writer.

        Args:
            record: The record.
        """
        step = record["step"]
        for tag, value in metrics(record).items():
            self.writer.add_scalar(tag, value, step)
        if record["anomalies"]:
            self.writer.add_text("grad/anomaly", record["message"] or ",".join(record["anomalies"]), step)
        if self.histograms:
            for tag, edges, counts in exponent_histograms(record):
                mids = [e + 0.5 for e in edges[:-1]]
                self.writer.add_histogram_raw(
                    tag, min=edges[0], max=edges[-1], num=sum(counts),
                    sum=sum(m * c for m, c in zip(mids, counts)),
                    sum_squares=sum(m * m * c for m, c in zip(mids, counts)),
                    bucket_limits=edges[1:], bucket_counts=counts, global_step=step)
        if self._pictures.add(record):
            self._draw(step)
        self.writer.flush()

    def _draw(self, step: int) -> None:
        for tag, fig in self._pictures.figures().items():
            self.writer.add_figure(tag, fig, global_step=step, close=True)

    def close(self) -> None:
        """Draws the pictures once more when records came after the last ones; flushes the
        writer (and leaves it open)."""
        if self._pictures.pending:
            self._draw(self._pictures.last_step)
        self.writer.flush()
