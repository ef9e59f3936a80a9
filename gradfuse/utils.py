"""Helpers every layer may use: warnings that point at the user's line, optional packages
imported on first use with an install hint, and whether a framework's version is in a tested
range.

Layer: the bottom, beside ``gradfuse.ops``. Imports nothing of gradfuse.
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings

# Frames of these packages are not the user's line: warnings point past them.
FRAMEWORK_PACKAGES = ("gradfuse", "torch", "lightning", "pytorch_lightning", "lightning_fabric",
                      "transformers", "accelerate", "deepspeed")


def _framework_dirs() -> tuple[str, ...]:
    dirs = []
    for name in FRAMEWORK_PACKAGES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside gradfuse, torch and the training
    frameworks: the user's ``mon.step()``, ``optimizer.step()`` or ``trainer.fit()`` line (a fixed
    stacklevel breaks on every decorator, e.g. ``torch.no_grad``)."""
    internal = _framework_dirs()
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def require(module: str, pip_name: str, what: str):
    """Imports the optional ``module``, or raises ImportError saying that gradfuse's ``what``
    needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"gradfuse.{what} needs the optional package {pip_name!r}: "
                          f"pip install {pip_name}") from e


def outside_tested(version: str, tested: tuple[tuple[int, int], tuple[int, int]]) -> str | None:
    """``None`` when the (major, minor) of ``version`` (``"0.19.8"``, ``"0.3.1.dev0+git12"``) is in
    ``tested``, ``[first, end)``; else that range in words (``">=0.19,<0.20"``), for the refusal."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    first, end = tested
    return None if first <= tuple(parts) < end else f">={first[0]}.{first[1]},<{end[0]}.{end[1]}"
