"""``LoggingSink``: one line per record through Python ``logging``.

Layer: monitor. Imports nothing of gradfuse.
"""
from __future__ import annotations

import logging


class LoggingSink:
    """One line per record through Python ``logging`` (anomalies at WARNING).

    The line: ``step N: total_norm=... clip_coef=... ANOMALY <kinds>: <message>``, with the clip
    coefficient only when clipping and the anomaly part only on an anomaly (see the Data
    reference page for the fields).

    Args:
        logger: The logger; None: ``logging.getLogger("gradfuse")``.
        level: The level of records without anomalies (anomalies are logged at WARNING).

    Attributes:
        logger (logging.Logger): The logger.
        level (int): The level of ordinary records.

    Example:
        ```python
        logging.basicConfig(level=logging.INFO)
        monitor = gradfuse.GradMonitor(model, every=100, sinks=[gradfuse.LoggingSink()])
        ```
    """

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO):
        self.logger = logger or logging.getLogger("gradfuse")
        self.level = level

    def write(self, record: dict) -> None:
        """Logs ``record``'s line (at WARNING when it holds anomalies).

        Args:
            record: The record.
        """
        line = f"step {record['step']}: total_norm={record['total_norm']:.4g}"
        if record["clip_coef"] is not None:
            line += f" clip_coef={record['clip_coef']:.4g}"
        if record["anomalies"]:
            line += f" ANOMALY {','.join(record['anomalies'])}: {record['message']}"
        self.logger.log(logging.WARNING if record["anomalies"] else self.level, line)
