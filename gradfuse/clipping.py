"""Clipping beyond one global norm (issue 17): per-parameter and per-layer norm clipping, clipping
by value, adaptive gradient clipping (AGC, timm's semantics), ``max_norm`` schedules, the ZClip
adaptive threshold with its state on the device, and the double-clipping check of the monitor.

Every mode takes one fused statistics pass (two for AGC: weights and gradients) and one scale
or clamp pass; coefficients are computed on the device, never read by the host.

The fused ops are those of :mod:`gradfuse.ops` (``multi_tensor_scale_per_tensor_``,
``multi_tensor_unit_stats``, ``multi_tensor_unit_scale_``, ``multi_tensor_clamp_``), routed to
the compiled kernels or to their pure-PyTorch reference per device.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

from gradfuse import api, distributed, ops
from gradfuse.grad_stats import GradStats, layer_of
from gradfuse.reference import MAXABS, NUMEL, POWSUM, SUMSQ, ZERO

PER_MODES = (None, "param", "layer")


# ---------------------------------------------------------------------------------------------
# Argument checks

def check_per(per) -> str | None:
    if per not in PER_MODES:
        raise ValueError(f"gradfuse: per must be None, 'param' or 'layer', got {per!r}")
    return per


def check_clip_value(clip_value) -> float:
    try:
        v = float(clip_value)
    except (TypeError, ValueError):
        raise ValueError(f"gradfuse: clip_value must be a number, got {clip_value!r}") from None
    if math.isnan(v) or v < 0:
        raise ValueError(f"gradfuse: clip_value must be a non-negative number, got {clip_value!r}")
    return v


def check_agc_args(clip_factor, eps, norm_type) -> tuple[float, float, float]:
    cf, e = float(clip_factor), float(eps)
    if not cf > 0 or math.isinf(cf):
        raise ValueError(f"gradfuse.adaptive_clip_grad_: clip_factor must be a positive number, "
                         f"got {clip_factor!r}")
    if not e >= 0 or math.isinf(e):
        raise ValueError(f"gradfuse.adaptive_clip_grad_: eps must be a non-negative number, got {eps!r}")
    p = api._check_norm_type(norm_type)
    if p < 0:
        raise ValueError(f"gradfuse.adaptive_clip_grad_: norm_type must be >= 0 or inf, got {norm_type!r}")
    return cf, e, p


# ---------------------------------------------------------------------------------------------
# Per-parameter / per-layer norm clipping

def _row_accumulators(floats: torch.Tensor, counts: torch.Tensor, p: float) -> torch.Tensor:
    """Per row, what the norm of order ``p`` is a root of (max for inf), float64."""
    if p == 2.0:
        return floats[:, SUMSQ]
    if p == math.inf:
        return floats[:, MAXABS]
    if p == -math.inf:
        return floats[:, POWSUM]
    if p == 0.0:
        return (counts[:, NUMEL] - counts[:, ZERO]).to(torch.float64)
    return floats[:, POWSUM]


_layer_index_cache: dict = {}


def _layer_index(names: list[str], depth: int | None, device) -> tuple[torch.Tensor, int]:
    key = (tuple(names), depth, str(device))
    hit = _layer_index_cache.get(key)
    if hit is None:
        ids: dict[str, int] = {}
        idx = [ids.setdefault(layer_of(n, depth), len(ids)) for n in names]
        hit = (torch.tensor(idx, dtype=torch.int64, device=device), len(ids))
        if len(_layer_index_cache) > 64:
            _layer_index_cache.clear()
        _layer_index_cache[key] = hit
    return hit


def group_norms(s: GradStats, per: str, layer_depth: int | None = None) -> torch.Tensor:
    """The norm (of ``s.norm_type``) each row is clipped by: its own (``per="param"``) or its
    layer's (``per="layer"``: the norm of the layer's gradients viewed as one vector, layers as
    :meth:`GradStats.layers` groups them), one float64 entry per row, on the device."""
    p = s.norm_type
    if per == "param":
        if p == 0.0:
            return (s._counts[:, NUMEL] - s._counts[:, ZERO]).to(torch.float64)
        return s.norm(p) if p >= 0 or p == -math.inf else _row_accumulators(
            s._floats, s._counts, p).pow(1.0 / p)
    acc = _row_accumulators(s._floats, s._counts, p)
    if p == 0.0:  # as torch composes a group's 0-norm: its tensors with a non-zero element
        acc = (acc > 0).to(torch.float64)
    index, n = _layer_index(s.names, layer_depth, acc.device)
    if math.isinf(p):
        layer = acc.new_zeros(n).scatter_reduce(0, index, acc, "amax" if p > 0 else "amin",
                                                include_self=False)
    else:
        layer = acc.new_zeros(n).index_add_(0, index, acc)
    if p == 2.0:
        layer = layer.sqrt()
    elif not (math.isinf(p) or p in (0.0, 1.0)):
        layer = layer.pow(1.0 / p)
    return layer[index]


def scale_rows_(grads: list[torch.Tensor], coefs: torch.Tensor) -> None:
    """Multiplies ``grads[i]`` in place by ``coefs[i]`` where that is < 1 (or NaN), one
    per-tensor scale pass per (device, dtype) group; DTensors by their local shards."""
    if not grads:
        return
    if distributed.may_have_dtensors(grads):
        grads = [distributed.local_tensor(g) for g in grads]
    try:  # one (device, dtype) group, checked by the op in C++ (as api._scale_ does)
        ops.multi_tensor_scale_per_tensor_(grads, coefs.to(grads[0].device))
        return
    except RuntimeError:
        pass
    groups = api._groups(grads)
    for (device, _dtype), idx in groups.items():
        group = [grads[i] for i in idx]
        c = coefs if len(groups) == 1 else coefs[torch.tensor(idx, device=coefs.device)]
        c = c.to(device)
        try:
            ops.multi_tensor_scale_per_tensor_(group, c)
        except RuntimeError:  # sparse or complex gradients: multiplied as torch does
            for g, ci in zip(group, torch.clamp(c, max=1.0).unbind()):
                g.mul_(ci)


def clip_per_(s: GradStats, grads: list[torch.Tensor], max_norm: float, per: str,
              layer_depth: int | None = None) -> GradStats:
    """Scales each row of ``s`` (taken of ``grads``) by torch's coefficient of its own group:
    ``clamp(max_norm / (norm + 1e-6), max=1)``. Returns ``s`` with a per-row ``clip_coef``."""
    norms = group_norms(s, per, layer_depth)
    coefs = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    scale_rows_(grads, coefs)
    out = s._replace(clip_coef=coefs, max_norm=max_norm)
    out.clip_per = per
    return out


# ---------------------------------------------------------------------------------------------
# Clipping by value

def clamp_stats_(names: list[str], grads: list[torch.Tensor], clip_value: float) -> GradStats:
    """Clamps ``grads`` in place to [-clip_value, clip_value] in one fused pass per (device,
    dtype) group; returns the statistics from before clamping (L2 norms) with ``clamped``, the
    number of elements changed per row."""
    if distributed.may_have_dtensors(grads):
        raise TypeError("gradfuse: clipping by value with statistics takes plain tensors, not "
                        "DTensor gradients; use gradfuse.clip_grad_value_ (clamps the local shards)")
    api._check_tensors(names, grads, "gradient")
    if not grads:
        s = api._fused_stats(names, grads, 2.0)
        s.clamped, s.clip_value = torch.empty(0, dtype=torch.int64), clip_value
        return s
    groups = api._groups(grads)
    order: list[int] = []
    parts_f, parts_c, parts_k = [], [], []
    for (_device, _dtype), idx in groups.items():
        f, c, k = ops.multi_tensor_clamp_([grads[i] for i in idx], clip_value)
        order += idx
        parts_f.append(f)
        parts_c.append(c)
        parts_k.append(k)
    dev = parts_f[0].device
    floats = torch.cat([f.to(dev) for f in parts_f])
    counts = torch.cat([c.to(dev) for c in parts_c])
    clamped = torch.cat([k.to(dev) for k in parts_k])
    row_names = [names[i] for i in order]
    total = floats[:, SUMSQ].sum().sqrt()
    dtype = grads[0].dtype if len(groups) == 1 else torch.float32
    s = GradStats(row_names, floats, counts, 2.0, total.to(dtype))
    s.clamped, s.clip_value = clamped, clip_value
    return s


@torch.no_grad()
def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
    """Drop-in for :func:`torch.nn.utils.clip_grad_value_`: clamps the gradients of
    ``parameters`` in place to ``[-clip_value, clip_value]``, one fused pass per (device, dtype)
    group. Same arguments and results; a negative or NaN ``clip_value`` is refused with a
    ValueError (torch clamps every gradient to ``-|clip_value|`` / NaN). ``foreach=True`` on a
    device without foreach support raises as torch does.

    Example::

        loss.backward()
        gradfuse.clip_grad_value_(model.parameters(), clip_value=0.5)

    For the statistics from before clamping and the clamped counts:
    ``gradfuse.clip_(model, value=0.5)``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_value = check_clip_value(clip_value)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    for (device, _dtype), idx in api._groups(grads).items():
        group = [grads[i] for i in idx]
        if foreach and not _device_has_foreach_support(device):
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on "
                               f"{device.type} tensors")
        if distributed.may_have_dtensors(group):
            group = [distributed.local_tensor(g) for g in group]
        if (all(g.layout == torch.strided and g.dtype in api.SUPPORTED_DTYPES for g in group)
                and _has_foreach_support(group, device=device)):
            ops.multi_tensor_clamp_(group, clip_value)
        else:  # what the fused op does not take (sparse, integer...): torch's own loop
            for g in group:
                g.clamp_(min=-clip_value, max=clip_value)


