"""``PrometheusSink``: records as Prometheus metrics (``prometheus_client``), and the Grafana
dashboard of those metrics shipped beside this module (``grafana_dashboard_path``).

Layer: monitor. Imports ``gradfuse.utils`` and the record's metric names.
"""
from __future__ import annotations

import os

from gradfuse.monitor.sinks.record_metrics import UPDATE_KEYS
from gradfuse.utils import require


class PrometheusSink:
    """Prometheus metrics (``prometheus_client``), all gauges but the counters:
    ``<prefix>_total_norm``, ``<prefix>_clip_coef``, ``<prefix>_max_norm`` (the clip threshold
    of the step), ``<prefix>_clipped`` (1 when the logged step was clipped),
    ``<prefix>_layer_l2{layer=...}``, ``<prefix>_layer_zero_fraction{layer=...}``, and the
    counters ``<prefix>_anomalies_total{kind=...}``, ``<prefix>_clipped_steps_total`` and
    ``<prefix>_steps_total`` (the monitor's run totals, every step counted, logged or not); with
    ``update_ratios=`` also ``<prefix>_layer_<key>{layer=...}`` for the optimizer's statistics
    (``update_ratio``, ``update_rms``, ``moment1_rms``, ``moment2_rms``, ``eps_dominated``, ...: the
    record's keys of those names), with ``max_update_rms=`` ``<prefix>_update_clipped_steps_total``.

    Records with a ``rank`` key (``GradMonitor(sink_ranks="all")``) put a ``rank`` label on every
    metric: the first such record re-registers them with it.
    ``gradfuse/monitor/sinks/grafana_dashboard.json`` (``grafana_dashboard_path``) is a Grafana
    dashboard of these metrics for the default prefix. The metrics are also listed on the Data
    reference page. Serve them with ``prometheus_client.start_http_server`` (or your own
    exporter); the sink only sets them.

    Args:
        registry: The ``prometheus_client`` registry; None: ``prometheus_client.REGISTRY``.
        prefix: The metric name prefix.

    Raises:
        ImportError: ``prometheus_client`` is not installed (``pip install prometheus-client``).
        ValueError: from ``prometheus_client``, when the registry already holds metrics of these
            names (a second sink with the same prefix and registry).

    Example:
        ```python
        import prometheus_client
        prometheus_client.start_http_server(8000)
        monitor = gradfuse.GradMonitor(model, every=10, sinks=[gradfuse.PrometheusSink()])
        ```
    """

    def __init__(self, registry=None, prefix: str = "gradfuse"):
        self._prom = require("prometheus_client", "prometheus-client", "PrometheusSink")
        self._registry = registry if registry is not None else self._prom.REGISTRY
        self._prefix = prefix
        self._rank_label = False
        self._last_counters: dict[str, float] = {}
        self._make(())

    def _make(self, extra: tuple) -> None:
        prom, prefix, kw = self._prom, self._prefix, {"registry": self._registry}
        self.total_norm = prom.Gauge(f"{prefix}_total_norm", "total gradient norm", list(extra), **kw)
        self.clip_coef = prom.Gauge(f"{prefix}_clip_coef", "clip coefficient applied", list(extra), **kw)
        self.max_norm = prom.Gauge(f"{prefix}_max_norm", "clip threshold of the step", list(extra), **kw)
        self.clipped = prom.Gauge(f"{prefix}_clipped", "1 when the logged step was clipped", list(extra), **kw)
        self.layer_l2 = prom.Gauge(f"{prefix}_layer_l2", "gradient L2 norm per layer", ["layer", *extra], **kw)
        self.layer_zero = prom.Gauge(f"{prefix}_layer_zero_fraction", "zero gradients per layer",
                                     ["layer", *extra], **kw)
        self.anomalies = prom.Counter(f"{prefix}_anomalies", "gradient anomalies", ["kind", *extra], **kw)
        self.clipped_steps = prom.Counter(f"{prefix}_clipped_steps", "steps on which clipping scaled "
                                          "the gradients", list(extra), **kw)
        self.steps = prom.Counter(f"{prefix}_steps", "steps taken", list(extra), **kw)
        # GradMonitor(update_ratios=...): the optimizer's statistics per layer, as the record's keys
        self.layer_update = {key: prom.Gauge(f"{prefix}_layer_{key}", f"{key} per layer (the optimizer's update)",
                                             ["layer", *extra], **kw) for key in UPDATE_KEYS}
        self.update_clipped_steps = prom.Counter(f"{prefix}_update_clipped_steps", "steps on which update "
                                                 "clipping rescaled a parameter's update", list(extra), **kw)

    def _collectors(self) -> list:
        return [self.total_norm, self.clip_coef, self.max_norm, self.clipped, self.layer_l2, self.layer_zero,
                self.anomalies, self.clipped_steps, self.steps, *self.layer_update.values(),
                self.update_clipped_steps]

    def write(self, record: dict) -> None:
        """Sets the gauges and moves the counters from ``record``.

        Args:
            record: The record.
        """
        if "rank" in record and not self._rank_label:
            for c in self._collectors():
                self._registry.unregister(c)
            self._rank_label = True
            self._make(("rank",))
        rank = {"rank": str(record["rank"])} if self._rank_label else {}

        def m(metric, **labels):
            labels.update(rank)
            return metric.labels(**labels) if labels else metric

        m(self.total_norm).set(record["total_norm"])
        if record["clip_coef"] is not None:
            m(self.clip_coef).set(record["clip_coef"])
            m(self.clipped).set(float(bool(record["clipped"])))
        if record.get("max_norm") is not None:
            m(self.max_norm).set(record["max_norm"])
        for layer, a in record["layers"].items():
            m(self.layer_l2, layer=layer).set(a["l2"])
            m(self.layer_zero, layer=layer).set(a["zero_fraction"])
        for key, gauge in self.layer_update.items():
            for layer, value in (record.get(key) or {}).items():
                m(gauge, layer=layer).set(value)
        for kind in record["anomalies"]:
            m(self.anomalies, kind=kind).inc()
        counters = record.get("counters") or {}
        for name, metric in (("clipped_steps", self.clipped_steps), ("steps", self.steps),
                             ("update_clipped_steps", self.update_clipped_steps)):
            if name in counters:  # run totals: the counter moves by what they grew since the last record
                grew = counters[name] - self._last_counters.get(name, 0)
                if grew > 0:
                    m(metric).inc(grew)
                self._last_counters[name] = max(counters[name], self._last_counters.get(name, 0))


def grafana_dashboard_path() -> str:
    """The path of the Grafana dashboard shipped with gradfuse (JSON, for provisioning or
    import): total norm and clip threshold, clip events, per-layer L2 norms as a heatmap,
    anomalies; for ``PrometheusSink``'s metrics with the default prefix.

    Returns:
        The absolute path of ``gradfuse/monitor/sinks/grafana_dashboard.json``.

    Example:
        ```python
        import shutil
        shutil.copy(gradfuse.sinks.grafana_dashboard_path(), "/etc/grafana/dashboards/")
        ```
    """
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "grafana_dashboard.json")
