"""Where GradMonitor records go. A sink is any object with ``write(record: dict)``: the protocol
``Sink`` says what the monitor calls (``write``, and when they are there ``on_start``,
``close``, ``last_step``), when, and what happens when a sink raises (training goes on; see
also ``GradMonitor.write``). Optional dependencies are imported on first use.

A record (one per logged step or anomaly) holds: step, total_norm, norm_type, max_norm,
clip_coef, clipped, nonfinite, skipped, anomalies, message, event, counters (the run's totals so
far: steps, clipped_steps, skipped_steps, anomaly_steps, nonfinite_steps, explode_steps,
amp_overflow_steps, dropped_records), params (per-parameter statistics) and layers (per-layer
aggregates); with ``GradMonitor(histogram=True)`` on logged steps also headroom and exponents
(per layer); with ``GradMonitor(activations=True)`` on logged steps also act and act_grad (per
layer: module outputs and the gradients with respect to them), with both options act_exponents
and act_grad_exponents (their exponent histograms, per layer, shaped as exponents), and
first_nonfinite when traced.

Sinks that talk to a tracker have ``on_start(config: dict)``: the monitor hands them its settings
(``GradMonitor.config``) once, before the first record. Under ``torch.distributed``
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

One module per sink, over the protocol in ``base``: ``jsonl`` (``JsonlSink``, ``read_jsonl``),
``tensorboard``, ``metrics_sink`` (``MetricsSink``), ``wandb``, ``mlflow``, ``logging_sink``
(``LoggingSink``), ``prometheus`` (``PrometheusSink``, ``grafana_dashboard_path`` and the
dashboard beside it); ``record_metrics`` holds the record-to-metrics mapping (``metrics``,
``exponent_buckets``) and ``pictures`` the window of records the drawing sinks share. Every
public name is importable from this package (and from ``gradfuse.sinks``).

Layer: monitor. Imports ``gradfuse.utils``, ``gradfuse.numerics.histogram`` (the bins) and
``gradfuse.monitor.figures`` (the pictures); the trackers are imported on first use.
"""
from gradfuse.monitor.sinks.base import Sink
from gradfuse.monitor.sinks.jsonl import JsonlSink, read_jsonl
from gradfuse.monitor.sinks.logging_sink import LoggingSink
from gradfuse.monitor.sinks.metrics_sink import MetricsSink
from gradfuse.monitor.sinks.mlflow import MLflowSink
from gradfuse.monitor.sinks.prometheus import PrometheusSink, grafana_dashboard_path
from gradfuse.monitor.sinks.record_metrics import exponent_buckets, metrics
from gradfuse.monitor.sinks.tensorboard import TensorBoardSink
from gradfuse.monitor.sinks.wandb import WandbSink

__all__ = ["JsonlSink", "LoggingSink", "MLflowSink", "MetricsSink", "PrometheusSink", "Sink", "TensorBoardSink",
           "WandbSink", "exponent_buckets", "grafana_dashboard_path", "metrics", "read_jsonl"]
