"""Where GradMonitor records go. A sink is any object with ``write(record: dict)``; optional
``close()`` and ``last_step()`` (for resuming). Optional dependencies are imported on first use.

A record (one per logged step or anomaly) holds: step, total_norm, norm_type, max_norm,
clip_coef, clipped, nonfinite, skipped, anomalies, message, event, params (per-parameter
statistics) and layers (per-layer aggregates).
"""
from __future__ import annotations

import json
import logging
import os


def _require(module: str, pip_name: str, what: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"gradfuse.{what} needs the optional package {pip_name!r}: "
                          f"pip install {pip_name}") from e


class JsonlSink:
    """Appends one JSON object per record to ``path``: safe to read while training, and to resume.

    Each record is written as one line and flushed; ``fsync=True`` also forces it to disk. On
    opening an existing file a torn last line (a crash mid-write) is set apart with a newline, and
    :meth:`last_step` tells a resumed :class:`GradMonitor` where to continue. NaN and Inf are
    written as the JSON extensions ``NaN`` / ``Infinity``, which Python's json reads back.
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = False):
        self.path = os.fspath(path)
        self.fsync = fsync
        self._last_step = None
        if os.path.exists(self.path):
            for rec in read_jsonl(self.path):
                self._last_step = rec.get("step", self._last_step)
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        if self._f.tell() > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._f.write("\n")

    def last_step(self) -> int | None:
        return self._last_step

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())
        self._last_step = record["step"]

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL log, skipping a torn line left by a crash."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _flat_scalars(record: dict) -> dict[str, float]:
    """The record as flat metric names -> numbers, for metric loggers."""
    m = {
        "grad/total_norm": record["total_norm"],
        "grad/nonfinite": float(record["nonfinite"]),
        "grad/skipped": float(record["skipped"]),
    }
    if record["clip_coef"] is not None:
        m["grad/clip_coef"] = record["clip_coef"]
        m["grad/clipped"] = float(record["clipped"])
    for layer, a in record["layers"].items():
        m[f"grad_l2/{layer}"] = a["l2"]
        m[f"grad_zero_fraction/{layer}"] = a["zero_fraction"]
        m[f"grad_nonfinite/{layer}"] = float(a["nan_count"] + a["inf_count"])
    return m


class TensorBoardSink:
    """Scalars through a ``torch.utils.tensorboard.SummaryWriter``: total norm, clip coefficient
    and clip events, and per layer L2 norm, zero fraction and non-finite count."""

    def __init__(self, writer):
        self.writer = writer

    def write(self, record: dict) -> None:
        step = record["step"]
        for tag, value in _flat_scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        if record["anomalies"]:
            self.writer.add_text("grad/anomaly", record["message"] or ",".join(record["anomalies"]), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.flush()


class MetricsSink:
    """Any logger with ``log(metrics: dict, step=int)``: a Weights & Biases run
    (``MetricsSink(wandb.run)``), or your own."""

    def __init__(self, logger):
        if not callable(getattr(logger, "log", None)):
            raise TypeError(f"gradfuse.MetricsSink needs an object with log(dict, step=), got {type(logger).__name__}")
        self.logger = logger

    def write(self, record: dict) -> None:
        self.logger.log(_flat_scalars(record), step=record["step"])


WandbSink = MetricsSink


class LoggingSink:
    """One line per record through Python ``logging`` (anomalies at WARNING)."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO):
        self.logger = logger or logging.getLogger("gradfuse")
        self.level = level

    def write(self, record: dict) -> None:
        line = f"step {record['step']}: total_norm={record['total_norm']:.4g}"
        if record["clip_coef"] is not None:
            line += f" clip_coef={record['clip_coef']:.4g}"
        if record["anomalies"]:
            line += f" ANOMALY {','.join(record['anomalies'])}: {record['message']}"
        self.logger.log(logging.WARNING if record["anomalies"] else self.level, line)


class PrometheusSink:
    """Prometheus gauges (``prometheus_client``): ``<prefix>_total_norm``, ``<prefix>_clip_coef``,
    ``<prefix>_layer_l2{layer=...}``, ``<prefix>_layer_zero_fraction{layer=...}``, and the
    counters ``<prefix>_anomalies_total{kind=...}``."""

    def __init__(self, registry=None, prefix: str = "gradfuse"):
        prom = _require("prometheus_client", "prometheus-client", "PrometheusSink")
        kw = {"registry": registry} if registry is not None else {}
        self.total_norm = prom.Gauge(f"{prefix}_total_norm", "total gradient norm", **kw)
        self.clip_coef = prom.Gauge(f"{prefix}_clip_coef", "clip coefficient applied", **kw)
        self.layer_l2 = prom.Gauge(f"{prefix}_layer_l2", "gradient L2 norm per layer", ["layer"], **kw)
        self.layer_zero = prom.Gauge(f"{prefix}_layer_zero_fraction", "zero gradients per layer",
                                     ["layer"], **kw)
        self.anomalies = prom.Counter(f"{prefix}_anomalies", "gradient anomalies", ["kind"], **kw)

    def write(self, record: dict) -> None:
        self.total_norm.set(record["total_norm"])
        if record["clip_coef"] is not None:
            self.clip_coef.set(record["clip_coef"])
        for layer, a in record["layers"].items():
            self.layer_l2.labels(layer=layer).set(a["l2"])
            self.layer_zero.labels(layer=layer).set(a["zero_fraction"])
        for kind in record["anomalies"]:
            self.anomalies.labels(kind=kind).inc()
