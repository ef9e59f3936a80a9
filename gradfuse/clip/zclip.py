"""ZClip (Kumar et al. 2025): z-score adaptive clipping thresholds, its state kept on the device.

Layer: clip (a capability). Imports ``gradfuse.core``.
"""
from __future__ import annotations

import math

import torch

from gradfuse import ops
from gradfuse.core.engine import scale_
from gradfuse.core.norms import clip_coefficient
from gradfuse.core.params import check_max_norm, with_grads
from gradfuse.core.watch import GradWatch


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

    Args:
        alpha: The EMA coefficient of mean and variance, in [0, 1].
        z_thresh: The z-score above which a norm is a spike; > 0.
        max_grad_norm: A cap on the threshold (and the only clip during warm-up), a
            non-negative number; None (default, unlike zclip): no cap.
        eps: Added to the standard deviation in the z-score.
        warmup_steps: Steps whose norms initialise mean and variance; >= 0.
        mode: ``"zscore"`` or ``"percentile"`` (case-insensitive).
        clip_option: With ``mode="zscore"``: ``"adaptive_scaling"`` or ``"mean"``; ignored (None)
            with ``"percentile"``.
        clip_factor: The factor of the ``"adaptive_scaling"`` threshold; > 0.
        skip_update_on_spike: Leave mean and variance unchanged on a spike.

    Attributes:
        steps (int): Steps taken (a host counter: warm-up is known without reading the device).
        last_total_norm (torch.Tensor | None): The latest step's total norm before clipping.
        last_threshold (torch.Tensor | None): The latest step's threshold (inf where nothing
            clips).
        last_clip_coef (torch.Tensor | None): The latest step's clip coefficient (at most 1).

    Raises:
        ValueError: ``mode`` not ``"zscore"`` / ``"percentile"``; ``clip_option`` not
            ``"mean"`` / ``"adaptive_scaling"`` in zscore mode; ``alpha`` outside [0, 1];
            ``z_thresh`` or ``clip_factor`` not > 0; ``max_grad_norm`` negative or NaN;
            ``warmup_steps`` < 0.

    Example:
        ```python
        zc = gradfuse.ZClip(alpha=0.97, z_thresh=2.5, max_grad_norm=1.0)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            total = zc.step(model)           # clips in place; a 0-d device tensor
            optimizer.step()
            optimizer.zero_grad()

        # or as the monitor's threshold
        monitor = gradfuse.GradMonitor(model, max_norm=gradfuse.ZClip())
        ```
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
            max_grad_norm = check_max_norm(max_grad_norm)
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
        self._unsettled = False  # the latest step took a skip flag the host has not read
        self.last_clip_coef: torch.Tensor | None = None
        self._watch = None

    @property
    def initialized(self) -> bool:
        """The warm-up is over: mean and variance are initialised (host-known, no sync)."""
        return self.steps >= max(self.warmup_steps, 1)

    @property
    def mean(self) -> torch.Tensor | None:
        """The EMA mean of the norms, a 0-d device tensor (None before the first step)."""
        return self._mean

    @property
    def var(self) -> torch.Tensor | None:
        """The EMA variance of the norms, a 0-d device tensor (None before the first step)."""
        return self._var

    def __repr__(self) -> str:
        return (f"ZClip(alpha={self.alpha}, z_thresh={self.z_thresh}, max_grad_norm="
                f"{self.max_grad_norm}, warmup_steps={self.warmup_steps}, mode={self.mode!r}, "
                f"clip_option={self.clip_option!r}, clip_factor={self.clip_factor}, "
                f"skip_update_on_spike={self.skip_update_on_spike})")

    def _state_on(self, device) -> None:
        # float64 state, or float32 on a device without float64
        f64 = dict(dtype=ops.stats_dtype(device), device=device)
        if self._buffer is None or self._buffer.device != device or self._buffer.dtype != f64["dtype"]:
            n = max(self.warmup_steps, 1)
            self._buffer = (torch.zeros(n, **f64) if self._buffer is None else self._buffer.to(**f64))
            self._mean = torch.zeros((), **f64) if self._mean is None else self._mean.to(**f64)
            self._var = torch.zeros((), **f64) if self._var is None else self._var.to(**f64)

    def clip_coef(self, total_norm: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        """Takes one step of the state for this total norm; returns the coefficient (float64,
        0-d, at most 1) the gradients are to be multiplied by. No host sync.

        Sets ``last_total_norm``, ``last_threshold`` and ``last_clip_coef``; the gradients are
        not touched (``step`` scales them).

        Args:
            total_norm: The gradients' total L2 norm, a 0-d tensor (on the device).
            skip: A 0-d bool on the device, True for a step the optimizer skips there: the
                state (and ``last_threshold``) stays as it was. ``steps`` counts the step until
                ``settle`` says whether it was skipped.

        Returns:
            The clip coefficient: a 0-d tensor on ``total_norm``'s device (float64, or float32
                on a device without float64), at most 1.

        Example:
            ```python
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            coef = zc.clip_coef(gradfuse.get_total_norm(grads))
            for g in grads:
                g.mul_(coef.to(g.dtype))
            ```
        """
        g = total_norm.detach().reshape(())
        g = g.to(ops.stats_dtype(g.device))
        self._state_on(g.device)
        inf = torch.full((), math.inf, dtype=g.dtype, device=g.device)

        def kept(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:  # the old value on a skipped step
            return new if skip is None else torch.where(skip.to(new.device), old, new)

        if not self.initialized:
            self._buffer[self.steps].copy_(kept(self._buffer[self.steps], g))
            self.steps += 1
            if self.initialized:  # as zclip: population mean and variance of the warm-up norms
                mean = self._buffer.sum() / self._buffer.numel()
                self._mean.copy_(kept(self._mean, mean))
                self._var.copy_(kept(self._var, ((self._buffer - mean) ** 2).sum() / self._buffer.numel()))
            if self.max_grad_norm is None:
                coef, threshold = torch.ones_like(g), inf
            else:  # torch.nn.utils.clip_grad_norm_'s coefficient
                coef = clip_coefficient(g, self.max_grad_norm)
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
            self._mean.copy_(kept(mean, new_mean))
            self._var.copy_(kept(var, new_var))
        if skip is not None:  # a skipped step is left unscaled
            coef = kept(torch.ones_like(coef), coef)
        if skip is not None and self.last_threshold is not None:
            threshold = kept(self.last_threshold.to(threshold.device, threshold.dtype), threshold)
        self.last_total_norm, self.last_threshold, self.last_clip_coef = g, threshold, coef
        self._unsettled = skip is not None
        return coef

    def settle(self, skipped: bool) -> None:
        """The host has read the skip flag the latest ``clip_coef(skip=)`` took: a skipped step
        does not count in ``steps`` (its state was left as it was on the device). Does nothing
        after a step without a flag, or once settled."""
        if self._unsettled and skipped:
            self.steps -= 1
        self._unsettled = False

    @torch.no_grad()
    def step(self, model) -> torch.Tensor:
        """As zclip's ``step``: call after ``loss.backward()``, before ``optimizer.step()``. Clips the
        gradients of ``model`` (a module, or an iterable of parameters) in place; returns their
        total L2 norm before clipping as a 0-d device tensor (no host sync).

        Args:
            model: A module, or an iterable of parameters (its parameters are resolved once
                per object: passing the same object every step reuses them).

        Returns:
            The total L2 norm before clipping, a 0-d device tensor.

        Example:
            ```python
            loss.backward()
            total = zc.step(model)
            optimizer.step()
            ```
        """
        if self._watch is None or self._watch[0] is not model:
            self._watch = (model, GradWatch(model))
        w = self._watch[1]
        s = w.stats()
        if not len(s):
            return s.total_norm
        coef = self.clip_coef(s.plain_total_norm)
        # From C++ when the watch's fast path served the stats: no per-parameter Python
        if w.last_path == "fast" and w.scale_by(_scale_dtype(coef, s.plain_total_norm.dtype)):
            return s.total_norm
        _names, _params, grads = with_grads(w.names, w.params)
        scale_total_(grads, coef, s.plain_total_norm.dtype)
        return s.total_norm

    def state_dict(self) -> dict:
        """The configuration, the host step count and the device state (tensors, not read).

        Returns:
            A dict: ``steps``, ``buffer`` (the warm-up norms), ``mean``, ``var`` (tensors or
                None) and ``config`` (the constructor's arguments).

        Example:
            ```python
            torch.save({"zclip": zc.state_dict()}, "ckpt.pt")
            ```
        """
        return {"steps": self.steps, "buffer": self._buffer, "mean": self._mean, "var": self._var,
                "config": {"alpha": self.alpha, "z_thresh": self.z_thresh,
                           "max_grad_norm": self.max_grad_norm, "eps": self.eps,
                           "warmup_steps": self.warmup_steps, "mode": self.mode,
                           "clip_option": self.clip_option, "clip_factor": self.clip_factor,
                           "skip_update_on_spike": self.skip_update_on_spike}}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``: the step count and the device state (as float64 copies).

        The other settings of ``config`` are not applied: this ZClip keeps its own.

        Args:
            state: A dict from ``state_dict``.

        Raises:
            ValueError: ``state`` was saved with a different ``warmup_steps``.
            KeyError: ``state`` has no ``steps``.

        Example:
            ```python
            zc = gradfuse.ZClip(max_grad_norm=1.0)
            zc.load_state_dict(torch.load("ckpt.pt")["zclip"])
            ```
        """
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
    scale_(grads, _scale_dtype(coef, dtype))

