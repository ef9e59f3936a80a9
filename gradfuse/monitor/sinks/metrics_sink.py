"""``MetricsSink``: records as flat metrics to any logger with ``log(metrics: dict, step=int)``.

Layer: monitor. Imports ``gradfuse.monitor.sinks.record_metrics``.
"""
from __future__ import annotations

from gradfuse.monitor.sinks.record_metrics import metrics


class MetricsSink:
    """Any logger with ``log(metrics: dict, step=int)``: a Weights & Biases run
    (``MetricsSink(wandb.run)``), or your own.

    Each record becomes one ``logger.log(metrics(record), step=record["step"])`` call: the flat
    metric names of ``metrics`` (listed on the Data reference page, under "Metric names").

    Args:
        logger: An object with a callable ``log(dict, step=)``.

    Attributes:
        logger: The logger.

    Raises:
        TypeError: ``logger`` has no callable ``log``.

    Example:
        ```python
        class PrintLogger:
            def log(self, metrics, step):
                print(step, metrics["grad/total_norm"])

        monitor = gradfuse.GradMonitor(model, sinks=[gradfuse.MetricsSink(PrintLogger())])
        ```
    """

    def __init__(self, logger):
        if not callable(getattr(logger, "log", None)):
            raise TypeError(f"gradfuse.MetricsSink needs an object with log(dict, step=), got {type(logger).__name__}")
        self.logger = logger

    def write(self, record: dict) -> None:
        """Hands ``metrics(record)`` to ``logger.log`` at the record's step.

        Args:
            record: The record.
        """
        self.logger.log(metrics(record), step=record["step"])
