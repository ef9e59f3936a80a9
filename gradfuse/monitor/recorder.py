"""The flight recorder: the last K steps of per-layer statistics in a ring buffer on the device,
spike detection on the device, and the dump a spike (or any anomaly) leaves behind.

A ``GradMonitor(recorder=...)`` writes one row per step without reading the host (a device-side
index), decides on the device whether the loss, the total gradient norm or the total update norm
spiked (one more bit of the monitor's one 0-d anomaly flag), and on an anomaly writes the ring
to a file (``gradfuse.monitor.flight_dump``) that ``python -m gradfuse explain`` reads.

Layer: monitor. Imports ``gradfuse.core``, ``gradfuse.activations``, ``gradfuse.dynamics``,
``gradfuse.ops`` and the monitor's dump file and spike detector.
"""
from __future__ import annotations

import math
import os
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

from gradfuse.activations.stats import output_layer
from gradfuse.core.host_copy import HostCopy
from gradfuse.core.layers import layer_of
from gradfuse.dynamics.update_plan import LAYER_FIELDS as UPDATE_LAYER_FIELDS
from gradfuse.dynamics.update_plan import layer_values, plan_updates, unavailable_reason
from gradfuse.monitor.flight_dump import write_dump
from gradfuse.monitor.spikes import GRAD, LOSS, SPIKE_QUANTITIES, UPDATE, SpikeDetector
from gradfuse.ops import INF, MAXABS, NAN, SUMSQ, stats_dtype
from gradfuse.ops.layout import UPDATE_NUMEL, UPDATE_SUMSQ
from gradfuse.utils import warn

SCALAR_FIELDS = ("loss", "grad_norm", "update_norm", "clip_coef", "nonfinite", "skipped")
LAYER_FIELDS = ("grad_l2", "grad_linf", "grad_nonfinite", "update_rms", "update_ratio", "exp_avg_rms",
                "exp_avg_sq_rms", "act_rms")


def installed_version() -> str:
    """The installed gradfuse distribution's version ("unknown" when it is not installed)."""
    try:
        return metadata.version("gradfuse")
    except metadata.PackageNotFoundError:
        return "unknown"


