"""Where GradMonitor records go. A sink is any object with ``write(record: dict)``; optional
``close()``, and ``last_step()`` (the last step it holds, so a monitor can warn before numbering
steps twice). Optional dependencies are imported on first use. A sink may raise: the monitor
catches it, warns once and retries with a back-off (see ``GradMonitor.write``).

A record (one per logged step or anomaly) holds: step, total_norm, norm_type, max_norm,
clip_coef, clipped, nonfinite, skipped, anomalies, message, event, counters (the run's totals so
far: steps, clipped_steps, skipped_steps, anomaly_steps, nonfinite_steps, explode_steps,
amp_overflow_steps, dropped_records), params (per-parameter statistics) and layers (per-layer
aggregates); with ``GradMonitor(histogram=True)`` on logged steps also headroom and exponents
(per layer); with ``GradMonitor(activations=True)`` on logged steps also act and act_grad (per
layer: module outputs and the gradients with respect to them), with both options act_exponents
and act_grad_exponents (their exponent histograms, per layer, shaped as exponents), and
first_nonfinite when traced.

Sinks that talk to a tracker may also have ``on_start(config: dict)``: the monitor hands them its
settings (``GradMonitor.config``) once, before the first record. Under ``torch.distributed``
only rank 0 writes unless ``GradMonitor(sink_ranks="all")``; records then carry ``rank``.

Pictures (``images_every=N`` on ``TensorBoardSink``, ``WandbSink``,
``MLflowSink``): every N-th logged step the sink draws the records it kept (a window of the
last ``window`` records, without their per-parameter rows) with ``figure_fn(records)``, a
matplotlib Figure or a dict of tag -> Figure; by default
``gradfuse.monitor.figures.record_figures`` (``grad/gradflow``: the per-layer L2 heatmap,
total norm with clip events and zero fractions; ``grad/exponents``: the per-layer exponent panels,
with ``GradMonitor(histogram=True)``). Default ``images_every=0``: no pictures (drawing takes
about a second). ``close`` draws once more when records came after the last picture.

Exponent histograms (``histograms=True``, the default, with ``GradMonitor(histogram=True)``): per
layer, the value axis is the binary exponent floor(log2|g|) itself, not 2**e (a gradient spans
tens of binades: on a linear 2**e axis all but the top few would collapse at zero). The bucket of
bin ``e + 151`` covers [e, e+1) and has the upper limit ``e + 1``, the log2 of the bin's upper edge
2**(e+1). Zeros, Inf and NaN have no exponent and are left out (they are the scalars
``grad_zero_fraction/<layer>`` and ``grad_nonfinite/<layer>``, ``act/<layer>/zero_fraction`` and
``act/<layer>/nonfinite``, ``act_grad/<layer>/...`` for activations); so are the float64-only
bins below 2**-149 and above 2**128. Three kinds, each written the same way: the record's
``exponents`` as ``grad_exponent/<layer>`` (the gradients), and with
``GradMonitor(activations=True)`` too its ``act_exponents`` as ``activation_exponent/<layer>``
(the module outputs) and ``act_grad_exponents`` as ``activation_grad_exponent/<layer>`` (the
gradients with respect to them).

Layer: monitor. Imports ``gradfuse.utils``, ``gradfuse.numerics.histogram`` (the bins) and
``gradfuse.monitor.figures`` (the pictures); the trackers are imported on first use.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import time

from gradfuse.numerics.histogram import EXPONENT_OFFSET, MAX_EXPONENT, MIN_EXPONENT
from gradfuse.utils import require

__all__ = ["JsonlSink", "LoggingSink", "MLflowSink", "MetricsSink", "PrometheusSink", "TensorBoardSink",
           "WandbSink", "exponent_buckets", "grafana_dashboard_path", "metrics", "read_jsonl"]


class JsonlSink:
    """Appends one JSON object per record to ``path``: safe to read while training.

    Each record is one ``write`` of one line to an unbuffered file (``fsync=True`` also forces it
    to disk). The line is the whole record (its keys are listed on the Data reference page,
    under "The record"). A path that cannot be opened fails here, at construction, not at the
    first logged step. A line torn by a crash or a failed write (a full disk) is set apart with a
    newline before the next record, and ``read_jsonl`` skips it. NaN and Inf are written as the
    JSON extensions ``NaN`` / ``Infinity``, which Python's json reads back. ``last_step`` is the
    last step the file holds (read from its end). An existing file is appended to.

    Args:
        path: The file; its directory is created when missing.
        fsync: Force each record to disk (``os.fsync``) after writing it.

    Attributes:
        path (str): The file's path.
        fsync (bool): Whether each record is forced to disk.

    Raises:
        OSError: ``path`` cannot be opened for appending (the message names it).

    Example:
        ```python
        sink = gradfuse.JsonlSink("runs/exp1/grads.jsonl")
        monitor = gradfuse.GradMonitor(model, every=100, sinks=[sink])
        ...
        monitor.close()
        records = gradfuse.sinks.read_jsonl("runs/exp1/grads.jsonl")
        ```
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
        """The step of the last record in the file (this run's, or a previous run's).

        Returns:
            The step, or None when the file holds no complete record.
        """
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
    """The records of a JSONL log, skipping a torn line left by a crash.

    Args:
        path: A file a ``JsonlSink`` wrote.

    Returns:
        The records, in file order (their keys: see the Data reference page).

    Raises:
        OSError: the file cannot be opened (``FileNotFoundError`` when it does not exist).

    Example:
        ```python
        records = gradfuse.sinks.read_jsonl("run.jsonl")
        norms = [r["total_norm"] for r in records]
        ```
    """
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
    """A record as flat metric names -> numbers, for metric loggers.

    The metric sinks (``TensorBoardSink``, ``MetricsSink``, ``WandbSink``, ``MLflowSink``) and
    the Lightning and Hugging Face integrations log these; the full table is on the Data
    reference page, under "Metric names".

    Args:
        record: A record, as ``GradMonitor.record`` builds it (or ``read_jsonl`` reads it).

    Returns:
        Metric name -> number: ``grad/total_norm``, ``grad/nonfinite``, ``grad/skipped``;
            ``grad/clip_coef``, ``grad/clipped`` (this step) when clipping; the run's counters
            (``grad/clipped_steps``, ``grad/skipped_steps``, ``grad/nonfinite_steps``, ...); per
            layer ``grad_l2/<layer>``, ``grad_zero_fraction/<layer>``, ``grad_nonfinite/<layer>``
            (NaN + Inf count); with the monitor's options ``headroom/<layer>/<column>``,
            ``grad/noise_scale``, ``grad/noise_scale_G2``, ``grad/noise_scale_trSigma``,
            ``update_ratio/<layer>``, ``weight_norm/<layer>``, and
            ``act/<layer>/{rms,mean,std,dead_fraction,zero_fraction,nonfinite}`` and
            ``act_grad/<layer>/...``.

    Raises:
        KeyError: ``record`` lacks a key every record has (``total_norm``, ``nonfinite``,
            ``skipped``, ``clip_coef``, ``layers``).

    Example:
        ```python
        for r in gradfuse.sinks.read_jsonl("run.jsonl"):
            my_logger.log(gradfuse.sinks.metrics(r), step=r["step"])
        ```
    """
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