# ---------------------------------------------------------------------------------------------
# Adaptive gradient clipping

def _unit_count(t: torch.Tensor) -> int:
    # timm's unitwise_norm: the output dimension of a weight (dim 0) for ndim > 1, else whole
    return t.shape[0] if t.ndim > 1 else 1


def _unit_norms(floats, counts, p: float) -> torch.Tensor:
    acc = _row_accumulators(floats, counts, p)
    if p == 2.0:
        return acc.sqrt()
    if math.isinf(p) or p in (0.0, 1.0):
        return acc
    return acc.pow(1.0 / p)


@torch.no_grad()
def adaptive_clip_grad_(parameters, clip_factor: float = 0.01, eps: float = 1e-3,
                        norm_type: float = 2.0) -> None:
    """Adaptive gradient clipping (Brock et al. 2021), as ``timm.utils.adaptive_clip_grad``:
    each unit of a gradient (a row along dim 0 of a weight of 2 or more dims; a whole bias or
    norm vector) whose norm is at least ``clip_factor * max(||unit of the weight||, eps)`` is
    scaled to that norm. Same results as timm, with the unit norms of the weights and of the
    gradients from two fused passes and one unit-wise scale pass, coefficients on the device.

    Example::

        loss.backward()
        gradfuse.adaptive_clip_grad_(model.parameters(), clip_factor=0.01)

    DTensor parameters are refused (a unit of a sharded weight spans ranks).
    """
    clip_factor, eps, p = check_agc_args(clip_factor, eps, norm_type)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [q for q in parameters if q.grad is not None]
    if not params:
        return
    weights = [q.detach() for q in params]
    grads = [q.grad.detach() for q in params]
    if distributed.may_have_dtensors(weights) or distributed.may_have_dtensors(grads):
        raise TypeError("gradfuse.adaptive_clip_grad_: DTensor parameters are not supported: "
                        "the unit-wise norms of a sharded weight span ranks (gather the full "
                        "parameters first, or clip per rank on plain local tensors)")
    names = [f"[{i}]" for i in range(len(params))]
    api._check_tensors(names, weights, "parameter")
    api._check_tensors(names, grads, "gradient")
    keep = [i for i, g in enumerate(grads) if g.numel() > 0]
    for (device, dtype), idx in api._groups([grads[i] for i in keep]).items():
        idx = [keep[i] for i in idx]
        g_group = [grads[i] for i in idx]
        w_group = [weights[i] for i in idx]
        units = [_unit_count(g) for g in g_group]
        gn = _unit_norms(*ops.multi_tensor_unit_stats(g_group, units, p), p)
        wn = _weight_unit_norms(w_group, units, p, device)
        # timm's arithmetic, in the parameters' dtype: the max norm and coefficient round as there
        wdt = w_group[0].dtype if all(w.dtype == w_group[0].dtype for w in w_group) else dtype
        max_norm = wn.to(device, wdt).clamp(min=eps).mul(clip_factor).to(dtype)
        gn = gn.to(device, dtype)
        coef = torch.where(gn < max_norm, torch.ones_like(gn), max_norm / gn.clamp(min=1e-6))
        coef = coef.to(torch.float64 if dtype == torch.float64 else torch.float32)
        ops.multi_tensor_unit_scale_(g_group, units, coef, True)


