"""A record as flat metric names -> numbers (``metrics``), and its exponent histograms on the
log2 axis (``exponent_buckets``, ``exponent_histograms``): what the metric sinks and the
integrations log.

Layer: monitor. Imports ``gradfuse.numerics.histogram`` (the bins).
"""
from __future__ import annotations

from gradfuse.numerics.histogram import EXPONENT_OFFSET, MAX_EXPONENT, MIN_EXPONENT

# The per-layer optimizer statistics of a record (``gradfuse.dynamics.update_ratio``), each
# logged as ``<key>/<layer>``.
UPDATE_KEYS = ("update_ratio", "weight_norm", "update_norm", "update_rms", "moment1_rms", "moment2_rms",
               "eps_dominated", "update_nonfinite", "moment_nonfinite", "weight_nonfinite")


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
            ``update_ratio/<layer>``, ``weight_norm/<layer>``, ``update_norm/<layer>``,
            ``update_rms/<layer>``, ``moment1_rms/<layer>``, ``moment2_rms/<layer>``,
            ``eps_dominated/<layer>``, ``update_nonfinite/<layer>``, ``moment_nonfinite/<layer>``,
            ``weight_nonfinite/<layer>``, ``grad/update_clipped``, and
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
    for key in UPDATE_KEYS:  # GradMonitor(update_ratios=...): the optimizer's statistics per layer
        for layer, value in (record.get(key) or {}).items():
            m[f"{key}/{layer}"] = float(value)
    if "update_clipped" in record:  # GradMonitor(max_update_rms=...)
        m["grad/update_clipped"] = float(record["update_clipped"])
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


def exponent_histograms(record: dict) -> list[tuple[str, list[int], list[int]]]:
    """Every exponent histogram a record holds, as the sinks that draw histograms write them.

    The record's ``exponents`` as ``grad_exponent/<layer>``, ``act_exponents`` as
    ``activation_exponent/<layer>`` and ``act_grad_exponents`` as
    ``activation_grad_exponent/<layer>``; a layer with no exponent bin filled is left out.

    Args:
        record: A record, as ``GradMonitor.record`` builds it.

    Returns:
        ``(tag, edges, counts)`` per histogram, edges and counts as ``exponent_buckets`` gives
            them.
    """
    out = []
    for key, prefix in _EXPONENT_HISTOGRAMS:
        for layer, entry in (record.get(key) or {}).items():
            buckets = exponent_buckets(entry)
            if buckets is not None:
                out.append((f"{prefix}/{layer}", *buckets))
    return out
