"""Loading gradfuse._C, checking what it was built against, and choosing a backend per device.

The compiled ops are registered with the dispatcher as ``torch.ops.gradfuse.*``. Where the
extension is missing, stale, or has no kernel for a device type, the pure-PyTorch reference
(:mod:`gradfuse.reference`) runs instead, with one warning per device type.
"""
from __future__ import annotations

import os
import warnings

import torch

REBUILD_HINT = ("Rebuild it against the torch you run: "
                "`pip install --no-build-isolation --no-deps -e .` in the gradfuse checkout.")

_C = None
_load_error: str | None = None

try:
    from gradfuse import _C  # noqa: F811  (registers torch.ops.gradfuse.* with the dispatcher)
except ImportError as e:  # not built, or built for another torch (undefined symbols)
    _load_error = f"gradfuse._C could not be loaded ({e}). {REBUILD_HINT}"

if _C is not None:
    _built = _C.build_info()["torch_version"]
    if _built != torch.__version__:
        raise ImportError(
            f"gradfuse._C was built for torch {_built} but torch {torch.__version__} is running. "
            + REBUILD_HINT)

if _C is None and os.environ.get("GRADFUSE_REQUIRE_EXT") == "1":
    raise ImportError(_load_error)


def build_info() -> dict:
    """What the extension was built against: torch and CUDA versions, CUDA archs, whether the
    CUDA kernels were built, the chunk size, and the CPU kernel build in use."""
    if _C is None:
        return {"extension_loaded": False, "error": _load_error, "torch_version": torch.__version__}
    info = dict(_C.build_info())
    info["extension_loaded"] = True
    info["cpu_capability"] = _C.cpu_capability()
    return info


_warned: set[str] = set()


# Looked up once: a plain dict keeps the hot path traceable by torch.compile.
_KERNELS = {
    device_type: _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "gradfuse::multi_tensor_stats", key)
    for device_type, key in (("cpu", "CPU"), ("cuda", "CUDA"))
}


def _has_kernel(device_type: str) -> bool:
    return _KERNELS.get(device_type, False)


def backend(device: torch.device | str) -> str:
    """Which implementation runs on ``device``: ``"cpu-avx2"``, ``"cpu-default"``, ``"cuda"``,
    or ``"reference"`` (pure PyTorch, when gradfuse._C has no kernel for it)."""
    device = torch.device(device)
    if device.type in ("meta",):
        return "meta"
    if not _has_kernel(device.type):
        return "reference"
    if device.type == "cpu":
        return "cpu-" + _C.cpu_capability()
    return device.type


def use_compiled(device: torch.device) -> bool:
    """True when the compiled op serves ``device``; warns once per device type when it does not."""
    if device.type == "meta" or _has_kernel(device.type):
        return True
    if device.type not in _warned:
        _warned.add(device.type)
        why = _load_error or f"gradfuse._C has no {device.type} kernels in this build"
        warnings.warn(f"gradfuse: using the pure-PyTorch reference on {device.type}: {why}",
                      RuntimeWarning, stacklevel=3)
    return False


if _C is not None:
    @torch.library.register_fake("gradfuse::multi_tensor_stats")
    def _stats_fake(tensors, norm_type):
        if len(tensors) == 0:
            return (torch.empty((0, 4), dtype=torch.float64), torch.empty((0, 4), dtype=torch.int64))
        n = len(tensors)
        return (tensors[0].new_empty((n, 4), dtype=torch.float64),
                tensors[0].new_empty((n, 4), dtype=torch.int64))

    @torch.library.register_fake("gradfuse::multi_tensor_scale_")
    def _scale_fake(tensors, coef, conditional=True):
        return None