class FlightRecorder:
    """The last ``steps`` steps of per-layer statistics, kept on the device, and a spike detector.

    Given to ``GradMonitor(recorder=...)`` (``True``: the defaults; an int: ``steps``). It binds
    to the monitor on its first step (the parameters, their names, the layer grouping of
    ``layer_depth``, the device of the statistics). Every step it writes one row at a device-side
    index, with no host read:

    - scalars (``SCALAR_FIELDS``): ``loss`` (when the loop passes it: ``monitor.step(loss=loss)``,
      ``attach`` and the integrations), ``grad_norm`` (the total norm of the monitor's
      ``norm_type``, before clipping), ``update_norm`` (total L2 norm of the optimizer's update),
      ``clip_coef`` (1 when nothing was clipped), ``nonfinite`` (NaN + Inf elements),
      ``skipped`` (1 when a policy skipped the step);
    - per layer (``LAYER_FIELDS``, layers as the monitor's records group parameters):
      ``grad_l2``, ``grad_linf``, ``grad_nonfinite``; with an optimizer ``update_rms``
      (sqrt(sum u^2 / numel)), ``update_ratio`` (|u| / |w|), ``exp_avg_rms`` (the RMS of the
      first moment as the step leaves it: Adam's ``exp_avg``, SGD's momentum buffer) and
      ``exp_avg_sq_rms`` (Adam: the RMS of the bias-corrected root sqrt(v') / sqrt(1 - beta2^t)
      of the second moment as the step leaves it); with
      ``GradMonitor(activations=True)``, on the steps whose activations are captured,
      ``act_rms`` (the RMS of the layer's module outputs).

    NaN marks a value that is not available at that step (no loss passed, no optimizer, a
    skipped step's update, a layer without a gradient). Memory: ``steps x layers x 8`` float64
    values per layer field table (``steps x layers x 64`` bytes) plus ``steps x 6`` scalars and
    ``window x 3`` values of spike history; float32 on a device without float64.

    The update statistics are those of the update the optimizer is about to apply
    (``gradfuse.dynamics.update_plan``: SGD, Adam, AdamW), taken right before
    ``optimizer.step()`` by the fused update op: one pass over the weights, the gradients and the
    optimizer's state, no temporaries, no host read (the pass the monitor's ``update_ratios``
    takes, when it takes one at that step for the same optimizers, serves both). The optimizer
    is ``optimizer``, else the monitor's ``update_ratios`` optimizers, else the one
    ``gradfuse.attach`` or an integration steps.

    Spikes: for each of loss, gradient norm and update norm the history is its previous
    ``window`` finite values (of this run, or restored by ``load_state_dict``). With at least
    ``warmup`` of them, ``(mean, std) = torch.std_mean(history)`` (unbiased) and the step is a
    spike when ``x - mean > sigma * std``: upward only, a drop is no spike (the rule of
    OLMo-core's ``SkipStepOptimizer``, which takes ``|x - mean|``). A skipped step's update is
    not applied and stays out of the update history. The loss and the gradient norm are decided
    before the monitor's policies, in the same 0-d flag the monitor reads for its other
    policies; the update exists only after the clip, so an update-norm spike at step t is
    recorded at step t and acted on by the policy at step t + 1 (as is a loss given after its
    step, ``record_loss``). The message of a spike names the quantities and the layers whose
    z-scores (against the recorded steps before) are largest.

    Args:
        steps: The ring's length K (steps kept), >= 1.
        window: The spike history's length, >= 2.
        warmup: The values needed before the first decision; None: ``max(20, window // 2)``.
            At most ``window``.
        sigma: A spike is above ``mean + sigma * std``; > 0.
        dump_dir: Where the automatic dumps go (``<dump_dir>/step<step>-<kind>.gfdump``).
        max_dumps: At most this many automatic dumps per run (on-demand dumps, ``dump(path)``,
            are not bounded but are counted in ``dumps``).
        record_updates: Record the optimizer's update statistics (when an optimizer is known): the
            update norm and its spikes, per layer the update RMS and ratio and the moments' RMS.
            Off by default: it is one fused pass over the weights, the gradients and the
            optimizer's state every step (no temporaries; for AdamW the weight, the gradient and
            the two moments are read once each), where the rest of the recorder costs 0.02% of a
            GPT-2 small CPU step (``benchmarks/recorder_cost.py`` measures both). With
            ``update_ratios`` on the monitor the pass is shared.
        optimizer: The optimizer (or a list) whose updates are recorded.

    Attributes:
        dumps (int): Dumps written.
        failed_dumps (int): Dumps that failed to write (warned about, never raised).
        last_dump (Path | None): The latest dump written.
        layers (list[str]): The layers, once bound.

    Raises:
        ValueError: an argument out of range.

    Example:
        ```python
        monitor = gradfuse.GradMonitor(model, recorder=gradfuse.FlightRecorder(steps=64),
                                       on_spike="dump")
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            if not monitor.step(loss=loss).skip:
                optimizer.step()
            optimizer.zero_grad()
        monitor.recorder.dump("now.gfdump")     # on demand, any time
        ```
    """

    def __init__(self, steps: int = 64, window: int = 128, warmup: int | None = None, sigma: float = 6.0,
                 dump_dir: str | os.PathLike = "gradfuse_dumps", max_dumps: int = 5, record_updates: bool = False,
                 optimizer=None):
        warmup = max(20, window // 2) if warmup is None else warmup
        for name, value, low in (("steps", steps, 1), ("window", window, 2), ("warmup", warmup, 2),
                                 ("max_dumps", max_dumps, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"gradfuse.FlightRecorder: {name} must be an int >= {low}, got {value!r}")
        if warmup > window:
            raise ValueError(f"gradfuse.FlightRecorder: warmup ({warmup}) must be at most window ({window}): "
                             "no step would ever be decided")
        if not (isinstance(sigma, (int, float)) and sigma > 0):
            raise ValueError(f"gradfuse.FlightRecorder: sigma must be > 0, got {sigma!r}")
        self.steps, self.window, self.warmup, self.sigma = steps, window, warmup, float(sigma)
        self.spikes = SpikeDetector(window, warmup, float(sigma))
        self.dump_dir = Path(dump_dir)
        self.max_dumps = max_dumps
        self.record_updates = record_updates
        self.optimizers = ([] if optimizer is None else
                           [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer))
        self.dumps = 0
        self.failed_dumps = 0
        self.last_dump: Path | None = None
        self.layers: list[str] = []
        self._auto_dumps = 0
        self._warned: set[str] = set()
        self._bound = False
        self._configured = False
        self._index_cache: dict = {}

    # -- binding -------------------------------------------------------------------------------
    def configure(self, names: list[str], names_by_param: dict | None, layer_depth: int | None,
                  norm_type: float, optimizers=()) -> None:
        """What the monitor tells the recorder when it is made: its parameter names (in
        order), id(parameter) -> name, its layer grouping and norm order, and the optimizers
        whose updates to record when none was given. The ring is made on the first step, on the
        device of the gradients.

        Raises:
            RuntimeError: the recorder is configured already (one recorder per monitor).
        """
        if self._configured:
            raise RuntimeError("gradfuse.FlightRecorder: this recorder belongs to another monitor already")
        self._configured = True
        self.layer_depth, self.norm_type = layer_depth, float(norm_type)
        self.layers = list(dict.fromkeys(layer_of(n, layer_depth) for n in names))
        self._layer_index = {name: i for i, name in enumerate(self.layers)}
        self.names = {layer: [n for n in names if layer_of(n, layer_depth) == layer] for layer in self.layers}
        self.names_by_param = dict(names_by_param or {})
        if not self.optimizers:
            self.optimizers = [o for o in optimizers if o is not None]

    def _bind(self, device) -> None:
        """Makes the ring on ``device`` (the first step with gradients)."""
        self.updates_unavailable = next((r for r in map(unavailable_reason, self.optimizers) if r), None)
        if self.record_updates and self.updates_unavailable:
            warn(f"gradfuse.FlightRecorder: {self.updates_unavailable}; update_* fields are NaN")
        self.device = torch.device(device)
        dt = self.dtype = stats_dtype(self.device)
        K, L = self.steps, len(self.layers)
        kw = dict(device=self.device)
        self.scalar_ring = torch.full((K, len(SCALAR_FIELDS)), math.nan, dtype=dt, **kw)
        self.layer_ring = torch.full((K, L, len(LAYER_FIELDS)), math.nan, dtype=dt, **kw)
        self.step_ring = torch.zeros(K, dtype=torch.int64, **kw)
        self.spike_ring = torch.zeros((K, 3), dtype=torch.bool, **kw)
        self.index = torch.zeros((), dtype=torch.int64, **kw)
        self.count = torch.zeros((), dtype=torch.int64, **kw)
        self.spikes.bind(self.device, dt)
        self._pending = torch.zeros(3, dtype=torch.bool, **kw)  # spikes to act on at the next step
        self._acted = torch.zeros(3, dtype=torch.bool, **kw)  # the spikes acted on at this step
        self.spiked = torch.zeros((), dtype=torch.bool, **kw)
        self._committed, self._step = True, None
        self._bound = True

    @property
    def bound(self) -> bool:
        """Whether the recorder has bound to a monitor (its first step ran)."""
        return self._bound

    def _layer_ids(self, names: list[str]) -> torch.Tensor:
        """The layer index of each name (``len(layers)`` for a name outside them), on the
        device; cached per list of names (one copy to the device, no read)."""
        key = tuple(names)
        ids = self._index_cache.get(key)
        if ids is None:
            L = len(self.layers)
            ids = torch.tensor([self._layer_index.get(layer_of(n, self.layer_depth), L) for n in names],
                               dtype=torch.int64).to(self.device)
            if len(self._index_cache) > 64:
                self._index_cache.clear()
            self._index_cache[key] = ids
        return ids

    def _by_layer(self, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Per-row values summed per layer, ``[L]`` (rows outside the layers dropped)."""
        out = torch.zeros(len(self.layers) + 1, dtype=self.dtype, device=self.device)
        return out.index_add_(0, ids, values.to(self.device, self.dtype))[:-1]

    # -- one step ------------------------------------------------------------------------------
    def observe(self, step: int, stats, loss=None, activations=None) -> None:
        """The first half of a step, before the monitor's policies: this step's gradient rows,
        loss and activations, and whether it spiked (``spiked``, a 0-d bool on the device: a
        loss or gradient-norm spike now, or an update-norm / late-loss spike of the step before).

        Args:
            step: The monitor's step number.
            stats: The step's ``GradStats``.
            loss: The loss (a tensor or a number), or None.
            activations: The step's full ``ActivationCapture``, or None.
        """
        if not self._bound:
            if not len(stats):
                return  # no gradient yet: the ring is made on the device of the first ones
            self._bind(stats.floats.device)
        dt, dev = self.dtype, self.device
        self._step = step
        s = torch.full((len(SCALAR_FIELDS),), math.nan, dtype=dt, device=dev)
        rows = torch.full((len(self.layers), len(LAYER_FIELDS)), math.nan, dtype=dt, device=dev)
        if loss is not None:
            s[LOSS] = torch.as_tensor(loss).detach().reshape(()).to(dev, dt)
        s[3], s[5] = 1.0, 0.0  # clip_coef, skipped: set by commit
        if len(stats):
            f, c = stats.floats, stats.counts
            ids = self._layer_ids(stats.names)
            bad = (c[:, NAN] + c[:, INF]).to(dt)
            s[GRAD] = stats.plain_total_norm.to(dev, dt)
            s[4] = bad.sum().to(dev)
            have = self._by_layer(ids, torch.ones(len(ids), dtype=dt, device=ids.device)) > 0
            linf = torch.zeros(len(self.layers) + 1, dtype=dt, device=dev).scatter_reduce_(
                0, ids, f[:, MAXABS].to(dev, dt), "amax")[:-1]
            grads = torch.stack([self._by_layer(ids, f[:, SUMSQ]).sqrt(), linf, self._by_layer(ids, bad)], 1)
            rows[:, :3] = torch.where(have[:, None], grads, math.nan)
        if activations is not None:
            fwd = activations.forward
            if len(fwd):
                ids = self._layer_ids([output_layer(m, self.layer_depth) + ".out" for m in fwd.modules])
                n = self._by_layer(ids, fwd.numel)
                rows[:, 7] = torch.where(n > 0, (self._by_layer(ids, fwd.floats[:, SUMSQ]) / n).sqrt(), math.nan)
        self._scalars, self._rows = s, rows
        bits = self.spikes.decide(s[:2], (LOSS, GRAD))
        self._spike = torch.cat([bits, bits.new_zeros(1)])
        self._acted = self._spike | self._pending
        self.spiked = self._acted.any()
        self._pending = torch.zeros_like(self._pending)
        self._committed = False

    def commit(self, stats, *, skipped, applied, updates=None, snapshot: bool = False):
        """The second half, before ``optimizer.step()``: the clip coefficient, the update the
        optimizer is about to apply (when ``applied``), and the row written at the device-side
        index (no host read). Once per step; later calls do nothing.

        Args:
            stats: The step's ``GradStats`` (after clipping).
            skipped: A policy skipped the step: a bool, or a 0-d bool on the device (a skip
                decided there).
            applied: The optimizer applies this step's update (a bool; with a device
                ``skipped``, True: the update's fields are NaN where the flag skips).
            updates: This step's ``UpdateRows`` over the recorder's optimizers when taken
                already (``gradfuse.dynamics.update_plan.plan_updates``), else None.
            snapshot: Also start a host copy of the ring as this step leaves it (no wait).

        Returns:
            With ``snapshot``, a ``RecorderSnapshot`` (what the spike message and the dump read
                one step later); else None.
        """
        if self._committed or not self._bound:
            return None
        self._committed = True
        s, rows = self._scalars, self._rows
        before = self._before_commit() if snapshot else None
        if stats is not None and stats.clip_coef is not None:
            coef = stats.clip_coef if stats.clip_coef.dim() == 0 else stats.clip_coef.amin()
            s[3] = coef.to(self.device, self.dtype).clamp(max=1.0)
        on_device = isinstance(skipped, torch.Tensor)
        s[5] = skipped.to(self.device, self.dtype) if on_device else float(skipped)
        if on_device:  # a skipped step applies no clip (its gradients may have been clipped all the same)
            s[3] = torch.where(skipped.to(self.device), 1.0, s[3])
        if applied and self.record_updates and self.optimizers and not self.updates_unavailable:
            self._updates(s, rows, updates)
            gone = skipped.to(self.device) if on_device else None
            if gone is not None:  # a step skipped on the device applies no update
                s[UPDATE] = torch.where(gone, math.nan, s[UPDATE])
                cols = slice(LAYER_FIELDS.index("update_rms"), LAYER_FIELDS.index("exp_avg_sq_rms") + 1)
                rows[:, cols] = torch.where(gone, math.nan, rows[:, cols])
            bit = self.spikes.decide(s[UPDATE:UPDATE + 1], (UPDATE,), skip=gone)  # a skipped step's band stays
            self._spike[UPDATE] = bit[0]
            self._pending[UPDATE] = bit[0]
        self.spikes.push(s[:3], (LOSS, GRAD, UPDATE))
        i = self.index.reshape(1)
        self.scalar_ring.index_copy_(0, i, s[None])
        self.layer_ring.index_copy_(0, i, rows[None])
        self.step_ring.index_copy_(0, i, torch.full((1,), self._step, dtype=torch.int64, device=self.device))
        self.spike_ring.index_copy_(0, i, self._spike[None])
        self.index.add_(1).remainder_(self.steps)
        self.count.add_(1).clamp_(max=self.steps)
        return None if before is None else RecorderSnapshot(self, before)

    def _live(self) -> dict[str, torch.Tensor]:
        """The device tensors the spike message and the dump read."""
        return {"index": self.index, "count": self.count, "steps": self.step_ring, "scalars": self.scalar_ring,
                "layers": self.layer_ring, "spike": self.spike_ring, "acted": self._acted,
                "bands": self.spikes.bands}

    def _before_commit(self) -> dict[str, torch.Tensor]:
        """On the device, before ``commit`` writes: the bands of the step's decision, the step's
        row as observed, and the row the commit overwrites with whether the ring was full (what a
        message taken before the commit reads)."""
        i = self.index.reshape(1)
        return {"bands_before": self.spikes.bands.clone(), "full_before": self.count == self.steps,
                "rows_before": self._rows.clone(), "scalars_before": self._scalars.clone(),
                "evicted_scalars": self.scalar_ring.index_select(0, i),
                "evicted_layers": self.layer_ring.index_select(0, i)}

    def _updates(self, s: torch.Tensor, rows: torch.Tensor, planned=None) -> None:
        """The update statistics of this step into the scalars and rows, from ``planned`` (the
        ``UpdateRows`` of this step over the recorder's optimizers, when the monitor took them
        already) or from one fused update pass."""
        planned = plan_updates(self.optimizers) if planned is None else planned
        if not len(planned):
            return
        ids = self._layer_ids([self.names_by_param.get(id(p), "") for p in planned.params])
        table = layer_values(planned, ids, len(self.layers)).to(self.device, self.dtype)
        s[UPDATE] = planned.floats[:, UPDATE_SUMSQ].sum().sqrt().to(self.device, self.dtype)
        have = self._by_layer(ids, planned.counts[:, UPDATE_NUMEL].to(torch.float64)) > 0
        for field, source in (("update_rms", "update_rms"), ("update_ratio", "update_ratio"),
                              ("exp_avg_rms", "moment1_rms"), ("exp_avg_sq_rms", "moment2_rms")):
            value = table[:, UPDATE_LAYER_FIELDS.index(source)]
            rows[:, LAYER_FIELDS.index(field)] = torch.where(have, value, math.nan)

    def record_loss(self, loss) -> None:
        """The loss of the step just recorded, for loops that know it only after the step (the
        Lightning callback): written into that step's row; a loss spike then counts at the
        next step's decision. Does nothing before the first step.

        Args:
            loss: A tensor or a number.
        """
        if not self._bound:
            return
        x = torch.as_tensor(loss).detach().reshape(1).to(self.device, self.dtype)
        last = (self.index - 1).remainder(self.steps).reshape(1)
        bit = self.spikes.decide(x, (LOSS,))
        row = self.scalar_ring.index_select(0, last)
        row[:, LOSS] = x
        self.scalar_ring.index_copy_(0, last, row)
        spikes = self.spike_ring.index_select(0, last)
        spikes[:, LOSS] = bit
        self.spike_ring.index_copy_(0, last, spikes)
        self._pending[LOSS] = self._pending[LOSS] | bit[0]
        self.spikes.push(x, (LOSS,))

    # -- reading it ----------------------------------------------------------------------------
    def unroll(self, snapshot: RecorderSnapshot | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
        """The ring in step order (oldest first, the recorded steps only), read to the CPU.

        Args:
            snapshot: Read this ``RecorderSnapshot`` (the ring as a step left it, in host
                memory) instead of the ring itself.

        Returns:
            ``(header, arrays)`` as a dump holds them (the Data reference lists them); the
                header without ``step`` and ``trigger``.

        Raises:
            RuntimeError: the recorder has not bound to a monitor yet (no step ran).
        """
        if not self._bound:
            raise RuntimeError("gradfuse.FlightRecorder: no step recorded yet")
        t = self._live() if snapshot is None else snapshot.tensors()
        index, count = (int(v) for v in torch.stack([t["index"], t["count"]]).cpu())
        order = list(range(count)) if count < self.steps else list(range(index, self.steps)) + list(range(index))
        at = torch.tensor(order, dtype=torch.int64, device=t["steps"].device)
        arrays = {"steps": t["steps"][at].cpu(), "scalars": t["scalars"][at].to(torch.float64).cpu(),
                  "layers": t["layers"][at].to(torch.float64).cpu(), "spike": t["spike"][at].cpu()}
        bands = self.spikes.band_values(t["bands"])
        header = {"layers": self.layers, "layer_fields": list(LAYER_FIELDS), "scalar_fields": list(SCALAR_FIELDS),
                  "spike_quantities": list(SPIKE_QUANTITIES),
                  "config": {"steps": self.steps, "window": self.window, "warmup": self.warmup,
                             "sigma": self.sigma, "layer_depth": self.layer_depth, "norm_type": self.norm_type},
                  "bands": bands, "gradfuse_version": installed_version(),
                  "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "names": self.names}
        return header, arrays

    def spike_quantities(self, snapshot: RecorderSnapshot | None = None) -> list[str]:
        """The quantities whose spike the latest step (or ``snapshot``'s step) acts on: a loss or
        gradient-norm spike of that step, an update-norm or late-loss spike of the step before
        (reads the host)."""
        if not self._bound:
            return []
        acted = self._acted if snapshot is None else snapshot.tensors()["acted"]
        return [q for q, bit in zip(SPIKE_QUANTITIES, acted.cpu().tolist()) if bit]

    def describe_spike(self, snapshot: RecorderSnapshot | None = None) -> tuple[str, list[str]]:
        """The message of the spike the latest step (or ``snapshot``'s step) acts on: the
        quantities with their value and band, and the layers whose ``grad_l2`` (``update_rms``
        for an update spike alone) is furthest above its mean over the recorded steps before, in
        z-scores (reads the host). The message is the same from a snapshot, read a step later.

        Returns:
            ``(message, quantities)``.
        """
        quantities = self.spike_quantities(snapshot)
        _header, arrays = self.unroll(snapshot)
        lay, scal = arrays["layers"], arrays["scalars"]
        committed, bands = self._committed, None
        if snapshot is not None:  # the ring before that step's commit, as the live message reads it
            t = snapshot.tensors()
            committed, bands = False, t["bands_before"]
            if bool(t["full_before"]):
                lay = torch.cat([t["evicted_layers"].to(torch.float64), lay])
                scal = torch.cat([t["evicted_scalars"].to(torch.float64), scal])
            lay = torch.cat([lay[:-1], t["rows_before"].to(torch.float64)[None]])
            scal = torch.cat([scal[:-1], t["scalars_before"].to(torch.float64)[None]])
        elif not committed:  # the step acting on it is not in the ring yet
            lay = torch.cat([lay, self._rows.to(torch.float64).cpu()[None]])
            scal = torch.cat([scal, self._scalars.to(torch.float64).cpu()[None]])
        field = "update_rms" if quantities == ["update_norm"] else "grad_l2"
        if quantities == ["update_norm"] and not committed:
            lay = lay[:-1]  # the update of the step before
        text = self.spikes.message(quantities, scal, lay[:, :, LAYER_FIELDS.index(field)], self.layers, field, bands)
        return text, quantities

    # -- dumps ---------------------------------------------------------------------------------
    def dump(self, path: str | os.PathLike | None = None, trigger: dict | None = None,
             snapshot: RecorderSnapshot | None = None) -> Path | None:
        """Writes the ring to one file (``gradfuse.load_dump`` reads it back); never raises.

        Args:
            path: Where; None: ``<dump_dir>/step<step>-<kind>.gfdump``.
            trigger: What triggered it: ``kind`` ("spike", "nonfinite", "explode" or
                "manual"), ``anomalies``, ``message``, ``quantities``, ``first_nonfinite``, and
                ``step``; None: a manual dump of the latest step.
            snapshot: Write this ``RecorderSnapshot`` (the ring as a step left it) instead of
                the ring itself.

        Returns:
            The path written, or None: nothing recorded yet, the write failed (counted in
                ``failed_dumps`` and warned about once per kind of error), or an automatic dump
                (``path`` None with a trigger that is not manual) past ``max_dumps``.
        """
        if not self._bound or not int(self.count if snapshot is None else snapshot.tensors()["count"]):
            return None
        trigger = dict(trigger or {})
        kind = trigger.setdefault("kind", "manual")
        automatic = path is None and kind != "manual"
        if automatic and self._auto_dumps >= self.max_dumps:
            if "max_dumps" not in self._warned:
                self._warned.add("max_dumps")
                warn(f"gradfuse.FlightRecorder: max_dumps={self.max_dumps} reached; no more automatic dumps")
            return None
        for key, default in (("anomalies", []), ("message", ""), ("quantities", []), ("first_nonfinite", None)):
            trigger.setdefault(key, default)
        try:
            header, arrays = self.unroll(snapshot)
            step = int(trigger.pop("step", arrays["steps"][-1]))
            target = Path(path) if path is not None else self.dump_dir / f"step{step}-{kind}.gfdump"
            written = write_dump(target, {"step": step, "trigger": trigger, **header}, arrays)
        except Exception as e:  # a full disk, a read-only folder: training goes on
            self.failed_dumps += 1
            if type(e).__name__ not in self._warned:
                self._warned.add(type(e).__name__)
                warn(f"gradfuse.FlightRecorder: a dump could not be written ({type(e).__name__}: {e}); "
                     "failures are counted in failed_dumps")
            return None
        self._auto_dumps += automatic
        self.dumps += 1
        self.last_dump = written
        return written

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The counters and the spike histories (so that a resumed run keeps its bands), as
        plain values (reads the host)."""
        return {"dumps": self.dumps, "failed_dumps": self.failed_dumps, "auto_dumps": self._auto_dumps,
                **self.spikes.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``'s output (the histories once bound, or at binding)."""
        self.dumps = int(state.get("dumps", 0))
        self.failed_dumps = int(state.get("failed_dumps", 0))
        self._auto_dumps = int(state.get("auto_dumps", 0))
        if "history" in state:
            if len(state["history"][0]) != self.window:
                raise ValueError(f"gradfuse.FlightRecorder.load_state_dict: window {len(state['history'][0])} "
                                 f"saved, {self.window} here")
            self.spikes.load_state_dict(state)


class RecorderSnapshot:
    """A ``FlightRecorder``'s ring as one step left it, copied to host memory without blocking
    (``commit(..., snapshot=True)``): what ``describe_spike``, ``unroll`` and ``dump`` read when
    the host acts on that step one step later."""

    def __init__(self, recorder: FlightRecorder, before: dict[str, torch.Tensor]):
        tensors = {**recorder._live(), **before}
        self._keys = list(tensors)
        self._copy = HostCopy(list(tensors.values()))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The host tensors, by name (waits for the copy's event on CUDA)."""
        return dict(zip(self._keys, self._copy.get()))
