"""The activation hooks a ``gradfuse.monitor.monitor.GradMonitor`` arms on the steps it
samples.

Layer: monitor. Imports ``gradfuse.activations``.
"""
from __future__ import annotations

from torch import nn

from gradfuse.activations.capture import ActivationCapture, is_compiled, resolve_modules


class MonitorHooks:
    """The hooks a ``GradMonitor`` arms: a full capture (statistics) for the steps it logs,
    a trace capture (non-finite counts only) on every other step when ``trace_nonfinite``, and
    no hook at all otherwise. ``histogram``: the full captures also take the exponent
    histograms."""

    def __init__(self, model, modules=None, activations: bool = False, trace_nonfinite: bool = False,
                 histogram: bool = False):
        if not isinstance(model, nn.Module):
            raise ValueError("gradfuse.GradMonitor: activations=True / trace_nonfinite=True need the "
                             "model as an nn.Module (GradMonitor(model, ...), attach(optimizer, model, "
                             f"...)); got {type(model).__name__}")
        if is_compiled(model):
            raise ValueError(
                "gradfuse.GradMonitor: activations=True / trace_nonfinite=True refuse a model compiled "
                "with torch.compile: registering hooks on sampled steps would make torch.compile "
                "recompile it. Watch the activations of the uncompiled model, or turn them off.")
        self.model = model
        self.modules = modules
        self.activations = activations
        self.trace_nonfinite = trace_nonfinite
        self.histogram = histogram
        resolve_modules(model, modules)  # bad names fail here, at construction
        self.current: ActivationCapture | None = None

    def arm(self, full: bool) -> None:
        """Hooks for the next step: statistics when ``full`` (and activations are on), else the
        non-finite counts when tracing, else none. A full capture already armed stays."""
        full = full and self.activations
        if self.current is not None:
            if self.current.full or not full:
                return
            self.current.disarm()
            self.current = None
        if not (full or self.trace_nonfinite):
            return
        self.current = ActivationCapture(self.model, self.modules, grads=True,
                                         trace_nonfinite=self.trace_nonfinite, stats=full,
                                         training_only=True, histogram=full and self.histogram).arm()

    def take(self) -> ActivationCapture | None:
        """The capture of the step that just ran (hooks removed), or None."""
        cap, self.current = self.current, None
        if cap is not None:
            cap.disarm()
        return cap

    def hook_count(self) -> int:
        """The number of hooks the armed capture holds (0 when none is armed)."""
        return 0 if self.current is None else self.current.hook_count