def exponent_buckets(entry: dict) -> tuple[list[int], list[int]] | None:
    """A layer's ``exponents`` entry as (edges, counts) on the log2 axis.

    ``counts[i]`` elements have floor(log2|g|) in [edges[i], edges[i+1]), so
    ``len(edges) == len(counts) + 1`` (numpy's histogram convention). Only the exponent bins
    (-149 .. 127), trimmed of empty bins at both ends.

    Args:
        entry: One layer of a record's ``exponents`` (``{"first_bin": b, "counts": [...]}``;
            ``GradMonitor(histogram=True)``).

    Returns:
        ``(edges, counts)``, or None when none of the exponent bins holds an element.

    Example:
        ```python
        edges, counts = gradfuse.sinks.exponent_buckets(record["exponents"]["lm_head"])
        ```
    """
    first, counts = entry["first_bin"], entry["counts"]
    lo_bin, hi_bin = MIN_EXPONENT + EXPONENT_OFFSET, MAX_EXPONENT + EXPONENT_OFFSET
    pairs = [(b - EXPONENT_OFFSET, c) for b, c in enumerate(counts, first) if lo_bin <= b <= hi_bin]
    while pairs and not pairs[-1][1]:
        pairs.pop()
    while pairs and not pairs[0][1]:
        pairs.pop(0)
    if not pairs:
        return None
    return [pairs[0][0] + i for i in range(len(pairs) + 1)], [c for _e, c in pairs]


# (record key, tag prefix) of the exponent histograms the sinks write: the gradients', and with
# GradMonitor(activations=True) the module outputs' and the gradients' with respect to them
_EXPONENT_HISTOGRAMS = (("exponents", "grad_exponent"), ("act_exponents", "activation_exponent"),
                       ("act_grad_exponents", "activation_grad_exponent"))


def _exponent_histograms(record: dict) -> list[tuple[str, list[int], list[int]]]:
    """(tag, edges, counts) of every exponent histogram a record holds (``_EXPONENT_HISTOGRAMS``;
    edges and counts as ``exponent_buckets``; layers with no exponent bin filled left out)."""
    out = []
    for key, prefix in _EXPONENT_HISTOGRAMS:
        for layer, entry in (record.get(key) or {}).items():
            buckets = exponent_buckets(entry)
            if buckets is not None:
                out.append((f"{prefix}/{layer}", *buckets))
    return out


_NOT_PICTURED = ("params", "act", "act_grad", "act_exponents", "act_grad_exponents")


class _Pictures:
    """The pictures of a sink: a bounded window of the records it wrote (without ``params``,
    ``act``, ``act_grad`` and their exponent histograms), and every ``every``-th logged step (a
    record of a step already counted, an anomaly's re-log, is not counted again) the figures of
    that window."""

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
        """Keeps ``record``; True when pictures are due now."""
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
        """tag -> matplotlib Figure, drawn from the window."""
        self.pending = False
        records = list(self.records)
        if self.figure_fn is None:
            from gradfuse.monitor.figures import record_figures
            return record_figures(records)
        out = self.figure_fn(records)
        return out if isinstance(out, dict) else {"grad/gradflow": out}


