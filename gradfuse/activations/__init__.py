"""Activations and the gradients with respect to them: fused statistics per module, taken in
hooks on the steps that ask for them, and the first non-finite value traced to its module.

Modules: ``capture`` (``capture_activations``, ``ActivationCapture``: the hooks and what they
record; its docstring tells how rows are named, when they are taken and what they cost),
``stats`` (``ActivationStats``, the table of rows and its per-layer aggregates),
``dead_units`` (``unit_dim`` and the dead-unit count) and ``trace`` (where the first NaN / Inf
appeared).

Layer: activations, a capability beside clip, numerics and dynamics. Imports ``gradfuse.ops``
and ``gradfuse.core``.
"""
from gradfuse.activations.capture import ROOT_NAME, ActivationCapture, capture_activations
from gradfuse.activations.dead_units import unit_dim
from gradfuse.activations.stats import ActivationStats

__all__ = ["ROOT_NAME", "ActivationCapture", "ActivationStats", "capture_activations", "unit_dim"]