def _weight_unit_norms(weights, units, p: float, device) -> torch.Tensor:
    """Unit-wise norms of the weights, one fused pass per (device, dtype) of the weights."""
    groups = api._groups(weights)
    if len(groups) == 1:
        return _unit_norms(*ops.multi_tensor_unit_stats(weights, units, p), p).to(device)
    offsets = [0]
    for u in units:
        offsets.append(offsets[-1] + u)
    out = torch.empty(offsets[-1], dtype=torch.float64, device=device)
    for (_dev, _dt), idx in groups.items():
        n = _unit_norms(*ops.multi_tensor_unit_stats([weights[i] for i in idx], [units[i] for i in idx], p), p)
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in idx]).to(device)
        out[rows] = n.to(device)
    return out


# ---------------------------------------------------------------------------------------------
# ZClip: z-score adaptive thresholds, state on the device

class ZClip:
    """Drop-in for ``zclip.ZClip`` (Kumar et al. 2025) whose EMA state lives in device tensors:
    the threshold and the clip are decided on the device, with no host sync per step.

    ``zc.step(model)`` after ``backward()`` clips the gradients of ``model`` and returns their
    total norm before clipping (a 0-d device tensor; zclip returns a Python float, which is a
    host sync). ``GradMonitor(max_norm=gradfuse.ZClip(...))`` (and ``attach``, the Lightning
    and HF integrations) use it as the monitor's threshold, from the monitor's own stats pass.

    Semantics are zclip's: during the first ``warmup_steps`` steps the norms are collected (here
    in a device buffer) and only ``max_grad_norm`` clips (as ``clip_grad_norm_``); then mean and
    variance are initialised from them and follow an EMA with ``alpha``. ``mode="zscore"``: a
    norm whose z-score exceeds ``z_thresh`` is clipped to ``mean + z_thresh * std / (z / z_thresh)``
    times ``clip_factor`` (``clip_option="adaptive_scaling"``) or to the mean (``"mean"``);
    ``mode="percentile"``: to ``mean + z_thresh * std`` whenever above it. ``max_grad_norm``
    caps the threshold. The EMA takes the clipped value, or nothing on a spike with
    ``skip_update_on_spike``. Unlike zclip, ``max_grad_norm`` defaults to None (no cap).

    After each step ``last_total_norm``, ``last_threshold`` (inf where nothing clips) and
    ``last_clip_coef`` are device tensors; ``state_dict()`` / ``load_state_dict()`` carry the
    state (GradMonitor includes it in its own).
    """

    def __init__(self, alpha: float = 0.97, z_thresh: float = 2.5, max_grad_norm: float | None = None,
                 eps: float = 1e-6, warmup_steps: int = 25, mode: str = "zscore",
                 clip_option: str = "adaptive_scaling", clip_factor: float = 1.0,
                 skip_update_on_spike: bool = False):
        mode = str(mode).lower()
        if mode not in ("zscore", "percentile"):
            raise ValueError(f"gradfuse.ZClip: mode must be 'zscore' or 'percentile', got {mode!r}")
        if mode == "zscore":
            clip_option = str(clip_option).lower()
            if clip_option not in ("mean", "adaptive_scaling"):
                raise ValueError("gradfuse.ZClip: clip_option must be 'mean' or 'adaptive_scaling' "
                                 f"in zscore mode, got {clip_option!r}")
        else:
            clip_option = None
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"gradfuse.ZClip: alpha must be in [0, 1], got {alpha!r}")
        if not float(z_thresh) > 0:
            raise ValueError(f"gradfuse.ZClip: z_thresh must be > 0, got {z_thresh!r}")
        if max_grad_norm is not None:
            max_grad_norm = api._check_max_norm(max_grad_norm)
        if int(warmup_steps) < 0:
            raise ValueError(f"gradfuse.ZClip: warmup_steps must be >= 0, got {warmup_steps!r}")
        if not float(clip_factor) > 0:
            raise ValueError(f"gradfuse.ZClip: clip_factor must be > 0, got {clip_factor!r}")
        self.alpha, self.z_thresh, self.eps = float(alpha), float(z_thresh), float(eps)
        self.max_grad_norm = max_grad_norm
        self.warmup_steps = int(warmup_steps)
        self.mode, self.clip_option = mode, clip_option
        self.clip_factor = float(clip_factor)
        self.skip_update_on_spike = bool(skip_update_on_spike)
        self.steps = 0  # host counter: warm-up is known without reading the device
        self._buffer: torch.Tensor | None = None
        self._mean: torch.Tensor | None = None
        self._var: torch.Tensor | None = None
        self.last_total_norm: torch.Tensor | None = None
        self.last_threshold: torch.Tensor | None = None
        self.last_clip_coef: torch.Tensor | None = None
        self._watch = None

    @property
    def initialized(self) -> bool:
        return self.steps >= max(self.warmup_steps, 1)

    @property
    def mean(self) -> torch.Tensor | None:
        return self._mean

    @property
    def var(self) -> torch.Tensor | None:
        return self._var

    def __repr__(self) -> str:
        return (f"ZClip(alpha={self.alpha}, z_thresh={self.z_thresh}, max_grad_norm="
                f"{self.max_grad_norm}, warmup_steps={self.warmup_steps}, mode={self.mode!r}, "
                f"clip_option={self.clip_option!r}, clip_factor={self.clip_factor}, "
                f"skip_update_on_spike={self.skip_update_on_spike})")

    def _state_on(self, device) -> None:
        if self._buffer is None or self._buffer.device != device:
            n = max(self.warmup_steps, 1)
            f64 = dict(dtype=torch.float64, device=device)
            self._buffer = (torch.zeros(n, **f64) if self._buffer is None else self._buffer.to(device))
            self._mean = torch.zeros((), **f64) if self._mean is None else self._mean.to(device)
            self._var = torch.zeros((), **f64) if self._var is None else self._var.to(device)

    def clip_coef(self, total_norm: torch.Tensor) -> torch.Tensor:
        """Takes one step of the state for this total norm; returns the coefficient (float64,
        0-d, at most 1) the gradients are to be multiplied by. No host sync."""
        g = total_norm.detach().reshape(()).to(torch.float64)
        self._state_on(g.device)
        inf = torch.full((), math.inf, dtype=torch.float64, device=g.device)
        if not self.initialized:
            self._buffer[self.steps].copy_(g)
            self.steps += 1
            if self.initialized:  # as zclip: population mean and variance of the warm-up norms
                mean = self._buffer.sum() / self._buffer.numel()
                self._mean.copy_(mean)
                self._var.copy_(((self._buffer - mean) ** 2).sum() / self._buffer.numel())
            if self.max_grad_norm is None:
                coef, threshold = torch.ones_like(g), inf
            else:  # torch.nn.utils.clip_grad_norm_'s coefficient
                coef = torch.clamp(self.max_grad_norm / (g + 1e-6), max=1.0)
                threshold = torch.full_like(g, self.max_grad_norm)
        else:
            self.steps += 1
            mean, var = self._mean, self._var
            std = var.sqrt()
            if self.mode == "percentile":
                thr = mean + self.z_thresh * std
                spike = g > thr
            else:
                z = (g - mean) / (std + self.eps)
                spike = z > self.z_thresh
                if self.clip_option == "adaptive_scaling":
                    eta = z / self.z_thresh
                    thr = (mean + (self.z_thresh * std) / eta) * self.clip_factor
                else:
                    thr = mean
            adaptive = torch.where(spike, thr, g)
            effective = adaptive
            if self.max_grad_norm is not None:  # Python's min(adaptive, max): max only if smaller
                effective = torch.where(self.max_grad_norm < adaptive,
                                        torch.full_like(adaptive, self.max_grad_norm), adaptive)
            coef = torch.where(g > effective, effective / (g + 1e-6), torch.ones_like(g))
            threshold = torch.where(spike | (effective < adaptive), effective, inf)
            x = adaptive  # the EMA takes the clip value on a spike, else the norm
            new_mean = self.alpha * mean + (1 - self.alpha) * x
            new_var = self.alpha * var + (1 - self.alpha) * (x - new_mean) ** 2
            if self.skip_update_on_spike:
                new_mean = torch.where(spike, mean, new_mean)
                new_var = torch.where(spike, var, new_var)
            self._mean.copy_(new_mean)
            self._var.copy_(new_var)
        self.last_total_norm, self.last_threshold, self.last_clip_coef = g, threshold, coef
        return coef

    @torch.no_grad()
    def step(self, model) -> torch.Tensor:
        """zclip's ``step``: call after ``loss.backward()``, before ``optimizer.step()``. Clips the
        gradients of ``model`` (a module, or an iterable of parameters) in place; returns their
        total L2 norm before clipping as a 0-d device tensor (no host sync)."""
        from gradfuse.grad_watch import GradWatch
        if self._watch is None or self._watch[0] is not model:
            self._watch = (model, GradWatch(model))
        w = self._watch[1]
        s = w.stats()
        if not len(s):
            return s.total_norm
        coef = self.clip_coef(s._total)
        # From C++ when the watch's fast path served the stats: no per-parameter Python
        if w.last_path == "fast" and w._scale_by(_scale_dtype(coef, s._total.dtype)):
            return s.total_norm
        _names, _params, grads = api._with_grads(w.names, w.params)
        scale_total_(grads, coef, s._total.dtype)
        return s.total_norm

    def state_dict(self) -> dict:
        """The configuration, the host step count and the device state (tensors, not read)."""
        return {"steps": self.steps, "buffer": self._buffer, "mean": self._mean, "var": self._var,
                "config": {"alpha": self.alpha, "z_thresh": self.z_thresh,
                           "max_grad_norm": self.max_grad_norm, "eps": self.eps,
                           "warmup_steps": self.warmup_steps, "mode": self.mode,
                           "clip_option": self.clip_option, "clip_factor": self.clip_factor,
                           "skip_update_on_spike": self.skip_update_on_spike}}

    def load_state_dict(self, state: dict) -> None:
        cfg = state.get("config", {})
        if cfg.get("warmup_steps", self.warmup_steps) != self.warmup_steps:
            raise ValueError(f"gradfuse.ZClip.load_state_dict: saved with warmup_steps="
                             f"{cfg['warmup_steps']}, this ZClip has {self.warmup_steps}")
        self.steps = int(state["steps"])
        buf = state.get("buffer")
        self._buffer = None if buf is None else buf.detach().clone().to(torch.float64)
        self._mean = None if state.get("mean") is None else state["mean"].detach().clone().double()
        self._var = None if state.get("var") is None else state["var"].detach().clone().double()


