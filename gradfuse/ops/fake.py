"""Fake (meta) kernels of the compiled ops, so that torch.compile can trace them and
``torch.library.opcheck`` can check them: each returns empty tensors of the real op's shapes.

Layer: ops. Imports ``gradfuse.ops.library`` and ``gradfuse.ops.layout``.
"""
from __future__ import annotations

import torch

from gradfuse.ops.layout import (
    NUM_BINS,
    NUM_COUNT_STATS,
    NUM_FLOAT_STATS,
    NUM_UPDATE_COUNT_STATS,
    NUM_UPDATE_FLOAT_STATS,
)
from gradfuse.ops.library import extension


def _rows(tensors, count: int):
    if len(tensors) == 0:
        return (torch.empty((0, NUM_FLOAT_STATS), dtype=torch.float64),
                torch.empty((0, NUM_COUNT_STATS), dtype=torch.int64))
    return (tensors[0].new_empty((count, NUM_FLOAT_STATS), dtype=torch.float64),
            tensors[0].new_empty((count, NUM_COUNT_STATS), dtype=torch.int64))


def _stats_fake(tensors, norm_type):
    return _rows(tensors, len(tensors))


def _moments_fake(tensors):
    return _rows(tensors, len(tensors))


def _scale_fake(tensors, coef, conditional=True):
    return None


def _unit_stats_fake(tensors, units, norm_type):
    return _rows(tensors, sum(units))


def _unit_scale_fake(tensors, units, coefs, conditional=True):
    return None


def _clamp_fake(tensors, clip_value):
    floats, counts = _rows(tensors, len(tensors))
    if len(tensors) == 0:
        return floats, counts, torch.empty((0,), dtype=torch.int64)
    return floats, counts, tensors[0].new_empty((len(tensors),), dtype=torch.int64)


def _histogram_fake(tensors):
    if len(tensors) == 0:
        return torch.empty((0, NUM_BINS), dtype=torch.int64)
    return tensors[0].new_empty((len(tensors), NUM_BINS), dtype=torch.int64)


def _update_stats_fake(params, grads, moment1, moment2, moment2_max, hyper, rule):
    n = len(params)
    return (hyper.new_empty((n, NUM_UPDATE_FLOAT_STATS), dtype=torch.float64),
            hyper.new_empty((n, NUM_UPDATE_COUNT_STATS), dtype=torch.int64))


def _update_clip_fake(params, grads, moment1, moment2, moment2_max, hyper, coefs, rule):
    return None


def _optim_step_fake(params, grads, moment1, moment2, moment2_max, coefs, rule, torch_threads, grad_scale=None,
                     skip=None, update_coefs=None, stats=False, write=True):
    n = len(params) if stats else 0
    return (coefs.new_empty((n, NUM_UPDATE_FLOAT_STATS), dtype=torch.float64),
            coefs.new_empty((n, NUM_UPDATE_COUNT_STATS), dtype=torch.int64))


FAKES = {
    "multi_tensor_stats": _stats_fake,
    "multi_tensor_moments": _moments_fake,
    "multi_tensor_scale_": _scale_fake,
    "multi_tensor_unit_stats": _unit_stats_fake,
    "multi_tensor_unit_scale_": _unit_scale_fake,
    "multi_tensor_clamp_": _clamp_fake,
    "multi_tensor_exponent_histogram": _histogram_fake,
    "multi_tensor_update_stats": _update_stats_fake,
    "multi_tensor_update_clip_": _update_clip_fake,
    "multi_tensor_optim_step_": _optim_step_fake,
}

if extension is not None:
    for _name, _fake in FAKES.items():
        if hasattr(torch.ops.gradfuse, _name):  # a build from before an op has no schema for it
            torch.library.register_fake(f"gradfuse::{_name}")(_fake)
