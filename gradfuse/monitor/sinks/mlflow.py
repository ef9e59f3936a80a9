"""``MLflowSink``: records to an MLflow run (``mlflow`` is imported when the sink is made).

Layer: monitor. Imports ``gradfuse.utils``, ``gradfuse.monitor.sinks.record_metrics`` and
``gradfuse.monitor.sinks.pictures``.
"""
from __future__ import annotations

import re
import time

from gradfuse.monitor.sinks.pictures import Pictures, close_figure
from gradfuse.monitor.sinks.record_metrics import metrics
from gradfuse.utils import require

_MLFLOW_KEY = re.compile(r"[^\w\-. /]")


class MLflowSink:
    """An MLflow run through ``mlflow.tracking.MlflowClient``: per record, the metrics of
    ``metrics`` in one ``log_batch`` (at the record's step; characters MLflow refuses in a
    key, as in a layer called ``(root)``, become ``_``); anomalies as tags
    (``gradfuse.last_anomaly``: the kinds, ``gradfuse.last_anomaly_step``,
    ``gradfuse.last_anomaly_message``, ``gradfuse.anomalies.<kind>``: records with that kind);
    the monitor's settings as params ``gradfuse.<name>`` (``on_start``); and with
    ``images_every=N`` every N-th logged step the pictures as artifacts
    ``gradfuse/<tag>_step<step>.png`` (``log_figure``; tags as ``TensorBoardSink``'s, ``/``
    as ``_``).

    Metrics are logged in batches of at most 1000 (MLflow's limit); ``close`` draws the
    pictures once more when records came after the last ones. The metric names are listed on
    the Data reference page.

    Args:
        run_id: The run to write to; None: the active run (``mlflow.start_run()``), with the
            tracking URI in force.
        tracking_uri: Where the run is (None: MLflow's default).
        images_every: Log the pictures every this many logged steps (0: never).
        figure_fn: ``figure_fn(records)`` -> a matplotlib Figure or a dict of tag -> Figure;
            None: ``gradfuse.monitor.figures.record_figures``.
        window: How many of the latest records the pictures show.

    Attributes:
        client: The ``mlflow.tracking.MlflowClient``.
        run_id (str): The run written to.

    Raises:
        ImportError: ``mlflow`` is not installed (``pip install mlflow``).
        ValueError: ``run_id=None`` and no MLflow run is active; ``images_every`` < 0 or
            ``window`` < 1.

    Example:
        ```python
        with mlflow.start_run():
            monitor = gradfuse.GradMonitor(model, every=100, sinks=[gradfuse.MLflowSink()])
            train(model, monitor)
            monitor.close()
        ```
    """

    def __init__(self, run_id: str | None = None, *, tracking_uri: str | None = None,
                 images_every: int = 0, figure_fn=None, window: int = 500):
        mlflow = require("mlflow", "mlflow", "MLflowSink")
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise ValueError("gradfuse.MLflowSink: no active MLflow run: call mlflow.start_run() "
                                 "first or pass run_id=")
            run_id = active.info.run_id
        from mlflow.tracking import MlflowClient
        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id
        self._pictures = Pictures(images_every, figure_fn, window)
        self._anomaly_counts: dict[str, int] = {}

    @staticmethod
    def key(name: str) -> str:
        """``name`` as an MLflow metric, param or tag key: characters MLflow refuses become ``_``.

        Args:
            name: A metric, param or tag name (``grad_l2/(root)``).

        Returns:
            The key (``grad_l2/_root_``).
        """
        return _MLFLOW_KEY.sub("_", name)

    def on_start(self, config: dict) -> None:
        """Logs the monitor's settings as params ``gradfuse.<name>`` and the tag
        ``gradfuse.start_step``.

        Args:
            config: ``GradMonitor.config()`` with ``start_step``.
        """
        from mlflow.entities import Param, RunTag
        params = [Param(self.key(f"gradfuse.{k}"), str(v)) for k, v in config.items() if k != "start_step"]
        tags = [RunTag("gradfuse.start_step", str(config.get("start_step")))]
        self.client.log_batch(self.run_id, params=params, tags=tags)

    def write(self, record: dict) -> None:
        """Logs ``record``'s metrics and anomaly tags, and the pictures when they are due.

        Args:
            record: The record.
        """
        from mlflow.entities import Metric, RunTag
        step = record["step"]
        now = int(time.time() * 1000)
        batch = [Metric(self.key(k), float(v), now, step) for k, v in metrics(record).items()]
        tags = []
        if record["anomalies"]:
            for kind in record["anomalies"]:
                self._anomaly_counts[kind] = self._anomaly_counts.get(kind, 0) + 1
            tags = [RunTag("gradfuse.last_anomaly", ",".join(record["anomalies"])),
                    RunTag("gradfuse.last_anomaly_step", str(step)),
                    RunTag("gradfuse.last_anomaly_message", (record["message"] or "")[:4000])]
            tags += [RunTag(self.key(f"gradfuse.anomalies.{k}"), str(v)) for k, v in self._anomaly_counts.items()]
        for i in range(0, max(len(batch), 1), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000], tags=tags if i == 0 else [])
        if self._pictures.add(record):
            self._draw(step)

    def _draw(self, step: int) -> None:
        for tag, fig in self._pictures.figures().items():
            try:
                self.client.log_figure(self.run_id, fig, f"gradfuse/{tag.replace('/', '_')}_step{step:08d}.png")
            finally:
                close_figure(fig)

    def close(self) -> None:
        """Logs the pictures once more when records came after the last ones."""
        if self._pictures.pending:
            self._draw(self._pictures.last_step)
