"""What a call is given: the parameters of a source (a module, a tensor, an iterable of
parameters or of (name, parameter) pairs) with their names and gradients, and the checks of
every argument the entry points share, with the errors that name the parameter at fault.

Layer: core. Imports torch only.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import compress, repeat
from operator import is_not

import torch
from torch import nn

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


Source = nn.Module | torch.Tensor | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_grads(source: Source) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """(names, parameters, gradients) of the parameters in ``source`` that have a gradient."""
    return with_grads(*named_params(source))


def with_grads(names: list[str], params: list[torch.Tensor]):
    """(names, parameters, gradients) of those ``params`` that have a gradient. Called every
    training step with up to 10 000s of parameters: a few list comprehensions, no per-parameter
    tuples (allocating them wakes the garbage collector, which then walks every tensor)."""
    grads = [p.grad for p in params]  # .grad is a slow property: read it once
    if any(g is None for g in grads):
        keep = [i for i, g in enumerate(grads) if g is not None]
        names, params, grads = ([x[i] for i in keep] for x in (names, params, grads))
    return names, params, grads  # checked in gradfuse.core.engine.fused_stats, without another per-tensor pass


def named_params(source: Source) -> tuple[list[str], list[torch.Tensor]]:
    """(names, parameters) of every parameter of ``source``, with or without a gradient: the
    module's names, or ``[i]`` for the i-th item of an iterable that does not name it."""
    if isinstance(source, torch.Tensor):
        return ["[0]"], [source]
    if isinstance(source, nn.Module):
        return module_parameters(source)
    items = list(source)
    if all(isinstance(item, torch.Tensor) for item in items):  # clip_grad_norm_'s usual input
        return [f"[{i}]" for i in range(len(items))], items
    if not all(isinstance(item, tuple) for item in items):
        items = [_as_named(i, item) for i, item in enumerate(items)]
    return [n for n, _ in items], [p for _, p in items]


def _as_named(i: int, item) -> tuple[str, torch.Tensor]:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        return item
    if isinstance(item, torch.Tensor):
        return (f"[{i}]", item)
    raise TypeError(f"gradfuse: expected parameters or (name, parameter) pairs, "
                    f"item {i} is {type(item).__name__}")


def module_parameters(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """``module.named_parameters()`` as two lists, walked at a fraction of its cost: that
    generator hashes every parameter with the Python-level ``Tensor.__hash__`` and yields one
    tuple per parameter. Same modules (from ``named_modules()``), order, names and
    de-duplication; a module class that overrides ``named_parameters`` gets its own, and so does
    torch.compile (which traces named_parameters as it is).

    Each module's parameters are taken as a block (no Python per parameter): every entry of each
    ``_parameters`` in module order, then the ``None`` entries and the repeats of a parameter
    (tied weights; its first name stays) are taken out by identity."""
    if (type(module).named_parameters is not nn.Module.named_parameters
            or type(module)._named_members is not nn.Module._named_members
            or torch.compiler.is_compiling()):
        named = list(module.named_parameters())
        return [n for n, _ in named], [p for _, p in named]
    names, params = [], []
    for prefix, mod in module.named_modules():
        entries = mod._parameters
        if entries:
            params.extend(entries.values())
            names.extend(map((prefix + ".").__add__, entries) if prefix else entries)
    ids = set(map(id, params))
    if id(None) in ids:  # registered as None (``bias=False``): not a parameter
        keep = list(map(is_not, params, repeat(None)))
        names, params = list(compress(names, keep)), list(compress(params, keep))
        ids.discard(id(None))
    if len(ids) != len(params):  # a parameter under several names: its first one
        # id -> index of its first occurrence (the last one written, walking from the end)
        first = dict(zip(map(id, reversed(params)), range(len(params) - 1, -1, -1)))
        keep = sorted(first.values())
        names, params = [names[i] for i in keep], [params[i] for i in keep]
    return names, params


class GradientTypeError(TypeError, RuntimeError):
    """A gradient (or tensor) of a dtype or layout that gradfuse does not take, e.g. an integer
    one. Also a RuntimeError, which torch.nn.utils.clip_grad_norm_ raises for these."""


class ParametersTypeError(TypeError, AttributeError):
    """``parameters`` holds something that is not a tensor (None, a number, a module). Also an
    AttributeError, which torch.nn.utils.clip_grad_norm_ raises for these (``.grad``)."""


def check_tensors(names: list[str], tensors: list[torch.Tensor], what: str,
                   slow_path: bool = False) -> None:
    """Raises GradientTypeError naming the first of ``tensors`` that no path takes (see ``check_tensor``)."""
    for name, t in zip(names, tensors):
        check_tensor(name, t, what, slow_path)


def check_tensor(name: str, t: torch.Tensor, what: str, slow_path: bool = False) -> None:
    """Raises GradientTypeError naming ``name`` if no path takes ``t``. ``slow_path``: sparse
    (COO) and complex tensors are taken (the drop-ins for torch.nn.utils take them)."""
    takers = "gradfuse.clip_grad_norm_ and get_total_norm take them too"
    if t.layout != torch.strided and not (slow_path and t.layout == torch.sparse_coo):
        hint = f" ({takers})" if t.layout == torch.sparse_coo else ""
        raise GradientTypeError(f"gradfuse: the {what} of {name!r} is {t.layout}; statistics "
                                f"take dense tensors{hint}")
    if t.dtype in SUPPORTED_DTYPES or (slow_path and t.dtype.is_complex):
        return
    kind = "complex" if t.dtype.is_complex else "not floating point"
    hint = f" ({takers})" if t.dtype.is_complex else ""
    raise GradientTypeError(f"gradfuse: the {what} of {name!r} has dtype {t.dtype} ({kind}); "
                            f"supported: float16, bfloat16, float32, float64{hint}")


def check_norm_type(norm_type) -> float:
    """``norm_type`` as a float (``inf`` and ``-inf`` included).

    Raises:
        ValueError: ``norm_type`` is NaN.
    """
    p = float(norm_type)
    if math.isnan(p):
        # torch returns NaN and scales every gradient to NaN: refuse instead
        raise ValueError(f"gradfuse: norm_type must be a number or +-inf, got {norm_type!r}")
    return p


def check_max_norm(max_norm) -> float:
    """``max_norm`` as a float.

    Raises:
        ValueError: ``max_norm`` is NaN or negative.
    """
    m = float(max_norm)
    if math.isnan(m) or m < 0:
        raise ValueError(f"gradfuse: max_norm must be a non-negative number, got {max_norm!r}")
    return m


def as_tensor_list(tensors, fn: str) -> list:
    """``tensors`` as a list, as torch.nn.utils takes it: a tensor or an iterable; a module is
    refused (it would be iterated as submodules, or not at all)."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, nn.Module):
        raise ParametersTypeError(f"gradfuse.{fn}: got a module ({type(tensors).__name__}); pass "
                                  "model.parameters() (gradfuse.clip_ and stats take a module)")
    return list(tensors)


def grads_of(parameters: list, fn: str):
    """(names, parameters, gradients) of those ``parameters`` that have a gradient (``named_grads``).

    Raises:
        ParametersTypeError: An item of ``parameters`` is not a tensor; the message names ``fn``.
    """
    try:
        return named_grads(parameters)
    except TypeError as e:  # an item that is not a tensor: torch fails reading its .grad
        raise ParametersTypeError(f"gradfuse.{fn}: {e}") from None

