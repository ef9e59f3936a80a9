"""Gradient noise scale, B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An Empirical Model
of Large-Batch Training", appendix A.1).

From two squared gradient norms a training loop already has, at two batch sizes B_small < B_big:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

each unbiased; each smoothed by an exponential moving average (debiased, as Adam's moments),
then divided (the paper's recipe: the ratio of two unbiased estimates is not unbiased, the ratio
of two averages is much closer).

Two sources of the pair of norms:

- gradient accumulation: the first micro-batch's gradient against the accumulated one. Call
  ``NoiseScale.after_backward`` after each backward (``GradMonitor.micro_step()`` does it; the
  integrations call it themselves). The first micro-batch's squared norm is taken by one fused
  stats pass, only on steps that accumulate (the first call of a step does it when
  ``accumulation_steps > 1`` was given or the previous step had more than one micro-batch).
- DDP: ``NoiseScale.register_ddp`` installs a communication hook that takes each bucket's
  local squared norm (one fused pass over the bucket, before its all-reduce) and then runs DDP's
  default all-reduce; the all-reduced gradient's norm is the monitor's own statistics. The local
  norms are averaged over the ranks by one all-reduce of one scalar per step.

Everything stays on the device: no host synchronisation per step.

Layer: dynamics (a capability). Imports ``gradfuse.ops`` and ``gradfuse.core``.
"""
from __future__ import annotations

import torch

from gradfuse import ops
from gradfuse.ops.layout import SUMSQ

ACCUMULATION_MODES = ("mean", "sum")


