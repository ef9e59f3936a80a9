"""Loading gradfuse._C, checking what it was built against, and choosing a backend per device.

Layer: ops (the bottom). Imports the compiled module and the record setup.py writes beside it,
nothing else of gradfuse.

The compiled ops are registered with the dispatcher as ``torch.ops.gradfuse.*``. A build for
another torch than the one running is refused at import, with both versions and the command that
rebuilds it (from the extension's own build info, or from gradfuse/_build_record.py when the .so
no longer loads). Where the extension is missing or has no kernel for a device type, the
pure-PyTorch reference (``gradfuse.ops.reference``) runs instead, with one warning per device type.
"""
from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path

import torch

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "setup.py").exists() and (_CHECKOUT / "csrc").is_dir():  # running from a checkout
    REBUILD_HINT = (f"Rebuild it against the torch you run, in {_CHECKOUT}: "
                    "`pip install --no-build-isolation --no-deps -e .` "
                    "(or `python setup.py build_ext --inplace`).")
else:  # installed from an sdist, a wheel or a checkout
    REBUILD_HINT = ("Reinstall it against the torch you run: `pip install --no-build-isolation "
                    "--no-deps --force-reinstall <the gradfuse sdist or checkout>`.")


def _describe_torch(version: str, cuda: str | None, kernels: bool = False) -> str:
    none = "CPU kernels only" if kernels else "no CUDA"
    return f"torch {version} ({('CUDA ' + cuda + (' kernels' if kernels else '')) if cuda else none})"


def _refuse(built_torch: str, built_cuda: str | None) -> ImportError:
    return ImportError(
        f"gradfuse._C was built for {_describe_torch(built_torch, built_cuda, kernels=True)} but "
        f"{_describe_torch(torch.__version__, torch.version.cuda)} is running. " + REBUILD_HINT)


try:  # what setup.py recorded after the last successful build (absent in a checkout never built)
    build_record = importlib.import_module("gradfuse._build_record")
except ImportError:
    build_record = None

# The compiled module (registers torch.ops.gradfuse.* with the dispatcher), or None.
extension = None
# Why it could not be loaded, or None.
load_error: str | None = None

try:
    extension = importlib.import_module("gradfuse._C")
except ImportError as e:  # not built, or built for another torch (undefined symbols)
    if build_record is not None and build_record.TORCH_VERSION != torch.__version__:
        raise _refuse(build_record.TORCH_VERSION, build_record.CUDA_VERSION) from e
    load_error = f"gradfuse._C could not be loaded ({e}). {REBUILD_HINT}"


if extension is not None:
    _built = extension.build_info()
    if _built["torch_version"] != torch.__version__:
        # A build for another torch may load (no missing symbol) yet break its ABI: refuse it.
        raise _refuse(_built["torch_version"], _built["cuda_version"])

if extension is None and os.environ.get("GRADFUSE_REQUIRE_EXT") == "1":
    raise ImportError(load_error)


