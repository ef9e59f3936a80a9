"""Where GradMonitor records go. A sink is any object with ``write(record: dict)``; optional
``close()``, and ``last_step()`` (the last step it holds, so a monitor can warn before numbering
steps twice). Optional dependencies are imported on first use. A sink may raise: the monitor
catches it, warns once and retries with a back-off (see ``GradMonitor.write``).

A record (one per logged step or anomaly) holds: step, total_norm, norm_type, max_norm,
clip_coef, clipped, nonfinite, skipped, anomalies, message, event, counters (the run's totals so
far: steps, clipped_steps, skipped_steps, anomaly_steps, nonfinite_steps, explode_steps,
amp_overflow_steps, dropped_records), params (per-parameter statistics) and layers (per-layer
aggregates); with ``GradMonitor(activations=True)`` on logged steps also act and act_grad (per
layer: module outputs and the gradients with respect to them), and first_nonfinite when traced.

Layer: monitor. Imports :mod:`gradfuse.utils` only; the trackers are imported on first use.
"""
from __future__ import annotations

import json
import logging
import os

from gradfuse.utils import require

__all__ = ["JsonlSink", "LoggingSink", "MetricsSink", "PrometheusSink", "TensorBoardSink", "WandbSink",
           "metrics", "read_jsonl"]


class JsonlSink:
    """Appends one JSON object per record to ``path``: safe to read while training.

    Each record is one ``write`` of one line to an unbuffered file (``fsync=True`` also forces it
    to disk). A path that cannot be opened fails here, at construction, not at the first logged
    step. A line torn by a crash or a failed write (a full disk) is set apart with a newline
    before the next record, and :func:`read_jsonl` skips it. NaN and Inf are written as the JSON
    extensions ``NaN`` / ``Infinity``, which Python's json reads back. :meth:`last_step` is the
    last step the file holds (read from its end).
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = False):
        self.path = os.fspath(path)
        self.fsync = fsync
        d = os.path.dirname(self.path)
        try:
            if d:
                os.makedirs(d, exist_ok=True)
            self._f = open(self.path, "ab", buffering=0)
        except OSError as e:
            raise OSError(e.errno, f"gradfuse.JsonlSink cannot open {self.path!r} for appending: "
                                   f"{e.strerror or e}") from e
        self._torn = self._ends_without_newline()
        self._last_step = None

    def _ends_without_newline(self) -> bool:
        if not os.path.isfile(self.path) or os.path.getsize(self.path) == 0:
            return False
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"

    def last_step(self) -> int | None:
        """The step of the last record in the file (this run's, or a previous run's)."""
        if self._last_step is None and os.path.isfile(self.path):
            rec = _last_record(self.path)
            self._last_step = None if rec is None else rec.get("step")
        return self._last_step

    def write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        data = (("\n" if self._torn else "") + line).encode("utf-8")
        self._torn = True  # until the whole line is out
        view = memoryview(data)
        while view:
            view = view[self._f.write(view):]
        if self.fsync:
            os.fsync(self._f.fileno())
        self._torn = False
        self._last_step = record["step"]

    def close(self) -> None:
        self._f.close()


def _last_record(path: str, block: int = 1 << 20) -> dict | None:
    """The last complete, parseable record of a JSONL file, read backwards in blocks (a log of a
    long run can be gigabytes; a record of a large model, megabytes)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        pos = f.tell()
        tail = b""
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            tail = f.read(pos - start) + tail
            pos = start
            lines = tail.split(b"\n")
            # lines[0] may be cut by the block boundary unless the file starts there
            for line in reversed(lines if pos == 0 else lines[1:]):
                if line.strip():
                    try:
                        return json.loads(line)
                    except ValueError:
                        continue  # a torn line: look further back
            tail = lines[0] if pos > 0 else b""
    return None


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


def metrics(record: dict) -> dict[str, float]:
    """A record as flat metric names -> numbers, for metric loggers: ``grad/total_norm``,
    ``grad/clip_coef``, ``grad/clipped`` (this step), the run's counters (``grad/clipped_steps``,
    ``grad/skipped_steps``, ``grad/nonfinite_steps``, ...), and per layer ``grad_l2/<layer>``,
    ``grad_zero_fraction/<layer>``, ``grad_nonfinite/<layer>``; with the monitor's options
    ``grad/noise_scale``, ``grad/noise_scale_G2``, ``grad/noise_scale_trSigma``,
    ``update_ratio/<layer>``, ``weight_norm/<layer>``."""
    m = {
        "grad/total_norm": record["total_norm"],
        "grad/nonfinite": float(record["nonfinite"]),
        "grad/skipped": float(record["skipped"]),
    }
    if record["clip_coef"] is not None:
        m["grad/clip_coef"] = record["clip_coef"]
        m["grad/clipped"] = float(record["clipped"])
    for name, value in record.get("counters", {}).items():
        if name != "steps":
            m[f"grad/{name}"] = float(value)
    for layer, a in record["layers"].items():
        m[f"grad_l2/{layer}"] = a["l2"]
        m[f"grad_zero_fraction/{layer}"] = a["zero_fraction"]
        m[f"grad_nonfinite/{layer}"] = float(a["nan_count"] + a["inf_count"])
    for layer, columns in record.get("headroom", {}).items():  # GradMonitor(histogram=True)
        for column, value in columns.items():
            m[f"headroom/{layer}/{column}"] = value
    # GradMonitor(noise_scale=..., update_ratios=...): gradfuse.dynamics
    ns = record.get("noise_scale")
    if ns:
        m.update({"grad/noise_scale": ns["noise_scale"], "grad/noise_scale_G2": ns["G2"],
                  "grad/noise_scale_trSigma": ns["trSigma"]})
    for key in ("update_ratio", "weight_norm"):
        for layer, value in (record.get(key) or {}).items():
            m[f"{key}/{layer}"] = value
    for kind in ("act", "act_grad"):  # GradMonitor(activations=True), on the steps it logs
        for layer, a in record.get(kind, {}).items():
            for key in ("rms", "mean", "std", "dead_fraction", "zero_fraction"):
                m[f"{kind}/{layer}/{key}"] = a[key]
            m[f"{kind}/{layer}/nonfinite"] = float(a["nan_count"] + a["inf_count"])
    return m


class TensorBoardSink:
    """Scalars through a ``torch.utils.tensorboard.SummaryWriter``: total norm, clip coefficient
    and clip events, and per layer L2 norm, zero fraction and non-finite count."""

    def __init__(self, writer):
        self.writer = writer

    def write(self, record: dict) -> None:
        step = record["step"]
        for tag, value in metrics(record).items():
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
        self.logger.log(metrics(record), step=record["step"])


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
        prom = require("prometheus_client", "prometheus-client", "PrometheusSink")
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
