"""GradMonitor: fused gradient statistics every step, logging every N steps, and policies for
non-finite and exploding gradients that name the parameters at fault.

The monitor composes its parts: the checks of its arguments (``gradfuse.monitor.arguments``),
the watch handle (statistics), the step plan (the pass that takes a step's statistics and the clip
after it, ``gradfuse.monitor.step_plan``), the policies (``gradfuse.monitor.policies``), the clip
strategy (``gradfuse.monitor.clip_strategy``), the dynamics (``gradfuse.monitor.dynamics``), the
activation hooks (``gradfuse.monitor.activation_hooks``), the report and record of a step
(``gradfuse.monitor.report``, ``gradfuse.monitor.record``), the sink set
(``gradfuse.monitor.sink_set``) and its checkpoint state (``gradfuse.monitor.checkpoint``). It
never stops a run because of its own output: a sink that raises is warned about once, retried
with a back-off, and every record it did not write is counted.

``GradMonitor.step`` runs in phases: ``_start`` (the first step: the sinks' run
configuration), ``_plan`` (the double-clip check, this step's ``max_norm``, the pass),
the statistics (``StepPlan.take_stats``), ``_apply_policies`` (anomalies, counters, message;
raise, skip or warn), ``_clip`` and ``_finish`` (dynamics, the record to the sinks).

Layer: monitor. Imports the capabilities and the core, and the monitor's own parts.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from gradfuse.core.amp import scaler_unscaled
from gradfuse.core.watch import watch_source
from gradfuse.monitor import recorder_hooks as flight
from gradfuse.monitor.activation_hooks import MonitorHooks
from gradfuse.monitor.arguments import check_clip_args, check_monitor_args
from gradfuse.monitor.checkpoint import COUNTERS, monitor_state, restore_state
from gradfuse.monitor.clip_strategy import DoubleClipCheck, max_norm_of_step
from gradfuse.monitor.deferred import Pending, device_skip_flag, step_handoff
from gradfuse.monitor.dynamics import Dynamics
from gradfuse.monitor.policies import Decision, anomaly_flags, decide
from gradfuse.monitor.record import run_config, step_record, writing_rank
from gradfuse.monitor.report import GradientAnomaly, StepReport, anomaly_message
from gradfuse.monitor.sink_set import SinkSet
from gradfuse.monitor.step_plan import StepPlan, plan_step
from gradfuse.utils import warn


class GradMonitor:
    """Watches a model's gradients during training at the cost of one fused pass per step.

    Args:
        model: the module (or iterable of ``(name, parameter)`` pairs) to watch; held as a
            ``gradfuse.watch`` handle (see there for when its parameters are re-resolved). A
            ``GradWatch`` is used as it is (``gradfuse.integrations.deepspeed`` passes one over
            DeepSpeed ZeRO's gradient fragments).
        max_norm: clip by total norm to this value every step (as ``clip_grad_norm_``); None: no clip.
            Also a schedule, a callable of the step number returning the value (``lambda step:
            1.0 if step < 5000 else 0.5``; logged each logging step as ``max_norm``; a value that
            is NaN, negative or not a number, or a schedule that raises, is an anomaly named
            ``"max_norm"`` handled by ``on_nonfinite``: ``raise`` raises a ValueError naming the
            step, ``skip`` skips the step, ``warn`` / ``ignore`` do not clip that step), or a
            ``gradfuse.ZClip`` (adaptive threshold, state on the device and in
            ``state_dict``). See ``gradfuse.clip``.
        per: with ``max_norm``: ``"param"`` / ``"layer"`` clips each parameter / layer (grouped
            as ``layer_depth`` groups them) by its own norm.
        clip_value: clamp every gradient to ``[-clip_value, clip_value]`` (as
            ``clip_grad_value_``); the statistics are from before clamping, with the clamped
            element counts.
        agc: adaptive gradient clipping with this ``clip_factor`` (as
            ``gradfuse.adaptive_clip_grad_``, ``eps=agc_eps``, of order ``norm_type``).
        agc_eps: the ``eps`` of ``agc``: the smallest weight norm a unit is measured against
            (non-negative; see ``gradfuse.adaptive_clip_grad_``).
        check_double_clip: warn once when the gradients were changed in place between the
            backward and the monitor's clip (someone else clipped them too).
        norm_type: order of the total norm.
        every: log the full statistics to the sinks every ``every`` steps (0: never).
        on_nonfinite: policy when any gradient holds NaN or Inf: ``"skip"`` (default: the update
            is not applied, as ``GradScaler`` does), ``"raise"``, ``"warn"`` or ``"ignore"``.
        explode_threshold: total norm above which a step counts as an explosion (None: off).
        on_explode: policy for explosions (same choices). Default ``"skip"``: a threshold is a
            circuit breaker. Clipping would still apply a full ``max_norm`` step in the direction
            of a gradient that is mostly noise, and without clipping the spike enters Adam's
            second moments and shrinks the learning rate for thousands of steps.
        sinks: where the records go: objects with ``write(record: dict)``, the
            [`Sink`][gradfuse.Sink] protocol (JSONL, TensorBoard, W&B, MLflow, Prometheus, logging,
            or your own); a failing sink never stops training.
        layer_depth: how parameters are grouped into layers for the per-layer aggregates.
            None (default): by module path up to the first block index (``transformer.h.3``,
            ``layers.0``; ``lm_head`` for parameters outside numbered blocks); an int: that many
            leading name parts.
        scaler: a ``torch.amp.GradScaler``. Either call ``scaler.unscale_(optimizer)`` before
            ``step``, or pass ``optimizer`` too and let the monitor unscale, check and clip
            in one fused pass (one read and one write of the gradients instead of three reads
            and two writes; see ``gradfuse.unscale_clip_``).
        optimizer: with ``scaler``: the optimizer whose gradients the monitor unscales; with
            ``max_update_rms`` (and no ``update_ratios``): the optimizer whose updates it limits.
        enabled: False turns the monitor off: ``step`` then does nothing at all.
        start_step: the first step number. A resumed run restores it (and the counters) with
            ``load_state_dict``.
        histogram: on logging steps also the per-layer exponent histogram (record key
            ``exponents``) and numeric headroom for fp16 / bf16 / fp8 (``headroom``; metrics
            ``headroom/<layer>/<column>``), of the gradients as the optimizer gets them (after
            unscaling and clipping): two more fused passes on logging steps only
            (see ``gradfuse.numerics.headroom``). With ``activations`` too, the activation
            hooks also take the exponent histograms of the module outputs and of the gradients
            with respect to them (``act_exponents``, ``act_grad_exponents``).
        noise_scale: True or a ``gradfuse.NoiseScale``: the gradient noise scale, logged as
            ``grad/noise_scale``, ``grad/noise_scale_G2``, ``grad/noise_scale_trSigma`` (see
            ``gradfuse.dynamics.noise_scale``; call ``micro_step`` after each backward under
            gradient accumulation, or register the DDP hook).
        update_ratios: an optimizer (or a list; True: ``optimizer``): the optimizer's statistics
            per layer on logging steps: ``update_ratio``, ``weight_norm``, ``update_norm``,
            ``update_rms``, ``moment1_rms``, ``moment2_rms``, ``eps_dominated``, and non-finite
            counts (metrics ``<name>/<layer>``; see ``gradfuse.dynamics.update_ratio``), from one
            fused pass over the weights, gradients and optimizer state (SGD, Adam, AdamW).
        update_every: with ``update_ratios``: also take the optimizer's statistics every
            ``update_every`` steps (1: every step), into ``StepReport.updates``; the records of
            logging steps carry them. None: on logging steps only.
        max_update_rms: limit each parameter's update to this RMS (Adafactor's update clipping:
            ``w = w_before + min(1, max_update_rms / rms(u)) * u``), with no host read and no copy
            of the weights (see ``gradfuse.dynamics.update_clip``): the optimizer's statistics are
            taken every step (the optimizer of ``update_ratios``, else ``optimizer``), and after
            ``optimizer.step()`` one more pass over the weights, gradients and optimizer state
            rescales the updates above the limit (the optimizer's step hooks); with
            ``fused_step`` the ``gradfuse.optim`` step applies the limit itself instead (see
            there). Counters ``update_clipped_params`` (parameter updates rescaled) and
            ``update_clipped_steps``; the records get ``update_clipped`` and show the updates as
            applied (rescaled).
        activations: also log the statistics of every module's output and of the gradient with
            respect to it (see ``gradfuse.capture_activations``) on the steps that are logged
            (``every``): hooks are registered for those steps only (armed at the end of the step
            before), no hook at all on the others. Records get ``act`` and ``act_grad`` per layer
            (and with ``histogram``, ``act_exponents`` and ``act_grad_exponents``).
        trace_nonfinite: on every step, one small fused reduction per module output and output
            gradient (no host sync on a clean step); on a step with non-finite gradients, the
            first module where a NaN / Inf appeared is named in the message and in
            ``StepReport.first_nonfinite``.
        activation_modules: which modules (names or modules; default: all) for both options.
        module: the nn.Module whose activations are watched when ``model`` is not one (e.g. named
            parameters; ``gradfuse.attach`` passes its ``model``).
        sink_ranks: which processes write to the sinks when ``torch.distributed`` is initialised
            with more than one process: ``0`` (default; every rank still takes the statistics,
            only rank 0 writes), another rank number, or ``"all"`` (every rank writes its own
            records, each with a ``rank`` key; give each rank its own file or tracker run).
            Without a process group of two or more, every record is written and has no ``rank``.
        recorder: a flight recorder (see [`FlightRecorder`][gradfuse.FlightRecorder]): ``True``
            (64 steps), an int (that many steps) or a ``FlightRecorder``. It keeps the last
            steps' per-layer statistics on the device (no host read), detects spikes of the
            loss (``step(loss=...)``), the gradient norm and the update norm, and on every
            anomaly a policy acts on (non-finite, explode, spike; not ``"ignore"``) writes a dump
            that ``python -m gradfuse explain`` reads; the step's record gets its path
            (``dump``). Counters ``spike_steps``, ``dumps``, ``failed_dumps``.
        on_spike: with ``recorder``: the policy for a spike (the same choices as ``on_explode``,
            plus ``"dump"``: the dump alone, no warning). Every policy but ``"ignore"`` writes
            a dump; ``"ignore"``: spikes are recorded in the ring (and shown by a dump), not
            acted on or counted. The spike is one more bit of the one flag a policy reads.
        blocking: True (default): the host reads each step's decision at that step (one 0-d
            flag when a policy is active), so ``report.skip`` and ``report.anomalies`` are known
            when ``step`` returns. False: the host never waits for the device. The decision is
            taken and applied on the device (a skip is handed to ``optimizer``'s own step, see
            ``gradfuse.monitor.device_skip``), the gradients are clipped either way, and the
            values the host needs (the flag, the record's statistics, the flight recorder's
            ring) are copied without blocking and acted on at the next ``step`` (or at
            ``flush`` / ``close`` / ``state_dict``): warnings, a ``"raise"`` (naming the step),
            dumps, records (in step order), counters. The ``StepReport`` returned then has
            ``settled=False``; the host fills in its ``skip``, ``anomalies``, ``message`` and
            ``dump`` when it settles it. Needs ``optimizer`` (one whose step takes a device
            skip) when a policy can skip or raise; with any other optimizer the monitor warns
            once and blocks as with True. ``histogram``: taken at the logging step, written
            from its host copy (a skipped step's of its clipped gradients; none on the record
            of a step that did not log); ``activations`` / ``trace_nonfinite``: the rows and
            NaN counts copied at the step, the record and the first non-finite module from the
            copy; ``noise_scale``, ``update_ratios``, ``update_every``, ``max_update_rms``: a
            skipped step left out on the device, the records from host copies (with
            ``fused_step=True``, of the step's own rows, copied after it).
        fused_step: with ``optimizer=`` a ``gradfuse.optim`` optimizer (of the watched
            parameters) and a numeric, schedule or ``ZClip`` ``max_norm`` (with ``per``: one
            coefficient per parameter): the clip rides the optimizer's fused step. The monitor
            takes the statistics and the coefficients, and the step applies them as it reads
            each gradient (its ``grad_scale``), so
            clipping costs no pass of its own. ``p.grad`` then keeps the unclipped gradient (the
            statistics, the record and ``clipped_steps`` are those of the clip). Weights and state
            are bit for bit those of clipping first (``gradfuse.attach(..., fused_step=True)``
            adopts a torch SGD / Adam / AdamW with ``gradfuse.optim.from_torch``). With
            ``update_ratios`` of that optimizer its update statistics ride the step too
            (``stats=True``): no update-statistics pass; the step's record and flight-recorder
            row are then written once the optimizer has stepped. With ``max_update_rms`` (of
            that optimizer) the update clipping rides it too: every step of the optimizer gets
            ``max_update_rms`` (its first, read-only pass gives each tensor's coefficient, the
            step applies it), no update-clipping hooks, no pass before or after the step; the
            counters and ``update_clipped`` come from the coefficients the step reports
            (``last_update_coefs``), the same updates clipped as by the hooks, whose weights
            differ from the step's in the last bit only.

    Host transfers: none on a step that needs no decision and logs nothing; one 0-d flag on
    steps where a policy must decide; the whole statistics on logging steps and anomalies.
    With ``blocking=False``: no read of the step's tensors at all, only of their host copies,
    one step later.
    The flight recorder adds none of its own on a quiet step.

    Sinks never stop training: see ``write`` for what happens when one raises. What the sinks
    get (the record's keys, the metric names) is listed on the Data reference page.

    Attributes:
        step_count (int): The number the next ``step`` gets (``start_step`` at first; restored
            by ``load_state_dict``).
        skipped_steps (int): Steps a policy skipped.
        anomaly_steps (int): Steps with an anomaly of the model (an ``amp_overflow`` alone is
            the scaler's, not counted here).
        nonfinite_steps (int): Steps with a NaN or Inf gradient (under an enabled GradScaler
            these are ``amp_overflow_steps`` instead; not checked when both policies are
            ``"ignore"`` and neither a scaler nor ``trace_nonfinite`` needs the check).
        explode_steps (int): Steps whose total norm exceeded ``explode_threshold``.
        amp_overflow_steps (int): GradScaler steps with Inf/NaN gradients (the scaler's to skip).
        spike_steps (int): Steps a spike policy acted on (with ``recorder``).
        recorder (FlightRecorder | None): The flight recorder, or None.
        sinks (list): The sinks, in the order given; see ``sink_health``.
        max_norm: The clip threshold as given: None, a number, a schedule or a ``ZClip``.
        norm_type (float): The order of the total norm.
        every (int): The logging interval in steps (0: never).
        on_nonfinite (str): The policy for non-finite gradients.
        on_explode (str): The policy for explosions (``"ignore"`` without ``explode_threshold``).
        explode_threshold (float | None): The explosion threshold.
        sink_ranks (int | str): Which ranks write (a rank number or ``"all"``).
        scaler: The ``GradScaler``, or None.
        optimizer: The optimizer of the fused AMP unscale, or None.
        enabled (bool): False: ``step`` does nothing.
        dynamics: The noise scale and update ratios (``gradfuse.monitor.dynamics``), or None.

    Raises:
        ValueError: an argument is out of range: ``on_nonfinite`` / ``on_explode`` not one of
            ``"raise"``, ``"skip"``, ``"warn"``, ``"ignore"``; ``explode_threshold`` not > 0;
            ``every`` < 0; ``max_norm`` or ``clip_value`` negative or NaN, ``norm_type`` NaN
            (or not the ``norm_type`` of a ``GradWatch`` given as ``model``);
            ``per`` not None, ``"param"`` or ``"layer"``; a bad ``agc`` / ``agc_eps``; more than
            one of ``max_norm``, ``clip_value`` and ``agc``; ``per`` without a numeric (or
            schedule) ``max_norm``; ``sink_ranks`` neither a rank number nor ``"all"``;
            ``optimizer`` without ``scaler`` or ``max_update_rms``; ``max_update_rms`` or
            ``update_every`` without an optimizer, or out of range; ``activations`` /
            ``trace_nonfinite`` without an
            ``nn.Module`` (``model`` or ``module``), on a model compiled with ``torch.compile``,
            or with an ``activation_modules`` name that the model does not have.
        TypeError: ``activation_modules`` holds something other than module names or modules.

    Example:
        ```python
        monitor = gradfuse.GradMonitor(model, max_norm=1.0, every=100,
                                       explode_threshold=1e4, on_explode="skip",
                                       sinks=[gradfuse.JsonlSink("run.jsonl")])
        for x, y in loader:
            loss_fn(model(x), y).backward()
            report = monitor.step()        # statistics, clip, policies, logging
            if not report.skip:
                optimizer.step()
            optimizer.zero_grad()
        monitor.close()                    # logs the last step, closes the sinks
        print(monitor.counters())
        ```
    """

    def __init__(self, model, *, max_norm: float | None = None, norm_type: float = 2.0,
                 every: int = 100, on_nonfinite: str = "skip",
                 explode_threshold: float | None = None, on_explode: str = "skip",
                 sinks=(), layer_depth: int | None = None, scaler=None, optimizer=None,
                 enabled: bool = True, start_step: int = 0, histogram: bool = False,
                 per: str | None = None, clip_value: float | None = None, agc: float | None = None,
                 agc_eps: float = 1e-3, check_double_clip: bool = True,
                 noise_scale=False, update_ratios=False, update_every: int | None = None,
                 max_update_rms: float | None = None,
                 activations: bool = False, trace_nonfinite: bool = False, activation_modules=None,
                 module: nn.Module | None = None, sink_ranks: int | str = 0, recorder=None,
                 on_spike: str = "warn", blocking: bool = True, fused_step: bool = False):
        check_monitor_args(on_nonfinite=on_nonfinite, on_explode=on_explode, on_spike=on_spike,
                           explode_threshold=explode_threshold, every=every, sink_ranks=sink_ranks,
                           optimizer=optimizer, scaler=scaler, max_update_rms=max_update_rms, blocking=blocking,
                           fused_step=fused_step, max_norm=max_norm, per=per)
        clip = check_clip_args(max_norm, norm_type, per, clip_value, agc, agc_eps)
        self.max_norm, self.norm_type, self.per, self.clip_value, self.agc = clip[:5]
        self.recorder = flight.as_recorder(recorder)
        self.on_spike, self.spike_steps = (on_spike if self.recorder is not None else "ignore"), 0
        # parameters resolved once, not per step
        self.source, self._watch, self._names_by_param = watch_source(model, self.norm_type, "gradfuse.GradMonitor")
        self._call_name = "gradfuse GradMonitor.step()"  # what the double-clipping warning names
        self._double_clip = (DoubleClipCheck(self._watch.params, self._watch.names)
                             if check_double_clip and clip.modes else None)
        self._max_norm_now = None  # the max_norm of the latest step (a number, or a device threshold)
        self.every, self.on_nonfinite = every, on_nonfinite
        self.explode_threshold = explode_threshold
        self.on_explode = on_explode if explode_threshold is not None else "ignore"
        self.sinks = list(sinks)
        self._sink_set = SinkSet(self.sinks)
        self.sink_ranks = sink_ranks
        self.layer_depth = layer_depth
        self.scaler, self.optimizer, self.enabled = scaler, optimizer, enabled
        self.histogram = histogram  # exponent histograms and headroom on logging steps
        self.step_count = start_step
        self.skipped_steps = self.anomaly_steps = self.nonfinite_steps = 0
        self.explode_steps = self.amp_overflow_steps = 0
        self._clipped_restored = 0  # clipped steps counted on the host (load_state_dict; blocking=False)
        self._clipped = None  # device counter: reading it syncs, counting it does not
        self._restored = False
        self._started = False
        self._last_report: StepReport | None = None
        self.dynamics = None  # gradfuse.monitor.dynamics: noise scale, update ratios
        if noise_scale or update_ratios or update_every is not None or max_update_rms is not None:
            self.dynamics = Dynamics(noise_scale, update_ratios, optimizer=optimizer,
                                     names_by_param=self._names_by_param, layer_depth=layer_depth,
                                     update_every=update_every, max_update_rms=max_update_rms,
                                     fused_optimizer=optimizer if fused_step else None)
        # the ring is made on the first step, on the gradients' device
        flight.configure(self.recorder, self._watch.names, self._names_by_param, layer_depth, self.norm_type,
                         self.dynamics, optimizer, fused_step)
        # blocking=False: the skip handed to the optimizer's step, and the step not yet settled;
        # fused_step=True: the clip coefficient handed to it, and the step takes the update
        # statistics too, and applies max_update_rms itself
        self._step_hook, self._defers = step_handoff(self, optimizer, blocking=blocking, fused_step=fused_step)
        self.fused_step, self._rides_updates = fused_step, self.dynamics is not None and self.dynamics.rides_step
        self._pending: Pending | None = None
        self._act_hooks = None
        if activations or trace_nonfinite:
            self._act_hooks = MonitorHooks(module if module is not None else self.source, activation_modules,
                                           activations=activations, trace_nonfinite=trace_nonfinite,
                                           histogram=histogram)
            if enabled:  # the first step's forward and backward come before its step()
                self._act_hooks.arm(full=self.every > 0 and start_step % self.every == 0)

    def arm_activations(self, full: bool = True) -> None:
        """Arms the activation hooks for the coming forward and backward.

        An integration that decides per step whether it logs calls this before the step;
        ``step`` arms by ``every``. Does nothing without ``activations`` / ``trace_nonfinite``
        or when the monitor is disabled.

        Args:
            full: True: the full statistics (with ``activations=True``); False: only the
                non-finite counts when ``trace_nonfinite=True``, else no hook. A full capture
                already armed stays.

        Example:
            ```python
            monitor.arm_activations(full=will_log_this_step)
            loss_fn(model(x), y).backward()
            monitor.step(log=will_log_this_step)
            ```
        """
        if self._act_hooks is not None and self.enabled:
            self._act_hooks.arm(full)

    def disarm_activations(self) -> None:
        """Removes the activation hooks armed for a coming step (an integration ending its run).

        Does nothing when none are armed.

        Example:
            ```python
            monitor.disarm_activations()   # no hook outlives the run
            ```
        """
        if self._act_hooks is not None:
            self._act_hooks.take()

    @property
    def watches_activations(self) -> bool:
        """Whether the monitor arms activation hooks (``activations=`` or ``trace_nonfinite=``): a bool."""
        return self._act_hooks is not None

    @property
    def clipped_steps(self) -> int:
        """Steps on which clipping scaled the gradients, an int (reads a device counter: one
        host sync; with ``blocking=False`` none: the steps settled so far), including those
        restored by ``load_state_dict``."""
        live = self._clipped is not None and not self._defers  # blocking=False: counted on settling
        return self._clipped_restored + (int(self._clipped) if live else 0)

    @property
    def dropped_records(self) -> int:
        """Records that some sink did not write (it raised, or sat out its back-off), an int;
        per sink: ``sink_health``."""
        return self._sink_set.dropped

    def sink_health(self) -> list[dict]:
        """How each sink has fared (see ``write`` for the back-off rule).

        Returns:
            One dict per sink, in the order of ``sinks``: ``sink`` (its class name),
                ``written``, ``dropped``, ``failures`` (consecutive), ``retry_in`` (records it still
                sits out) and ``last_error``.

        Example:
            ```python
            for h in monitor.sink_health():
                if h["dropped"]:
                    print(h["sink"], h["dropped"], h["last_error"])
            ```
        """
        return self._sink_set.health()

    def _amp_active(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def _needs_flag(self) -> bool:
        return (self.on_nonfinite != "ignore" or self.on_explode != "ignore" or self.on_spike != "ignore"
                or self._amp_active()
                or (self._act_hooks is not None and self._act_hooks.trace_nonfinite))

    def _unscale_here(self) -> bool:
        """Whether this step unscales the gradients itself: the fused AMP path, taken unless
        the gradients were unscaled already (``scaler.unscale_`` was called)."""
        return (self.optimizer is not None and self._amp_active()
                and not scaler_unscaled(self.scaler, self.optimizer))

    @torch.no_grad()
    def step(self, log: bool | None = None, loss=None) -> StepReport:
        """Takes this step's statistics (and clips when ``max_norm`` is set), applies the policies,
        logs when due, and says whether to skip the optimizer step.

        Call it after ``backward()`` (and after ``scaler.unscale_(optimizer)``, unless the
        monitor was given ``optimizer`` to unscale itself), before ``optimizer.step()``. Each call
        advances ``step_count``. With ``enabled=False`` it does nothing and returns an empty
        report. A step that a policy skips is left unclipped; the ``"skip"`` and ``"warn"``
        policies warn with the message.

        Args:
            log: True / False log this step or not (an integration following its framework's
                logging cadence); None: every ``every`` steps. Anomalies are logged either way.
            loss: this step's loss (a tensor, read on the device, or a number), for the flight
                recorder (its loss column and loss spikes); ignored without ``recorder``.

        Returns:
            What the step saw and decided: ``skip`` (do not take the optimizer
                step), ``anomalies``, ``message``, ``stats`` (device tensors), ``logged``.

        Raises:
            GradientAnomaly: an anomaly under the ``"raise"`` policy (``on_nonfinite="raise"`` for
                non-finite gradients, ``on_explode="raise"`` for an explosion); its ``report``
                holds the step's ``StepReport``, and the record is written to the sinks first.
            ValueError: with ``on_nonfinite="raise"``, a ``max_norm`` schedule that raised or
                returned NaN, a negative value or not a number at this step (the error names the
                step).

        Example:
            ```python
            loss.backward()
            report = monitor.step()
            if not report.skip:
                optimizer.step()
            optimizer.zero_grad()
            ```
        """
        self._settle()  # blocking=False: the step before, as the host hears of it now
        step = self.step_count
        self.step_count += 1
        if not self.enabled:
            if self._act_hooks is not None:
                self._act_hooks.take()  # turned off after hooks were armed: none stays
            return StepReport(step)
        self._start(step)
        capture = self._act_hooks.take() if self._act_hooks is not None else None
        plan = self._plan(step, log)
        report = StepReport(step, stats=plan.take_stats())
        if capture is not None and capture.full:
            report.activations = capture
        if self._act_hooks is not None:  # hooks for the next step's forward and backward
            self._act_hooks.arm(full=log is None and self.every > 0 and (step + 1) % self.every == 0)
        flight.observe(self.recorder, step, report, loss)
        if self._defers:
            self._defer(plan, report, capture)
        else:
            self._finish(plan, report, self._apply_policies(plan, report, capture))
        self._last_report = report
        return report

    def _start(self, step: int) -> None:
        """The first enabled step: the numbering check, and the run configuration to the sinks."""
        if self._started:
            return
        self._started = True
        if not self._restored:
            self._sink_set.warn_if_numbering_twice(step)
        if writing_rank(self.sink_ranks) is not False:
            self._sink_set.start({**self.config(), "start_step": step})

    def _plan(self, step: int, log: bool | None) -> StepPlan:
        """How this step takes its statistics and clips, and whether it logs; warns first when
        someone else changed the gradients since the backward."""
        fused_unscale = self._unscale_here()
        log_now = (self.every > 0 and step % self.every == 0) if log is None else log
        # scaler.unscale_ (called before the monitor) changes every gradient once, legitimately
        if self._double_clip is not None and self._double_clip.warn_once(
                1 if self._amp_active() and not fused_unscale else 0, self._call_name):
            self._double_clip = None  # warned once: the check goes
        max_norm, bad_max_norm = max_norm_of_step(self.max_norm, step)
        self._max_norm_now = max_norm
        return plan_step(self, self._watch, self._names_by_param, log_now=log_now, fused_unscale=fused_unscale,
                         max_norm=max_norm, bad_max_norm=bad_max_norm,
                         needs_flag=self._needs_flag(), fused_step=self.fused_step)

    def _apply_policies(self, plan: StepPlan, report: StepReport, capture, pending: Pending | None = None) -> Decision:
        """The anomalies of the step and what the policies make of them: the counters, the
        message, and a raise, a skip or a warning. ``pending``: a step settled one step later
        (its flag read from its host copy; a skip or raise was applied on the device)."""
        s = report.stats
        flags = pending.flags if pending is not None else int(self._flags(s) if self._needs_flag() and len(s) else 0)
        decision = decide(flags, amp_active=self._amp_active(), bad_max_norm=plan.bad_max_norm is not None,
                          on_nonfinite=self.on_nonfinite, on_explode=self.on_explode, on_spike=self.on_spike)
        report.anomalies = decision.anomalies
        for anomaly, counter in (("amp_overflow", "amp_overflow_steps"), ("nonfinite", "nonfinite_steps"),
                                 ("explode", "explode_steps"), ("spike", "spike_steps")):
            if anomaly in decision.anomalies:
                setattr(self, counter, getattr(self, counter) + 1)
        if plan.bad_max_norm is not None and self.on_nonfinite == "raise":
            plan.leave_unscaled(s)
            raise plan.bad_max_norm
        if decision.counts_as_anomaly:
            self.anomaly_steps += 1
            report.message, report.first_nonfinite, report.spikes = anomaly_message(
                s, report.anomalies, self.explode_threshold, capture, plan.bad_max_norm, self.recorder,
                None if pending is None else pending.snapshot)
        if decision.raises:
            if pending is None:
                plan.leave_unscaled(s)  # the gradients in true units, for inspection
                flight.commit_step(self.recorder, report, decision, raising=True)
            else:  # skipped on the device at that step
                report.skip, report.settled = True, True
                flight.dump_if_acted(self.recorder, report, decision, pending.snapshot)
            self._write(report, True, None if pending is None else pending.max_norm)
            raise GradientAnomaly(report.message if pending is None else f"step {report.step}: {report.message}",
                                  report)
        # An AMP overflow step is the scaler's to skip: scaler.step/update must still run.
        report.skip = decision.skips
        if report.skip:
            self.skipped_steps += 1
            warn(f"gradfuse step {report.step}: optimizer step skipped: {report.message}")
        elif decision.warns:
            warn(f"gradfuse step {report.step}: {report.message}")
        return decision

    def _clip(self, plan: StepPlan, report: StepReport, skip: torch.Tensor | None = None) -> torch.Tensor | None:
        """Clips unless the step is skipped (or the scaler's to skip), finishes the fused AMP
        unscale, hands the optimizer's step what it takes on the device (``skip``, the clip
        coefficient with ``fused_step``), and counts a clipped step (its statistics then become
        the report's); returns the step's 0-d clipped bit, or None."""
        clip = ((plan.max_norm is not None or self.clip_value is not None or self.agc is not None)
                and not report.skip and "amp_overflow" not in report.anomalies)
        s = plan.clip(report.stats, clip, skip)
        self._step_hook.arm(skip, plan.step_scale(s, clip))  # what the step takes on the device
        if clip and s.clipped is not None:
            clipped = s.clipped if s.clipped.dim() == 0 else s.clipped.any()
            report.stats = s
            self._clipped = clipped.to(torch.int64) if self._clipped is None else self._clipped + clipped
            return clipped
        return None

    def _flags(self, s) -> torch.Tensor:
        """The step's ``anomaly_flags``, on the device."""
        return anomaly_flags(s, self.explode_threshold, self.recorder.spiked if self.on_spike != "ignore" else None)

    def _defer(self, plan: StepPlan, report: StepReport, capture) -> None:
        """``blocking=False``: the decision taken and applied on the device (the skip handed to
        the optimizer's step), the clip, and the host copies the next step settles from."""
        s = report.stats
        if plan.bad_max_norm is not None and self.on_nonfinite == "raise":
            plan.leave_unscaled(s)
            raise plan.bad_max_norm  # a schedule's value is the host's own: nothing to wait for
        flags = self._flags(s) if self._needs_flag() and len(s) else None
        skip = device_skip_flag(flags, self, bad_max_norm=plan.bad_max_norm is not None)
        clipped = self._clip(plan, report, skip)
        rows_later = self.dynamics is not None and self.dynamics.on_deferred_step(
            report, skip, plan.log_now, self.scaler._scale if self._amp_active() else None,
            need_updates=flight.wants_updates(self.recorder), from_step=self._rides_updates)
        commit = functools.partial(flight.commit_deferred, self.recorder, report, skip, keep=flags is not None,
                                   dynamics=self.dynamics)
        self._pending = Pending.start(plan, report, capture, flags, clipped, None if rows_later else commit(),
                                      self._max_norm_now,
                                      copy_stats=flags is not None or (bool(self.sinks) and plan.log_now),
                                      headroom_of=self.source if self.histogram and self.sinks else None)
        if rows_later:  # the update statistics ride the step: its rows, then the recorder's row
            pending = self._pending
            self._step_hook.after_step(lambda rows: pending.rows_taken(rows, self.dynamics, skip, commit))

    def _settle(self) -> None:
        """``blocking=False``: the previous step, acted on from its host copies: its decision
        (counters, message, a raise or a warning), its dump and its record."""
        self._step_hook.finish()  # a step whose optimizer never stepped: its record all the same
        pending, self._pending = self._pending, None
        if pending is None:
            return
        report = pending.read()
        try:
            decision = self._apply_policies(pending.plan, report, pending.capture, pending)
        finally:  # a step that raises was skipped on the device too
            pending.settled(self.dynamics)
        self._clipped_restored += pending.clipped and not report.skip  # a skipped step applied no clip
        flight.dump_if_acted(self.recorder, report, decision, pending.snapshot)
        report.settled = True
        if pending.plan.log_now or (report.anomalies and decision.policies):
            self._write(report, bool(report.anomalies), pending.max_norm)
            report.logged = True

    def _finish(self, plan: StepPlan, report: StepReport, decision: Decision) -> None:
        """The clip, the dynamics of the step, and its record to the sinks on logging steps and
        on anomalies a policy acted on."""
        self._clip(plan, report)
        if self.dynamics is not None and self.dynamics.on_step(
                report, plan.log_now, self.scaler._scale if self._amp_active() else None,
                need_updates=flight.wants_updates(self.recorder), from_step=self._rides_updates):
            # the update statistics ride the optimizer's step: the rest of this step follows it
            self._step_hook.after_step(lambda rows: self._commit(plan, report, decision, rows))
            return
        self._commit(plan, report, decision)

    def _commit(self, plan: StepPlan, report: StepReport, decision: Decision, step_rows=None) -> None:
        """The flight recorder's row of the step and its record (with ``step_rows``, the update
        statistics its ``gradfuse.optim`` step took)."""
        if step_rows is not None:
            self.dynamics.take_step_rows(report, step_rows)
        flight.commit_step(self.recorder, report, decision, dynamics=self.dynamics)
        if plan.log_now or (report.anomalies and decision.policies):
            self._write(report, event=bool(report.anomalies))
            report.logged = True

    def micro_step(self) -> None:
        """Says a micro-batch's backward has finished (gradient accumulation), for the noise
        scale: call it after each ``backward()``; the first micro-batch's squared norm is taken
        by one fused pass on steps that accumulate. Does nothing without ``noise_scale``
        (or when the monitor is disabled).

        Example:
            ```python
            monitor = gradfuse.GradMonitor(model, noise_scale=True)
            for micro in range(4):
                (loss_fn(model(x[micro]), y[micro]) / 4).backward()
                monitor.micro_step()
            report = monitor.step()
            ```
        """
        if self.enabled and self.dynamics is not None:
            self.dynamics.micro_step(self._watch)

    @property
    def noise_scale(self):
        """The ``gradfuse.NoiseScale`` estimator (``noise_scale=``), or None."""
        return None if self.dynamics is None else self.dynamics.noise_scale


    def config(self) -> dict:
        """The monitor's settings as plain values, for a tracker's run configuration.

        Sinks with ``on_start(config)`` get it before the first record (with ``start_step``,
        the first step, added).

        Returns:
            A dict: ``max_norm`` (a number, or ``"schedule"`` / ``"zclip"``), ``norm_type``,
                ``every``, ``on_nonfinite``, ``on_explode``, ``explode_threshold``, ``per``,
                ``clip_value``, ``agc``, ``layer_depth``, ``histogram``, ``activations``,
                ``noise_scale``, ``update_ratios``, ``sink_ranks``.

        Example:
            ```python
            wandb.config.update({"gradfuse": monitor.config()})
            ```
        """
        return run_config(self, bool(self._act_hooks is not None and self._act_hooks.activations))

    def counters(self) -> dict[str, int]:
        """The run's counters so far (also in every record, under ``counters``).

        Returns:
            A dict of ints: ``steps`` (steps taken), ``clipped_steps`` (reads a device counter),
                ``skipped_steps``, ``anomaly_steps``, ``nonfinite_steps``, ``explode_steps``,
                ``amp_overflow_steps``, ``dropped_records``; with ``max_update_rms`` also
                ``update_clipped_params``, ``update_clipped_steps``; with ``recorder`` also
                ``spike_steps``, ``dumps``, ``failed_dumps``.

        Example:
            ```python
            c = monitor.counters()
            print(f"{c['skipped_steps']} of {c['steps']} steps skipped")
            ```
        """
        out = {"steps": self.step_count, "clipped_steps": self.clipped_steps}
        out.update({name: getattr(self, name) for name in COUNTERS})
        out["dropped_records"] = self.dropped_records
        if self.dynamics is not None:
            out.update(self.dynamics.counters())
        return {**out, **flight.recorder_counters(self)}

    def record(self, report: StepReport, event: bool = False, max_norm=None) -> dict:
        """The record the sinks get for ``report`` (reads its statistics: one transfer).

        The keys are listed on the Data reference page (``step``, ``total_norm``, ``max_norm``,
        ``clip_coef``, ``anomalies``, ``counters``, ``params``, ``layers``, ...).

        Args:
            report: A ``StepReport`` with ``stats`` (one ``step`` returned).
            event: The record is written because of an anomaly (its ``event`` key).
            max_norm: The step's ``max_norm`` as logged, when known (a number); None: from the
                report (a ``ZClip`` threshold read on the device).

        Returns:
            The record, a dict of plain values (what ``JsonlSink`` writes as one JSON line).

        Example:
            ```python
            report = monitor.step(log=False)
            monitor.write(monitor.record(report))     # log this step by hand
            ```
        """
        return step_record(self, report, event, self._max_norm_now, logged_max_norm=max_norm)

    def _write(self, report: StepReport, event: bool, max_norm=None) -> None:
        if self.sinks:
            self.write(self.record(report, event, max_norm))

    def write(self, record: dict) -> None:
        """Hands ``record`` to every sink; never raises because of a sink.

        A sink that raises (a full disk, a closed writer, a metrics client that times out: any
        ``Exception``) does not stop training or the other sinks. The rule: its first failure
        warns once, with the reason; after its k-th consecutive failure it sits out the next
        ``min(2**(k-1), 64)`` records, then is tried again; a success resets k. Every record a
        sink did not write counts in ``dropped_records`` (per sink: ``sink_health``).

        Under ``torch.distributed`` with two or more processes only the ranks of ``sink_ranks``
        write (every rank builds the record, so collectives stay matched); with ``"all"`` each
        record gets a ``rank`` key.

        Args:
            record: A record, as ``record`` builds it.

        Example:
            ```python
            monitor.write(monitor.record(report, event=True))
            ```
        """
        rank = writing_rank(self.sink_ranks)
        if rank is False:
            return
        if rank is not None:
            record = {**record, "rank": rank}
        self._sink_set.write(record)

    def state_dict(self) -> dict:
        """What a resumed run needs to continue: the next step number and the counters (reads
        the device counter of clipped steps). Save it with the training checkpoint.

        Returns:
            A dict: ``version``, ``step`` (the next step number), ``clipped_steps`` and the other
                counters; with a ``ZClip`` ``max_norm`` its state (``zclip``), with the noise scale
                or update ratios theirs (``dynamics``), with a flight recorder ``spike_steps`` and
                its counters and spike histories (``recorder``).

        Example:
            ```python
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "gradfuse": monitor.state_dict()}, "ckpt.pt")
            ```
        """
        self._settle()
        return monitor_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``: the next ``step`` continues the numbering and counts.

        Also restores the ``ZClip`` state and the dynamics (noise scale) state when the
        monitor has them and ``state`` holds them.

        Args:
            state: A dict from ``state_dict``.

        Raises:
            KeyError: ``state`` lacks ``step``, ``clipped_steps`` or one of the counters.
            ValueError: ``state`` was saved by a newer gradfuse (its ``version`` is higher than
                this one understands); also from the ``ZClip`` state when its ``warmup_steps``
                differs, and from a malformed noise scale state.

        Example:
            ```python
            ckpt = torch.load("ckpt.pt")
            monitor.load_state_dict(ckpt["gradfuse"])
            ```
        """
        restore_state(self, state)  # checked first: a malformed state changes nothing
        self._clipped_restored, self._clipped, self._restored = int(state["clipped_steps"]), None, True

    def settle(self) -> None:
        """``blocking=False``: acts now on the step not yet settled (its decision, counters,
        warnings, a raise, its dump and record, as the next ``step`` would); nothing to do
        otherwise. Unlike ``flush`` it writes no record that the step's logging did not ask for.
        Reads the step's host copies: on a GPU it waits for that step's device work.

        Example:
            ```python
            monitor.settle()   # e.g. at the end of an epoch, before reading counters()
            ```
        """
        self._settle()

    def flush(self) -> None:
        """Logs the last step if it was not logged, so that the log ends where the run ended
        (its counters cover every step). ``close`` does this first.

        Example:
            ```python
            monitor.flush()   # e.g. before reading the JSONL log mid-run
            ```
        """
        self._settle()
        last = self._last_report
        if last is not None and not last.logged and last.stats is not None:
            self._write(last, event=False)
            last.logged = True

    def close(self) -> None:
        """Logs the last step (``flush``) and closes the sinks (a sink that fails to close
        is warned about, never raised). Also removes any activation hook still armed, and the
        hooks on ``optimizer``'s step (``blocking=False``, ``fused_step``).

        Example:
            ```python
            try:
                train(model, monitor)
            finally:
                monitor.close()
            ```
        """
        if self._act_hooks is not None:
            self._act_hooks.take()  # no hook outlives the monitor
        try:
            self.flush()
        finally:
            self._step_hook.remove()  # the optimizer steps on without the monitor
            self._sink_set.close()