def _scale_dtype(coef: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return coef.to(dtype if dtype == torch.float64 else torch.float32)


def scale_total_(grads: list[torch.Tensor], coef: torch.Tensor, dtype: torch.dtype) -> None:
    """Multiplies every gradient by the 0-d ``coef`` where it is < 1 (decided on the device)."""
    api._scale_(grads, _scale_dtype(coef, dtype))


# ---------------------------------------------------------------------------------------------
# max_norm: a number, a schedule (callable of the step) or a ZClip

def check_max_norm_arg(max_norm):
    """What GradMonitor and the integrations take as ``max_norm``: None, a number, a ZClip, or a
    callable of the step number returning a number."""
    if max_norm is None or isinstance(max_norm, ZClip):
        return max_norm
    if callable(max_norm):
        return max_norm
    return api._check_max_norm(max_norm)


def describe_mode(max_norm, monitor_kwargs: dict) -> str | None:
    """How an integration's own clipping is configured, in words (None: not at all)."""
    if monitor_kwargs.get("clip_value") is not None:
        return f"clip_value={monitor_kwargs['clip_value']:g}"
    if monitor_kwargs.get("agc") is not None:
        return f"agc={monitor_kwargs['agc']:g}"
    if max_norm is None:
        return None
    if isinstance(max_norm, ZClip):
        return repr(max_norm)
    if callable(max_norm):
        return "a max_norm schedule"
    return f"max_norm={float(max_norm):g}"


class ScheduleError(ValueError):
    """A ``max_norm`` schedule returned a bad value (NaN, negative, not a number) or raised."""


def max_norm_at(schedule: Callable[[int], float], step: int) -> float:
    """``schedule(step)`` checked; raises ScheduleError naming the step."""
    try:
        value = schedule(step)
    except Exception as e:  # noqa: BLE001 - reported with the step, chained
        raise ScheduleError(f"gradfuse: the max_norm schedule raised at step {step}: "
                            f"{type(e).__name__}: {e}") from e
    try:
        m = float(value)
    except (TypeError, ValueError):
        raise ScheduleError(f"gradfuse: the max_norm schedule returned {value!r} at step {step}; "
                            "expected a number") from None
    if math.isnan(m) or m < 0:
        raise ScheduleError(f"gradfuse: the max_norm schedule returned {value!r} at step {step}; "
                            "expected a non-negative number")
    return m


# ---------------------------------------------------------------------------------------------
# Double clipping

class DoubleClipCheck:
    """Notices gradients changed in place between the end of the backward and the monitor's clip
    (a ``clip_grad_norm_`` of the user's or of a framework multiplies every gradient, even when
    it does not clip), from the gradients' version counters, on every rank on its own (no
    collective).

    Post-accumulate-grad hooks on a few sentinel parameters note that a backward accumulated
    into them and queue an autograd final callback, which queues a second one: callbacks queued
    by a callback run after every callback queued during the backward, among them DDP's
    reducer's (``finalize_backward``, which writes the all-reduced gradients back: a
    ``copy_`` or an in-place division of the bucket view, each a version bump). The second
    callback records each sentinel gradient's version counter once the backward, DDP's
    synchronisation included, is over; :meth:`changed` compares it at step time. Costs two hooks
    and four callbacks per backward, whatever the model's size."""

    def __init__(self, params: list[torch.Tensor], names: list[str]):
        self._seen: dict[int, tuple[int, torch.Tensor]] = {}
        self._touched: set[int] = set()
        self._handles = []
        self.names = {}
        self._params: dict[int, torch.Tensor] = {}
        trainable = [(n, p) for n, p in zip(names, params)
                     if isinstance(p, torch.Tensor) and p.requires_grad and p.is_leaf]
        for name, p in {id(p): (n, p) for n, p in (trainable[:1] + trainable[-1:])}.values():
            key = id(p)
            self.names[key] = name
            self._params[key] = p
            try:
                self._handles.append(p.register_post_accumulate_grad_hook(self._recorder(key)))
            except RuntimeError:
                pass

    def _recorder(self, key: int):
        def hook(p):
            self._touched.add(key)
            try:  # once per sentinel and backward (a backward that fails runs no callback)
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            except RuntimeError:  # not inside an engine's backward: record now
                self._record()
        return hook

    def _after_backward(self) -> None:
        # Runs with the final callbacks queued during the backward; queue the recording behind
        # them (DDP's finalize_backward among them).
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._record)
        except RuntimeError:
            self._record()

    def _record(self) -> None:
        touched, self._touched = self._touched, set()
        for key in touched:
            g = self._params[key].grad
            if g is not None:
                self._seen[key] = (g._version, g)

    def changed(self, allowed: int = 0) -> str | None:
        """The name of a sentinel whose gradient was changed in place more than ``allowed`` times
        since the end of the backward that last accumulated into it, else None; then forgets
        what it recorded."""
        seen, self._seen = self._seen, {}
        for key, (version, grad) in seen.items():
            if grad._version > version + allowed:
                return self.names[key]
        return None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def double_clip_message(call: str, name: str) -> str:
    return (f"{call}: the gradients were already changed in place since the backward "
            f"(seen on {name!r}): something scaled or clipped them before gradfuse's own clip "
            "(torch.nn.utils.clip_grad_norm_ / clip_grad_value_, a framework's gradient "
            "clipping, accelerator.clip_grad_norm_). Clipping twice shrinks every update. Hand "
            "clipping to gradfuse: remove the other call and pass max_norm= (or per=, "
            "clip_value=, agc=, a ZClip) to gradfuse. If the change was meant (your own gradient "
            "scaling), pass check_double_clip=False. (This warning is shown once.)")