def build_info() -> dict:
    """What the extension was built against.

    Returns:
        dict: torch and CUDA versions, CUDA architectures, whether the CUDA kernels were built,
            the chunk size, and the CPU kernel build in use (``cpu_capability``), with
            ``extension_loaded: True``; when ``gradfuse._C`` could not be loaded,
            ``{"extension_loaded": False, "error": ..., "torch_version": ...}``.

    Example:
        ```python
        info = gradfuse.build_info()
        print(info["extension_loaded"], info.get("with_cuda"))
        ```
    """
    if extension is None:
        return {"extension_loaded": False, "error": load_error, "torch_version": torch.__version__}
    info = dict(extension.build_info())
    info["extension_loaded"] = True
    info["cpu_capability"] = extension.cpu_capability()
    return info


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether code built for `arch` ("9.0", "12.0+PTX") runs on a GPU of `capability`: a cubin
    runs on its major version at the same or a higher minor; PTX is compiled for any newer GPU."""
    ptx = arch.endswith("+PTX")
    major, minor = (int(x) for x in arch.removesuffix("+PTX").rstrip("af").split("."))
    if ptx and (major, minor) <= capability:
        return True
    return major == capability[0] and minor <= capability[1]


def mismatches() -> list[str]:
    """What differs between the build of gradfuse._C and what is running, each with what to do.

    Empty when the build serves every device present. (A build for another torch is refused at
    import and never gets here.)
    """
    problems = []
    if extension is None:
        problems.append(f"{load_error} Until then the pure-PyTorch reference runs on every device.")
        return problems
    info = extension.build_info()
    if not torch.cuda.is_available():
        return problems
    if not info["with_cuda"]:
        need = f"a CUDA {torch.version.cuda.split('.')[0]}.x toolkit" if torch.version.cuda else "CUDA"
        problems.append(
            "a GPU is visible but this build has no CUDA kernels, so CUDA tensors use the pure-PyTorch "
            f"reference. {REBUILD_HINT} Build where {need} is found (CUDA_HOME, or nvcc on PATH), "
            "with GRADFUSE_CUDA=1 to make a missing toolkit an error.")
        return problems
    archs = [a for a in info["cuda_archs"].replace(" ", ";").split(";") if a]
    for i in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(i)
        if archs and not any(arch_runs_on(a, capability) for a in archs):
            problems.append(
                f"GPU {i} ({torch.cuda.get_device_name(i)}, compute capability "
                f"{capability[0]}.{capability[1]}) is not among the architectures built "
                f"({info['cuda_archs']}): its kernels cannot launch. {REBUILD_HINT} Set "
                f"TORCH_CUDA_ARCH_LIST=\"{capability[0]}.{capability[1]}\" (or leave it unset on the GPU machine).")
    return problems


_warned: set[str] = set()


def _registered(name: str, key: str) -> bool:
    return (extension is not None and hasattr(torch.ops.gradfuse, name)
            and torch._C._dispatch_has_kernel_for_dispatch_key(f"gradfuse::{name}", key))


OP_NAMES = ("multi_tensor_stats", "multi_tensor_moments", "multi_tensor_scale_", "multi_tensor_unit_stats",
            "multi_tensor_unit_scale_", "multi_tensor_clamp_", "multi_tensor_exponent_histogram",
            "multi_tensor_update_stats", "multi_tensor_update_clip_", "multi_tensor_optim_step_")
# Looked up once (a plain dict keeps the hot path traceable by torch.compile): whether the
# extension has a kernel for each (op, device type). KERNELS[device type]: for the stats op,
# which every build has.
OP_KERNELS = {(name, device_type): _registered(name, key)
              for name in OP_NAMES for device_type, key in (("cpu", "CPU"), ("cuda", "CUDA"))}
KERNELS = {device_type: OP_KERNELS[("multi_tensor_stats", device_type)] for device_type in ("cpu", "cuda")}


# Device types without float64 (Apple's MPS): the statistics there are computed and returned in
# float32 (see stats_dtype).
NO_FLOAT64 = {"mps"}


def stats_dtype(device: torch.device | str) -> torch.dtype:
    """The floating dtype of the statistics rows on ``device``: float64, or float32 where the
    device has no float64 (``NO_FLOAT64``; only the pure-PyTorch reference runs there)."""
    return torch.float32 if torch.device(device).type in NO_FLOAT64 else torch.float64


def has_kernel(device_type: str) -> bool:
    """Whether gradfuse._C has compiled kernels for ``device_type`` ("cpu", "cuda")."""
    return KERNELS.get(device_type, False)


def backend(device: torch.device | str) -> str:
    """Which implementation runs on ``device``.

    Args:
        device: A ``torch.device`` or a string such as ``"cpu"`` or ``"cuda:0"``.

    Returns:
        str: ``"cpu-avx2"``, ``"cpu-default"``, ``"cuda"``, ``"meta"``, or ``"reference"``
            (pure PyTorch, when gradfuse._C has no kernel for it).

    Example:
        ```python
        print(gradfuse.backend("cpu"))    # e.g. "cpu-avx2"
        ```
    """
    device = torch.device(device)
    if device.type in ("meta",):
        return "meta"
    if not has_kernel(device.type):
        return "reference"
    if device.type == "cpu":
        return "cpu-" + extension.cpu_capability()
    return device.type


def use_compiled(device: torch.device) -> bool:
    """True when the compiled op serves ``device``; warns once per device type when it does not."""
    if device.type == "meta" or has_kernel(device.type):
        return True
    if device.type not in _warned:
        _warned.add(device.type)
        why = load_error or f"gradfuse._C has no {device.type} kernels in this build"
        warnings.warn(f"gradfuse: using the pure-PyTorch reference on {device.type}: {why}",
                      RuntimeWarning, stacklevel=3)
    return False


def op_compiled(name: str, device: torch.device) -> bool:
    """True when the compiled op ``name`` serves ``device`` (a build from before an op existed
    serves the others); warns once per device type when the extension serves none of it."""
    if device.type == "meta":
        return True
    return OP_KERNELS.get((name, device.type), False) and use_compiled(device)