def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all elements of ``tensors`` (float64, 0-d, on the first tensor's device)
    by one fused stats pass per (device, dtype) group."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t.detach())
    total = None
    for group in groups.values():
        floats, _ = ops.multi_tensor_stats(group, 2.0)
        part = floats[:, SUMSQ].sum()
        total = part if total is None else total + part.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def _grads(source) -> list[torch.Tensor]:
    """The gradients of ``source``: an ``nn.Module``, parameters, ``(name, parameter)`` pairs, or
    a ``gradfuse.GradWatch``-like object with ``stats()``."""
    if isinstance(source, torch.nn.Module):
        params = source.parameters()
    else:
        params = source
    out = []
    for p in params:
        if isinstance(p, tuple):
            p = p[1]
        if p.grad is not None:
            out.append(p.grad)
    return out


def _squared_norm_of(source) -> torch.Tensor:
    stats = getattr(source, "stats", None)
    if callable(stats):  # a GradWatch: its fused pass, resolved parameters
        return stats().floats[:, SUMSQ].sum()
    return squared_norm(_grads(source))


def _noise_scale_comm_hook(state: NoiseScale, bucket):
    """DDP communication hook: the bucket's local squared norm (one fused pass, before the
    all-reduce changes the buffer), then DDP's default all-reduce (``allreduce_hook``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    floats, _ = ops.multi_tensor_stats([bucket.buffer()], 2.0)
    g2 = floats[0, SUMSQ]
    state.bucket_passes += 1
    # A new reduction round (a backward that syncs) starts after the last bucket of the previous
    # one: only the latest round's norms count (the one whose buffers hold the gradients stepped).
    if state._ddp_new_round or state._ddp_local is None:
        state._ddp_local = g2
    else:
        state._ddp_local = state._ddp_local + g2.to(state._ddp_local.device)
    state._ddp_new_round = bucket.is_last()
    return default_hooks.allreduce_hook(state._ddp_group, bucket)


class NoiseScale:
    """The gradient noise scale estimator (module docstring), with its EMA state on the device.

    Args:
        batch_size: examples in one micro-batch on one rank (the B of a single ``backward``). The
            noise scale is in examples; None: in micro-batches (``batch_size=1``).
        beta: EMA coefficient of the two estimates (0.99: an average over about 100 steps).
        accumulation: ``"mean"`` (default) when each micro-batch's loss is divided by the number
            of micro-batches, so that the accumulated gradient is the mean over all of them (what
            Lightning and the Hugging Face Trainer do); ``"sum"`` when it is not (the accumulated
            gradient is then the sum of k micro-batch means; both norms are rescaled to means).
        accumulation_steps: micro-batches per optimizer step, when known in advance: the first
            micro-batch's norm is then taken from the first step on. Otherwise the estimator learns
            it (a step with one micro-batch takes no extra pass; the first accumulating step is
            used from the second one on).

    Use it through ``GradMonitor(..., noise_scale=True)`` (or ``noise_scale=NoiseScale(...)``),
    or on its own (see the example).

    Attributes:
        batch_size (float): Examples per micro-batch (1.0 when not given: in micro-batches).
        beta (float): The EMA coefficient.
        accumulation (str): ``"mean"`` or ``"sum"``.
        accumulation_steps (int | None): Micro-batches per optimizer step, when given.
        updates (int): Steps that offered a pair of norms (a non-finite pair is not averaged in).
        extra_passes (int): Fused passes over the gradients taken for the first micro-batches.
        bucket_passes (int): Fused passes over DDP buckets in the communication hook.
        ddp_model: The ``DistributedDataParallel`` model whose hook is installed, or None.

    Raises:
        ValueError: ``batch_size`` not > 0, ``beta`` outside [0, 1), ``accumulation`` not
            ``"mean"`` / ``"sum"``, or ``accumulation_steps`` < 1.

    Example:
        ```python
        ns = gradfuse.NoiseScale(batch_size=32, accumulation_steps=4)
        for step in range(steps):
            for micro in range(4):
                (loss_fn(model(x[micro])) / 4).backward()
                ns.after_backward(model)      # fused pass on the first micro-batch only
            ns.step(model)                    # the accumulated gradient's norm (a fused pass)
            opt.step(); opt.zero_grad()
        print(ns.values())                    # {"noise_scale", "G2", "trSigma"}: 0-d device tensors
        ```
    """

    def __init__(self, batch_size: float | None = None, *, beta: float = 0.99,
                 accumulation: str = "mean", accumulation_steps: int | None = None):
        if batch_size is not None and not batch_size > 0:
            raise ValueError(f"gradfuse.NoiseScale: batch_size must be > 0, got {batch_size!r}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"gradfuse.NoiseScale: beta must be in [0, 1), got {beta!r}")
        if accumulation not in ACCUMULATION_MODES:
            raise ValueError(f"gradfuse.NoiseScale: accumulation must be one of {ACCUMULATION_MODES}, "
                             f"got {accumulation!r}")
        if accumulation_steps is not None and accumulation_steps < 1:
            raise ValueError(f"gradfuse.NoiseScale: accumulation_steps must be >= 1, got {accumulation_steps}")
        self.batch_size = float(batch_size) if batch_size is not None else 1.0
        self.batch_size_given = batch_size is not None
        self.beta = float(beta)
        self.accumulation = accumulation
        self.accumulation_steps = accumulation_steps
        # EMA of (|G|^2, tr(Sigma)) and the EMA of 1 over the same updates (Adam's debiasing).
        self._ema: torch.Tensor | None = None
        self._weight: torch.Tensor | None = None
        self.updates = 0  # steps that offered a pair of norms (a non-finite pair is not averaged in)
        self.extra_passes = 0  # fused passes over the gradients taken for the first micro-batches
        self.bucket_passes = 0  # fused passes over DDP buckets in the communication hook
        self._micro = 0
        self._last_micro = 0
        self._g2_first: torch.Tensor | None = None
        self._ddp_group = None
        self._ddp_world = 1
        self._ddp_local: torch.Tensor | None = None
        self._ddp_new_round = True
        self.ddp_model = None  # the DistributedDataParallel model whose hook is installed

    # --- sources -------------------------------------------------------------------------------
    def _expects_accumulation(self) -> bool:
        if self.accumulation_steps is not None:
            return self.accumulation_steps > 1
        return self._last_micro > 1

    def after_backward(self, source) -> None:
        """Says a micro-batch's backward has finished. On the first micro-batch of a step that
        accumulates, takes its gradients' squared norm (one fused pass over ``source``: a module,
        parameters, or a ``gradfuse.watch`` handle). Under DDP with ``register_ddp`` it
        only counts (the hook measures).

        Args:
            source: What holds the gradients: an ``nn.Module``, parameters, ``(name,
                parameter)`` pairs, or a ``gradfuse.watch`` handle.

        Example:
            ```python
            loss.backward()
            ns.after_backward(model)
            ```
        """
        self._micro += 1
        if self._micro == 1 and self._ddp_group is None and self._expects_accumulation():
            self._g2_first = _squared_norm_of(source)
            self.extra_passes += 1

    def register_ddp(self, ddp_model, process_group=None) -> None:
        """Installs the communication hook on a ``DistributedDataParallel`` model (before its first
        backward): each bucket's local squared norm, then DDP's default all-reduce. With gradient
        accumulation use ``ddp_model.no_sync()`` on all micro-batches but the last (Lightning and
        accelerate do), so the last round's buckets hold the accumulated local gradients.

        Args:
            ddp_model: The ``torch.nn.parallel.DistributedDataParallel`` model.
            process_group: The process group of the all-reduce; None: the model's own.

        Raises:
            RuntimeError: from DDP, when the model already has a communication hook.

        Example:
            ```python
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            ns = gradfuse.NoiseScale(batch_size=32)
            ns.register_ddp(ddp)
            ```
        """
        import torch.distributed as dist
        group = process_group if process_group is not None else getattr(ddp_model, "process_group", None)
        self._ddp_group = group
        self._ddp_world = dist.get_world_size(group)
        ddp_model.register_comm_hook(self, _noise_scale_comm_hook)
        self.ddp_model = ddp_model

    def skip_step(self) -> None:
        """Forgets this step's measurements (a skipped step: its gradients are not averaged in).

        Example:
            ```python
            if report.skip:
                ns.skip_step()
            ```
        """
        self._last_micro = self._micro or self._last_micro
        self._micro = 0
        self._g2_first = None
        self._ddp_local = None
        self._ddp_new_round = True

    def step(self, source=None, *, g2: torch.Tensor | None = None,
             loss_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> bool:
        """Ends an optimizer step: ``g2`` is the squared norm of the gradient about to be applied
        (accumulated, all-reduced; else taken from ``source`` by a fused pass). ``loss_scale``: a
        GradScaler's scale when the micro-batch / bucket norms were taken on scaled gradients while
        ``g2`` is unscaled. Returns whether this step offered a pair of norms (host-known).

        The step's measurements are then reset (as ``skip_step`` does). Under DDP it runs one
        all-reduce of one scalar (the local norms), on every rank.

        Args:
            source: What holds the gradients (as ``after_backward`` takes), used when ``g2`` is
                None.
            g2: The squared norm of the gradient about to be applied, a 0-d tensor.
            loss_scale: The GradScaler's scale, when the micro-batch / bucket norms were taken
                on scaled gradients while ``g2`` is unscaled.
            skip: A 0-d bool tensor: True when the optimizer skips this step on the device (its
                pair is then not averaged in, as by ``skip_step``, with no host read; ``updates``
                counts it all the same).

        Returns:
            Whether this step offered a pair of norms (and was averaged in unless non-finite
                or skipped).

        Example:
            ```python
            if ns.step(model):
                print(ns.host_values())
            ```
        """
        k = max(self._micro, 1)
        local, first = self._ddp_local, self._g2_first
        self.skip_step()  # resets the per-step measurements
        if local is None and (first is None or k < 2):
            return False
        if g2 is None:
            g2 = _squared_norm_of(source)
        g2 = g2.to(torch.float64)
        inv_scale2 = None
        if loss_scale is not None:
            inv_scale2 = 1.0 / loss_scale.to(g2.device, torch.float64).square()
        if local is not None:
            import torch.distributed as dist
            local = local.to(g2.device, torch.float64).clone()
            dist.all_reduce(local, group=self._ddp_group)  # the one scalar collective of a step
            small = local / self._ddp_world
            b_small = self.batch_size * k
            b_big = b_small * self._ddp_world
            # "sum": local and all-reduced gradients are both k times the means.
            div = float(k * k) if self.accumulation == "sum" else 1.0
            small, big = small / div, g2 / div
        else:
            small = first.to(g2.device, torch.float64)
            b_small, b_big = self.batch_size, self.batch_size * k
            if self.accumulation == "mean":  # the first micro-batch's loss was divided by k
                small, big = small * float(k * k), g2
            else:  # the accumulated gradient is the sum of k micro-batch means
                big = g2 / float(k * k)
        if inv_scale2 is not None:
            small = small * inv_scale2
        self.update(small, big, b_small, b_big, skip=skip)
        return True

    # --- the estimator -------------------------------------------------------------------------
    def update(self, g2_small: torch.Tensor, g2_big: torch.Tensor, b_small: float, b_big: float, *,
               skip: torch.Tensor | None = None) -> None:
        """Averages in one pair of squared norms of mean gradients at batch sizes ``b_small`` <
        ``b_big`` (0-d tensors, any device; no host sync). A non-finite pair is not averaged in.

        Args:
            g2_small: The squared norm of the mean gradient at batch size ``b_small``.
            g2_big: The squared norm of the mean gradient at batch size ``b_big``.
            b_small: The smaller batch size.
            b_big: The larger batch size.
            skip: A 0-d bool tensor: True leaves the averages as they are (decided on the device).

        Raises:
            ValueError: unless ``0 < b_small < b_big``.

        Example:
            ```python
            ns.update(g2_micro, g2_accumulated, b_small=32, b_big=128)
            ```
        """
        if not b_big > b_small > 0:
            raise ValueError(f"gradfuse.NoiseScale: need 0 < b_small < b_big, got {b_small}, {b_big}")
        g2_small = torch.as_tensor(g2_small, dtype=torch.float64)
        g2_big = torch.as_tensor(g2_big, dtype=torch.float64, device=g2_small.device)
        g2 = (b_big * g2_big - b_small * g2_small) / (b_big - b_small)
        tr_sigma = (g2_small - g2_big) / (1.0 / b_small - 1.0 / b_big)
        pair = torch.stack([g2, tr_sigma])
        if self._ema is None or self._ema.device != pair.device:
            self._ema = torch.zeros(2, dtype=torch.float64, device=pair.device) if self._ema is None \
                else self._ema.to(pair.device)
            self._weight = torch.zeros((), dtype=torch.float64, device=pair.device) if self._weight is None \
                else self._weight.to(pair.device)
        ok = torch.isfinite(pair).all()
        if skip is not None:
            ok = ok & ~skip.to(ok.device)
        b = self.beta
        self._ema = torch.where(ok, b * self._ema + (1.0 - b) * pair, self._ema)
        self._weight = torch.where(ok, b * self._weight + (1.0 - b), self._weight)
        self.updates += 1

    def values(self) -> dict[str, torch.Tensor] | None:
        """``{"noise_scale", "G2", "trSigma"}``: the debiased EMAs of |G|^2 and tr(Sigma) and their
        ratio B_simple (0-d float64 device tensors; NaN until a pair was averaged in). None before
        any step offered a pair.

        Returns:
            ``{"noise_scale": ..., "G2": ..., "trSigma": ...}`` (device tensors), or None.
        """
        if self._ema is None:
            return None
        est = self._ema / self._weight  # 0/0 = NaN until something was averaged in
        return {"noise_scale": est[1] / est[0], "G2": est[0], "trSigma": est[1]}

    def host_values(self) -> dict[str, float] | None:
        """``values`` as Python numbers (one transfer).

        Returns:
            ``{"noise_scale": ..., "G2": ..., "trSigma": ...}`` as floats, or None before any
                step offered a pair.
        """
        packed = self.packed_values()
        return None if packed is None else values_of_packed(packed)

    def packed_values(self) -> torch.Tensor | None:
        """``values`` as one float64 device tensor ``[noise_scale, G2, trSigma]`` (None before any
        step offered a pair): what a host copy takes, read back by ``values_of_packed``."""
        v = self.values()
        return None if v is None else torch.stack([v["noise_scale"], v["G2"], v["trSigma"]])

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The EMA state (as Python numbers, so it is saved anywhere) and the settings.

        Returns:
            A dict: ``ema`` (three numbers, or None), ``updates``, ``last_micro``, ``beta``,
                ``batch_size``, ``accumulation``.
        """
        ema = None if self._ema is None else torch.cat([self._ema, self._weight.reshape(1)]).tolist()
        return {"ema": ema, "updates": self.updates, "last_micro": self._last_micro,
                "beta": self.beta, "batch_size": self.batch_size, "accumulation": self.accumulation}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``'s EMA state and counts (the settings stay this estimator's).

        Args:
            state: A dict from ``state_dict``.

        Raises:
            ValueError: ``state["ema"]`` is not None nor three numbers.
        """
        ema = state.get("ema")
        if ema is None:
            self._ema = self._weight = None
        else:
            if len(ema) != 3 or not all(isinstance(x, (int, float)) for x in ema):
                raise ValueError(f"gradfuse.NoiseScale.load_state_dict: bad ema {ema!r}")
            device = self._ema.device if self._ema is not None else "cpu"
            t = torch.tensor(ema, dtype=torch.float64, device=device)
            self._ema, self._weight = t[:2].clone(), t[2].clone()
        self.updates = int(state.get("updates", 0))
        self._last_micro = int(state.get("last_micro", 0))

    def __repr__(self) -> str:
        return (f"NoiseScale(batch_size={self.batch_size:g}, beta={self.beta}, "
                f"accumulation={self.accumulation!r}, updates={self.updates})")


def values_of_packed(packed: torch.Tensor) -> dict[str, float]:
    """``NoiseScale.packed_values`` (or a host copy of it) as ``host_values`` gives it."""
    return dict(zip(("noise_scale", "G2", "trSigma"), packed.tolist()))


class BackwardEnds:
    """Calls ``fn()`` once at the end of every backward that accumulates into the ``.grad`` of
    any of ``params`` (a post-accumulate-grad hook on each parameter queues one callback on the
    autograd engine, as DDP's reducer does): how ``gradfuse.attach`` sees micro-batch
    boundaries without a call in the loop. Costs one Python call per parameter per backward;
    ``remove`` takes the hooks off."""

    def __init__(self, params, fn):
        self.fn = fn
        self._queued = False
        self.handles = [p.register_post_accumulate_grad_hook(self._hook)
                        for p in params if p.requires_grad]

    def _hook(self, _param) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._queued = False
        self.fn()

    def remove(self) -> None:
        """Takes the hooks off the parameters."""
        for h in self.handles:
            h.remove()
        self.handles = []


def configure(estimator: NoiseScale | None, *, batch_size=None, accumulation_steps=None) -> None:
    """What an integration knows, given to an estimator the user did not configure."""
    if estimator is None:
        return
    if batch_size and not estimator.batch_size_given:
        estimator.batch_size = float(batch_size)
        estimator.batch_size_given = True
    if accumulation_steps and estimator.accumulation_steps is None:
        estimator.accumulation_steps = int(accumulation_steps)
