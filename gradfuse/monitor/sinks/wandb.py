"""``WandbSink``: records to a Weights & Biases run (``wandb`` is imported on first use).

Layer: monitor. Imports ``gradfuse.utils``, ``gradfuse.monitor.sinks.metrics_sink``,
``gradfuse.monitor.sinks.record_metrics`` and ``gradfuse.monitor.sinks.pictures``.
"""
from __future__ import annotations

from gradfuse.monitor.sinks.metrics_sink import MetricsSink
from gradfuse.monitor.sinks.pictures import Pictures, close_figure
from gradfuse.monitor.sinks.record_metrics import exponent_histograms, metrics
from gradfuse.utils import require


class WandbSink(MetricsSink):
    """Records to a Weights & Biases run.

    The run is ``wandb.init()``'s, or None: ``wandb.run`` when writing. The metrics of
    ``metrics`` go in one ``run.log(..., step=)`` per record, and

    - ``histograms=True`` (default): with ``GradMonitor(histogram=True)``, per layer
      ``grad_exponent/<layer>`` as ``wandb.Histogram(np_histogram=(counts, edges))`` on the log2
      axis (``exponent_buckets``), and with ``activations=True`` too
      ``activation_exponent/<layer>`` and ``activation_grad_exponent/<layer>`` (module outputs
      and the gradients with respect to them) the same way;
    - ``images_every=N`` (default 0): every N-th logged step the pictures as ``wandb.Image(fig)``
      (tags as ``TensorBoardSink``'s);
    - anomalies in ``run.summary``: ``grad/last_anomaly`` (the kinds, comma separated),
      ``grad/last_anomaly_step``, ``grad/last_anomaly_message`` and ``grad/anomalies/<kind>``
      (records with that kind this sink wrote);
    - the monitor's settings in ``run.config["gradfuse"]`` (``on_start``).

    Any other object with ``log(dict, step=)`` works too (as ``MetricsSink``; the
    histograms and pictures then need ``wandb`` importable; summary and config are set when the
    object has them). The metric names are listed on the Data reference page.

    Args:
        logger: A W&B run (``wandb.init()``'s), any object with ``log(dict, step=)``, or None:
            ``wandb.run`` at each write.
        histograms: Log the exponent histograms (when the records carry ``exponents``,
            ``act_exponents``, ``act_grad_exponents``).
        images_every: Log the pictures every this many logged steps (0: never).
        figure_fn: ``figure_fn(records)`` -> a matplotlib Figure or a dict of tag -> Figure;
            None: ``gradfuse.monitor.figures.record_figures``.
        window: How many of the latest records the pictures show.

    Attributes:
        logger: The run given, or None (``wandb.run``).
        histograms (bool): Whether exponent histograms are logged.

    Raises:
        TypeError: ``logger`` is neither None nor an object with a callable ``log``.
        ValueError: ``images_every`` < 0 or ``window`` < 1.
        ImportError: ``wandb`` is not installed (``pip install wandb``) where it is needed:
            ``logger=None``, histograms or pictures; raised by ``write`` / ``on_start``, so the
            monitor warns and counts the record as dropped.
        RuntimeError: ``logger=None`` and no run is active (call ``wandb.init()`` first);
            raised by ``write`` / ``on_start`` as well.

    Example:
        ```python
        run = wandb.init(project="my-project")
        monitor = gradfuse.GradMonitor(model, every=50, histogram=True,
                                       sinks=[gradfuse.WandbSink(run, images_every=20)])
        ```
    """

    def __init__(self, logger, histograms: bool = True, images_every: int = 0, figure_fn=None,
                 window: int = 500):
        if logger is not None:
            super().__init__(logger)
        else:
            self.logger = None
        self.histograms = histograms
        self._pictures = Pictures(images_every, figure_fn, window)
        self._anomaly_counts: dict[str, int] = {}

    def _run(self):
        if self.logger is not None:
            return self.logger
        wandb = require("wandb", "wandb", "WandbSink")
        if wandb.run is None:
            raise RuntimeError("gradfuse.WandbSink(None) writes to wandb.run: call wandb.init() first")
        return wandb.run

    def on_start(self, config: dict) -> None:
        """Puts the monitor's settings in ``run.config["gradfuse"]`` (when the run has a config).

        Args:
            config: ``GradMonitor.config()`` with ``start_step``.
        """
        config_obj = getattr(self._run(), "config", None)
        if config_obj is not None:
            config_obj.update({"gradfuse": config}, allow_val_change=True)

    def write(self, record: dict) -> None:
        """Logs ``record``'s metrics, histograms and, when due, pictures in one ``run.log``;
        anomalies go to the run's summary.

        Args:
            record: The record.
        """
        run = self._run()
        step = record["step"]
        m = dict(metrics(record))
        hists = exponent_histograms(record) if self.histograms else []
        due = self._pictures.add(record)
        if hists or due:
            wandb = require("wandb", "wandb", "WandbSink")
            for tag, edges, counts in hists:
                m[tag] = wandb.Histogram(np_histogram=(counts, edges))
            if due:
                m.update(self._images(wandb))
        run.log(m, step=step)
        summary = getattr(run, "summary", None)
        if record["anomalies"] and summary is not None:
            for kind in record["anomalies"]:
                self._anomaly_counts[kind] = self._anomaly_counts.get(kind, 0) + 1
            summary.update({"grad/last_anomaly": ",".join(record["anomalies"]),
                            "grad/last_anomaly_step": step,
                            "grad/last_anomaly_message": record["message"] or "",
                            **{f"grad/anomalies/{k}": v for k, v in self._anomaly_counts.items()}})

    def _images(self, wandb) -> dict:
        out = {}
        for tag, fig in self._pictures.figures().items():
            out[tag] = wandb.Image(fig)
            close_figure(fig)
        return out

    def close(self) -> None:
        """Logs the pictures once more when records came after the last ones."""
        if self._pictures.pending:
            wandb = require("wandb", "wandb", "WandbSink")
            self._run().log(self._images(wandb), step=self._pictures.last_step)