# ---------------------------------------------------------------------------------------------
# The monitor's clip, every mode

def monitor_clip_(s: GradStats, names_params, mode: dict, max_norm_now) -> GradStats:
    """Clips the gradients ``s`` was taken of by the monitor's configured mode; ``max_norm_now``
    is this step's float max_norm or a ZClip. Returns ``s`` with what was applied."""
    names, params = names_params
    _names, _params, grads = api._with_grads(names, params)
    if isinstance(max_norm_now, ZClip):
        coef = max_norm_now.clip_coef(s._total)
        scale_total_(grads, coef, s._total.dtype)
        return s._replace(clip_coef=coef, max_norm=None)
    if mode.get("per"):
        if list(s.names) != list(_names):
            # rows follow the grouping; re-order the gradients to match them
            by_name = dict(zip(_names, grads))
            grads = [by_name[n] for n in s.names]
        return clip_per_(s, grads, max_norm_now, mode["per"], mode.get("layer_depth"))
    raise AssertionError("monitor_clip_: no mode")



def clip_modes_(source, max_norm, norm_type: float = 2.0, error_if_nonfinite: bool = False, *,
                group=None, per=None, value=None, layer_depth: int | None = None) -> GradStats:
    """:func:`gradfuse.clip_` with ``per=`` or ``value=`` (see there)."""
    per = check_per(per)
    if value is not None:
        if max_norm is not None or per is not None:
            raise ValueError("gradfuse.clip_: value= clips by value; pass max_norm=None and no per=")
        if group is not None:
            raise ValueError("gradfuse.clip_: value= takes no group= (clamping is element-wise)")
        v = check_clip_value(value)
        names, _params, grads = api._named_grads(source)
        return clamp_stats_(names, grads, v)
    if max_norm is None:
        raise ValueError("gradfuse.clip_: max_norm is None; pass a number (or value= to clip by value)")
    max_norm = api._check_max_norm(max_norm)
    p = api._check_norm_type(norm_type)
    names, _params, grads = api._named_grads(source)
    s = api._fused_stats(names, grads, p, group)
    if grads and error_if_nonfinite:
        api._raise_if_nonfinite(s)
    if s.names is not names and list(s.names) != names:  # rows follow the (device, dtype) grouping
        by_name = dict(zip(names, grads))
        grads = [by_name[n] for n in s.names]
    return clip_per_(s, grads, max_norm, per, layer_depth)