def _close_figure(fig) -> None:
    import matplotlib.pyplot as plt
    plt.close(fig)


class TensorBoardSink:
    """Through a ``torch.utils.tensorboard.SummaryWriter``: the scalars of ``metrics`` (total
    norm, clip coefficient and clip events, per layer L2 norm, zero fraction, non-finite count,
    ...), anomalies as text (``grad/anomaly``), and

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
        self._pictures = _Pictures(images_every, figure_fn, window)

    def write(self, record: dict) -> None:
        step = record["step"]
        for tag, value in metrics(record).items():
            self.writer.add_scalar(tag, value, step)
        if record["anomalies"]:
            self.writer.add_text("grad/anomaly", record["message"] or ",".join(record["anomalies"]), step)
        if self.histograms:
            for tag, edges, counts in _exponent_histograms(record):
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
        if self._pictures.pending:
            self._draw(self._pictures.last_step)
        self.writer.flush()


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
        self.logger.log(metrics(record), step=record["step"])


class WandbSink(MetricsSink):
    """A Weights & Biases run (``wandb.init()``'s, or None: ``wandb.run`` when writing): the
    metrics of ``metrics`` in one ``run.log(..., step=)`` per record, and

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

    Any other object with ``log(dict, step=)`` still works (as ``MetricsSink``; the
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
        self._pictures = _Pictures(images_every, figure_fn, window)
        self._anomaly_counts: dict[str, int] = {}

    def _run(self):
        if self.logger is not None:
            return self.logger
        wandb = require("wandb", "wandb", "WandbSink")
        if wandb.run is None:
            raise RuntimeError("gradfuse.WandbSink(None) writes to wandb.run: call wandb.init() first")
        return wandb.run

    def on_start(self, config: dict) -> None:
        config_obj = getattr(self._run(), "config", None)
        if config_obj is not None:
            config_obj.update({"gradfuse": config}, allow_val_change=True)

    def write(self, record: dict) -> None:
        run = self._run()
        step = record["step"]
        m = dict(metrics(record))
        hists = _exponent_histograms(record) if self.histograms else []
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
            _close_figure(fig)
        return out

    def close(self) -> None:
        if self._pictures.pending:
            wandb = require("wandb", "wandb", "WandbSink")
            self._run().log(self._images(wandb), step=self._pictures.last_step)


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
        self._pictures = _Pictures(images_every, figure_fn, window)
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
        from mlflow.entities import Param, RunTag
        params = [Param(self.key(f"gradfuse.{k}"), str(v)) for k, v in config.items() if k != "start_step"]
        tags = [RunTag("gradfuse.start_step", str(config.get("start_step")))]
        self.client.log_batch(self.run_id, params=params, tags=tags)

    def write(self, record: dict) -> None:
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
                _close_figure(fig)

    def close(self) -> None:
        if self._pictures.pending:
            self._draw(self._pictures.last_step)


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
        line = f"step {record['step']}: total_norm={record['total_norm']:.4g}"
        if record["clip_coef"] is not None:
            line += f" clip_coef={record['clip_coef']:.4g}"
        if record["anomalies"]:
            line += f" ANOMALY {','.join(record['anomalies'])}: {record['message']}"
        self.logger.log(logging.WARNING if record["anomalies"] else self.level, line)


class PrometheusSink:
    """Prometheus metrics (``prometheus_client``), all gauges but the counters:
    ``<prefix>_total_norm``, ``<prefix>_clip_coef``, ``<prefix>_max_norm`` (the clip threshold
    of the step), ``<prefix>_clipped`` (1 when the logged step was clipped),
    ``<prefix>_layer_l2{layer=...}``, ``<prefix>_layer_zero_fraction{layer=...}``, and the
    counters ``<prefix>_anomalies_total{kind=...}``, ``<prefix>_clipped_steps_total`` and
    ``<prefix>_steps_total`` (the monitor's run totals, every step counted, logged or not).

    Records with a ``rank`` key (``GradMonitor(sink_ranks="all")``) put a ``rank`` label on every
    metric: the first such record re-registers them with it.
    ``gradfuse/monitor/grafana_dashboard.json`` (``grafana_dashboard_path``) is a Grafana
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

    def _collectors(self) -> list:
        return [self.total_norm, self.clip_coef, self.max_norm, self.clipped, self.layer_l2, self.layer_zero,
                self.anomalies, self.clipped_steps, self.steps]

    def write(self, record: dict) -> None:
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
        for kind in record["anomalies"]:
            m(self.anomalies, kind=kind).inc()
        counters = record.get("counters") or {}
        for name, metric in (("clipped_steps", self.clipped_steps), ("steps", self.steps)):
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
        The absolute path of ``gradfuse/monitor/grafana_dashboard.json``.

    Example:
        ```python
        import shutil
        shutil.copy(gradfuse.sinks.grafana_dashboard_path(), "/etc/grafana/dashboards/")
        ```
    """
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "grafana_dashboard.json")
