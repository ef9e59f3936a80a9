#!/usr/bin/env python3
"""Instruction budget of the stats kernel (and of the clipping, histogram, optimizer-update and
fused optimizer-step kernels, below), read from the machine code the compiler emitted.

A streaming kernel runs at min(memory bandwidth, issue rate / instructions per element). On an
H200 (4.8 TB/s, about 33.5e12 thread-instructions/s) a 2-byte element may cost at most ~14
instructions and a 4-byte element ~28 before the kernel is compute-bound; the budgets below keep
a margin under that. This script disassembles the sm_90 SASS of a build (cuobjdump, from the pip
package nvidia-cuda-cuobjdump or a CUDA toolkit), finds the steady-state loop of every
instantiation of the stats kernel (multi_tensor_kernel<StatsOp<dtype, mode>, whole-tensor table>
of csrc/cuda/stats_ops.cuh) itself, and prints instructions per element:

  a loop = a backward branch and the instructions from its target up to it. The streaming loops
  are those with 16-byte global loads that hold no other such loop. The kernel streams its chunk
  in two passes (stats_math.h): pass 1 over every element, which accumulates the sum of squares
  (an FFMA / DFMA), and pass 2, which counts NaN and Inf in the rare chunks that have them. The
  steady-state loop is the streaming loop of pass 1 (with an FMA) with the most loads per trip
  (the unrolled main loop, not the remainder), then the most instructions. Elements per trip =
  16-byte loads x 16 bytes / element size; instructions per trip = every instruction in the loop
  body, as issued.

With --resources it also prints, per kernel, registers, spills, kernel-argument bytes, resident
blocks per SM and the bytes its loads keep in flight per SM (Little's law: an H200 needs about
4.8 TB/s x ~0.8 us / 132 SMs = 29 KB in flight per SM to reach its bandwidth).

Usage:
  python scripts/sass_budget.py [BINARY] [--arch sm_90] [--resources]
BINARY is gradfuse/_C*.so of this checkout by default (or any .so / .cubin / fatbin). Exit status:
0 within budget, 1 over budget, 2 when the SASS could not be read or a kernel's loop not found.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Instructions per element allowed in the steady-state loop of the stats kernel (StatsOp<dtype,
# PowMode::kNone>) on sm_90. fp64 moves 8 bytes per element and is reported without a budget.
BUDGET = {"bf16": 8.0, "fp16": 8.0, "fp32": 10.0}
# The same for multi_tensor_moments (PowMode::kMoments: two more operations per element, x - K
# and the FMA of its square; 1.4x under the ~14 / ~28 at which the H200 would be compute-bound).
MOMENTS_BUDGET = {"bf16": 10.0, "fp16": 10.0, "fp32": 12.0}
BUDGETS = {"none": BUDGET, "moments": MOMENTS_BUDGET}
BUDGET_ARCH = "sm_90"

# Itanium-mangled template arguments of the kernels: gradfuse::cuda::multi_tensor_kernel<Op, Table>
# with Op = StatsOp<scalar_t, PowMode> / ScaleOp<scalar_t> / ClampOp<scalar_t> / HistOp<scalar_t>
# and Table = LaunchTable<capacity, per-unit?>; older builds had one kernel per op
# (stats_kernel<scalar_t, PowMode, Table>, unit_scale_kernel, clamp_kernel, hist_kernel).
_DTYPES = {"N3c108BFloat16E": ("bf16", 2), "N3c104HalfE": ("fp16", 2), "f": ("fp32", 4), "d": ("fp64", 8)}
_STATS_KERNEL = re.compile(r"(?:(?<!unit_)stats_kernel|StatsOp)I(N3c108BFloat16E|N3c104HalfE|f|d)LNS_7PowModeE(\d)E")
_MODES = {"0": "none", "1": "abs", "2": "pow", "3": "moments"}
_TABLE = re.compile(r"LaunchTableILi(\d+)E")
# A per-unit table (LaunchTable<capacity, true>): StatsOp there is the unit-statistics kernel.
_UNIT_TABLE = re.compile(r"LaunchTableILi\d+ELb1E")
_KERNEL = re.compile(r"gradfuse4cuda\d+(\w+?_kernel)I(?:NS0_\d+(\w+?Op)I)?")

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"^(?:@!?U?P\w+\s+)?BRA(?:\.\S+)?\s+(?:.*,\s*)?0x([0-9a-f]+)\s*$")
_LOAD16 = re.compile(r"^(?:@!?U?P\w+\s+)?LDG\.E\.128\b")
_FMA = re.compile(r"^(?:@!?U?P\w+\s+)?[FD]FMA\b")

# sm_90 (H100 / H200) limits, for blocks per SM.
SM90 = {"regs": 65536, "threads": 2048, "blocks": 32, "reg_unit": 256}
STATS_THREADS = 256  # kThreads of csrc/cuda/multi_tensor.cuh


@dataclasses.dataclass
class Loop:
    start: int  # index of the first instruction (the branch target)
    end: int  # index of the backward branch
    instructions: int
    loads16: int
    has_fma: bool


class NamedLoop:
    """What a loop record reads off its kernel's mangled name (``kernel``)."""

    @property
    def table(self) -> str:
        m = _TABLE.search(self.kernel)
        return m.group(1) if m else "-"


class LoadCountedLoop(NamedLoop):
    """A loop whose elements per trip are its 16-byte loads' (``loop``, ``elem_bytes``)."""

    @property
    def elements(self) -> int:
        return self.loop.loads16 * 16 // self.elem_bytes

    @property
    def per_element(self) -> float:
        return self.loop.instructions / self.elements


class TrafficLoop(NamedLoop):
    """A loop moving one 16-byte pack of each list per trip (``loads16`` unpredicated loads,
    ``stores16`` stores, ``elem_bytes``): its traffic per element, the instructions per element at
    which it stops being memory-bound on an H200, and its budget (``issued`` instructions per trip;
    ``arithmetic_floor``: the exceptions' table)."""

    @property
    def elements(self) -> int:
        return 16 // self.elem_bytes

    @property
    def lists(self) -> str:
        return f"{self.loads16}r{self.stores16}w" if self.stores16 else f"{self.loads16}r"

    @property
    def bytes_per_element(self) -> int:
        return (self.loads16 + self.stores16) * self.elem_bytes

    @property
    def per_element(self) -> float:
        return self.issued / self.elements

    @property
    def bound(self) -> float:
        """Instructions per element at which the loop stops being memory-bound on an H200."""
        return self.bytes_per_element * ISSUE_RATE / BANDWIDTH

    @property
    def budget(self) -> float:
        return max(self.bound * UPDATE_MARGIN, self.arithmetic_floor)


def innermost(found: list, loop_of=lambda x: x) -> list:
    """The entries of ``found`` whose loop (``loop_of(entry)``) holds no other entry's loop."""
    return [x for x in found if not any(loop_of(o) is not loop_of(x) and loop_of(x).start <= loop_of(o).start
                                        and loop_of(o).end <= loop_of(x).end for o in found)]


def loops_over_budget(kernels: list[TrafficLoop]) -> list[TrafficLoop]:
    """The loops above their budget."""
    return [k for k in kernels if k.per_element > k.budget]


@dataclasses.dataclass
class KernelLoop(LoadCountedLoop):
    kernel: str  # mangled name
    dtype: str
    mode: str
    elem_bytes: int
    loop: Loop


@dataclasses.dataclass
class Resources:
    registers: int
    local_bytes: int  # spills (and local arrays)
    stack_bytes: int
    param_bytes: int  # the kernel argument, copied for every launch


def find_tool(name: str) -> str:
    """The path of cuobjdump / nvdisasm: $NAME (upper case), the nvidia-cuda-* pip package, PATH, CUDA_HOME."""
    if os.environ.get(name.upper()):
        return os.environ[name.upper()]
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for cand in sorted(glob.glob(os.path.join(base, "cu*", "bin", name))):
            return cand
    found = shutil.which(name)
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    cand = os.path.join(home, "bin", name)
    if os.path.exists(cand):
        return cand
    raise FileNotFoundError(f"{name} not found: pip install nvidia-cuda-{name} (requirements-dev.txt), "
                            f"or set {name.upper()}=/path/to/{name}")


def default_binary() -> Path:
    found = sorted(ROOT.glob("gradfuse/_C*.so"))
    if not found:
        raise FileNotFoundError(f"no gradfuse/_C*.so in {ROOT}: build it first (scripts/setup.sh)")
    return found[0]


def cuobjdump(binary: os.PathLike, arch: str, what: str) -> str:
    """`cuobjdump -<what> -arch <arch> binary` ('' when it holds no code for that arch)."""
    out = subprocess.run([find_tool("cuobjdump"), f"-{what}", "-arch", arch, str(binary)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        if "does not contain" in out.stderr or "no device code" in out.stderr.lower():
            return ""
        raise RuntimeError(f"cuobjdump -{what} failed on {binary}: {out.stderr.strip()}")
    return out.stdout


def disassemble(binary: os.PathLike, arch: str = BUDGET_ARCH) -> str:
    """The SASS text of `binary` for `arch` ('' when it holds none for that arch)."""
    return cuobjdump(binary, arch, "sass")


def split_functions(sass: str) -> dict[str, list[str]]:
    """{mangled function name: its instructions in address order}."""
    functions: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            if int(m.group(1), 16) != 16 * len(current):
                raise ValueError(f"unexpected instruction address {m.group(1)} in {line!r}")
            current.append(m.group(2))
    return functions


def loops(instructions: list[str]) -> list[Loop]:
    """Every loop closed by a backward branch, as the address range [target, branch]."""
    found = []
    for i, ins in enumerate(instructions):
        m = _BRANCH.match(ins)
        if m:
            target = int(m.group(1), 16) // 16
            if target <= i:
                body = instructions[target:i + 1]
                found.append(Loop(target, i, len(body), sum(bool(_LOAD16.match(b)) for b in body),
                                  any(_FMA.match(b) for b in body)))
    return found


def steady_state_loop(instructions: list[str]) -> Loop | None:
    """The main loop of pass 1, by the rule of the module docstring; None without 16-byte loads."""
    streaming = [lp for lp in loops(instructions) if lp.loads16 > 0]
    streaming = innermost(streaming)
    return max(streaming, key=lambda lp: (lp.has_fma, lp.loads16, lp.instructions), default=None)


def stats_kernel_loops(sass: str) -> list[KernelLoop]:
    """The steady-state loop of every stats_kernel instantiation in `sass`; raises when one of them
    has no loop of 16-byte loads (then the rule above no longer describes the kernel)."""
    result = []
    for name, instructions in split_functions(sass).items():
        m = _STATS_KERNEL.search(name)
        if not m or _UNIT_TABLE.search(name):
            continue
        dtype, elem_bytes = _DTYPES[m.group(1)]
        loop = steady_state_loop(instructions)
        if loop is None:
            raise ValueError(f"no loop of 16-byte loads found in {name}")
        result.append(KernelLoop(name, dtype, _MODES[m.group(2)], elem_bytes, loop))
    order = list(v[0] for v in _DTYPES.values())
    return sorted(result, key=lambda k: (order.index(k.dtype), k.mode, int(k.table) if k.table.isdigit() else 0))


# The exponent-histogram kernel: HistOp<scalar_t> (hist_kernel<scalar_t, Table> in older builds). Its pass-1 loop adds
# one shared atomic (ATOMS) per element; pass 2 (zeros, subnormals, Inf/NaN only) adds two. The
# steady-state loop: among innermost loops of 16-byte loads, those with exactly one ATOMS per
# element, the most loads per trip, then the most instructions. Same budgets as the stats
# kernel (memory-bound on an H200 with a margin); fp64 (8 bytes per element) has none and is
# not reported.
HIST_BUDGET = {"bf16": 8.0, "fp16": 8.0, "fp32": 10.0}
_HIST_KERNEL = re.compile(r"(?:hist_kernel|HistOp)I(N3c108BFloat16E|N3c104HalfE|f|d)[NE]")
_ATOMS = re.compile(r"^(?:@!?U?P\w+\s+)?ATOMS\b")


def hist_kernel_loops(sass: str) -> list[KernelLoop]:
    """The pass-1 loop of every 2- or 4-byte histogram kernel instantiation (mode "hist"); raises
    when one has none (the rule above no longer describes the kernel)."""
    result = []
    for name, instructions in split_functions(sass).items():
        m = _HIST_KERNEL.search(name)
        if not m:
            continue
        dtype, elem_bytes = _DTYPES[m.group(1)]
        if dtype not in HIST_BUDGET:
            continue
        streaming = [lp for lp in loops(instructions) if lp.loads16 > 0]
        inner = innermost(streaming)
        pass1 = [lp for lp in inner if sum(bool(_ATOMS.match(b)) for b in instructions[lp.start:lp.end + 1])
                 == lp.loads16 * 16 // elem_bytes]
        loop = max(pass1, key=lambda lp: (lp.loads16, lp.instructions), default=None)
        if loop is None:
            raise ValueError(f"no pass-1 loop (16-byte loads, one ATOMS per element) found in {name}")
        result.append(KernelLoop(name, dtype, "hist", elem_bytes, loop))
    order = list(v[0] for v in _DTYPES.values())
    return sorted(result, key=lambda k: (order.index(k.dtype), int(k.table) if k.table.isdigit() else 0))


def hist_over_budget(kernels: list[KernelLoop]) -> list[KernelLoop]:
    return [k for k in kernels if k.dtype in HIST_BUDGET and k.per_element > HIST_BUDGET[k.dtype]]


def hist_report(kernels: list[KernelLoop], arch: str) -> str:
    lines = [f"hist_kernel pass-1 loop, {arch}",
             f"{'dtype':<6}{'table':>6}{'instr/trip':>11}{'elems/trip':>11}{'instr/elem':>11}{'budget':>8}"]
    for k in kernels:
        budget = HIST_BUDGET.get(k.dtype) if arch == BUDGET_ARCH else None
        flag = "" if budget is None else ("  ok" if k.per_element <= budget else "  OVER BUDGET")
        lines.append(f"{k.dtype:<6}{k.table:>6}{k.loop.instructions:>11}{k.elements:>11}"
                     f"{k.per_element:>11.2f}{'' if budget is None else f'{budget:g}':>8}{flag}")
    return "\n".join(lines)


def resources(binary: os.PathLike, arch: str = BUDGET_ARCH) -> dict[str, Resources]:
    """{mangled kernel name: Resources} from cuobjdump -res-usage and the ELF's parameter info."""
    usage = {}
    name = None
    for line in cuobjdump(binary, arch, "res-usage").splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)
        if m and name:
            usage[name] = (int(m.group(1)), int(m.group(3)), int(m.group(2)))
    params: dict[str, int] = {}
    name = None
    for line in cuobjdump(binary, arch, "elf").splitlines():
        if line.startswith(".nv.info."):
            name = line[len(".nv.info."):].strip()
            continue
        m = re.search(r"Offset\s*:\s*0x([0-9a-f]+)\s+Size\s*:\s*0x([0-9a-f]+)", line)
        if m and name:
            params[name] = max(params.get(name, 0), int(m.group(1), 16) + int(m.group(2), 16))
    return {k: Resources(r, loc, st, params.get(k, 0)) for k, (r, loc, st) in usage.items()}


def blocks_per_sm(registers: int, threads: int = STATS_THREADS) -> int:
    """Resident blocks per sm_90 SM, limited by registers and threads (shared memory is tiny)."""
    per_warp = -(-registers * 32 // SM90["reg_unit"]) * SM90["reg_unit"]
    by_regs = SM90["regs"] // (per_warp * (threads // 32))
    return min(by_regs, SM90["threads"] // threads, SM90["blocks"])


def budget_of(k: KernelLoop) -> float | None:
    return BUDGETS.get(k.mode, {}).get(k.dtype)


def over_budget(kernels: list[KernelLoop]) -> list[KernelLoop]:
    return [k for k in kernels if budget_of(k) is not None and k.per_element > budget_of(k)]


def report(kernels: list[KernelLoop], arch: str) -> str:
    lines = [f"stats_kernel steady-state loop, {arch}",
             f"{'dtype':<6}{'pow':<8}{'table':>6}{'instr/trip':>11}{'elems/trip':>11}{'instr/elem':>11}"
             f"{'budget':>8}"]
    for k in kernels:
        budget = budget_of(k) if arch == BUDGET_ARCH else None
        flag = "" if budget is None else ("  ok" if k.per_element <= budget else "  OVER BUDGET")
        lines.append(f"{k.dtype:<6}{k.mode:<8}{k.table:>6}{k.loop.instructions:>11}{k.elements:>11}"
                     f"{k.per_element:>11.2f}{'' if budget is None else f'{budget:g}':>8}{flag}")
    return "\n".join(lines)


def resource_report(res: dict[str, Resources], kernels: list[KernelLoop], arch: str) -> str:
    loops_by_name = {k.kernel: k for k in kernels}
    lines = [f"kernel resources, {arch} (in flight: 16-byte loads of one main-loop trip x resident threads)",
             f"{'kernel':<16}{'dtype/pow':<11}{'table':>6}{'regs':>5}{'spill B':>8}{'stack B':>8}"
             f"{'arg B':>7}{'blocks/SM':>10}{'KB in flight/SM':>16}"]
    for name in sorted(res):
        kind = _KERNEL.search(name)
        if not kind:
            continue
        kind_label = kind.group(2) or kind.group(1)
        if kind.group(2) == "StatsOp" and _UNIT_TABLE.search(name):
            kind_label = "StatsOp/unit"
        r, k = res[name], loops_by_name.get(name)
        table = _TABLE.search(name)
        label = f"{k.dtype}/{k.mode}" if k else ""
        blocks = blocks_per_sm(r.registers) if k else None
        flight = f"{blocks * STATS_THREADS * k.loop.loads16 * 16 / 1024:.0f}" if k else ""
        lines.append(f"{kind_label:<16}{label:<11}{table.group(1) if table else '-':>6}{r.registers:>5}"
                     f"{r.local_bytes:>8}{r.stack_bytes:>8}{r.param_bytes:>7}"
                     f"{blocks if blocks else '':>10}{flight:>16}")
    return "\n".join(lines)


# ---- The clipping kernels' loops: the scale (ScaleOp, on per-unit tables; unit_scale_kernel in
# older builds) and the clamp (ClampOp; clamp_kernel). The scale must stay a
# multiply and a store per element plus loop overhead; clamp_kernel reads and writes each element
# once while accumulating its statistics. Their steady-state loop is the streaming loop (16-byte
# loads AND 16-byte stores, holding no other) with the most loads per trip (the unrolled main
# loop, not the remainder); the worst of the kernel's such loops is reported (the split path,
# 256 threads per unit piece, and the packed path, a warp per unit, each have one).
# The scale moves 2 x elem_bytes per element: the compute bound is ~28 instructions per 2-byte
# element and ~56 per 4-byte one; the budget holds it to a multiply, a store and loop overhead.
# The clamp (same traffic) also accumulates sum, squares, max |x|, zero / NaN / Inf / clamped counts.
CLIP_BUDGET = {
    "unit_scale_kernel": {"bf16": 4.0, "fp16": 4.0, "fp32": 3.0, "fp64": 3.0},
    "clamp_kernel": {"bf16": 20.0, "fp16": 20.0, "fp32": 20.0},
}
_CLIP_KERNEL = re.compile(r"(unit_scale_kernel|clamp_kernel|ScaleOp|ClampOp)I(N3c108BFloat16E|N3c104HalfE|f|d)")
_CLIP_KIND = {"ScaleOp": "unit_scale_kernel", "ClampOp": "clamp_kernel"}
_STORE16 = re.compile(r"^(?:@!?U?P\w+\s+)?STG\.E\.128\b")


@dataclasses.dataclass
class ClipLoop(LoadCountedLoop):
    kernel: str  # mangled name
    kind: str  # unit_scale_kernel / clamp_kernel
    dtype: str
    elem_bytes: int
    loop: Loop


def clip_kernel_loops(sass: str) -> list[ClipLoop]:
    """The steady-state loop of every unit_scale_kernel / clamp_kernel instantiation in `sass`;
    raises when one has no loop of 16-byte loads and stores."""
    result = []
    for name, instructions in split_functions(sass).items():
        m = _CLIP_KERNEL.search(name)
        if not m:
            continue
        dtype, elem_bytes = _DTYPES[m.group(2)]
        streaming = [lp for lp in loops(instructions) if lp.loads16 > 0
                     and any(_STORE16.match(b) for b in instructions[lp.start:lp.end + 1])]
        streaming = innermost(streaming)
        if not streaming:
            raise ValueError(f"no loop of 16-byte loads and stores found in {name}")
        most = max(lp.loads16 for lp in streaming)
        worst = max((lp for lp in streaming if lp.loads16 == most), key=lambda lp: lp.instructions)
        result.append(ClipLoop(name, _CLIP_KIND.get(m.group(1), m.group(1)), dtype, elem_bytes, worst))
    order = list(v[0] for v in _DTYPES.values())
    return sorted(result, key=lambda k: (k.kind, order.index(k.dtype), int(k.table) if k.table.isdigit() else 0))


def clip_over_budget(kernels: list[ClipLoop]) -> list[ClipLoop]:
    return [k for k in kernels if k.per_element > CLIP_BUDGET[k.kind].get(k.dtype, math.inf)]


def clip_report(kernels: list[ClipLoop], arch: str) -> str:
    lines = [f"clipping kernels' steady-state loop (16-byte loads and stores), {arch}",
             f"{'kernel':<18}{'dtype':<6}{'table':>6}{'instr/trip':>11}{'elems/trip':>11}{'instr/elem':>11}"
             f"{'budget':>8}"]
    for k in kernels:
        budget = CLIP_BUDGET[k.kind].get(k.dtype) if arch == BUDGET_ARCH else None
        flag = "" if budget is None else ("  ok" if k.per_element <= budget else "  OVER BUDGET")
        lines.append(f"{k.kind:<18}{k.dtype:<6}{k.table:>6}{k.loop.instructions:>11}{k.elements:>11}"
                     f"{k.per_element:>11.2f}{'' if budget is None else f'{budget:g}':>8}{flag}")
    return "\n".join(lines)


# ---- The optimizer-update kernels (UpdateStatsOp, UpdateClipOp of csrc/cuda/update_ops.cuh, per
# dtype and rule), which stream several tensor lists at once, one loop per case of the optimizer
# state present (SGD with or without its buffer; Adam's first step, exp_avg and exp_avg_sq, and
# max_exp_avg_sq with amsgrad; the clip reads the weights and what its rule needs of the gradient
# and state). Each such loop moves one 16-byte pack of each list per trip (#pragma unroll 1), so
# its traffic per element is read off the loop: (16-byte loads + 16-byte stores) x element size
# bytes. Its budget is that traffic times the H200's instructions per byte at full bandwidth
# (33.5e12 / 4.8e12, about 7), times UPDATE_MARGIN. Checked: every innermost loop of 16-byte
# loads whose loads are all unpredicated (the fallback for unusual combinations of absent state
# predicates its loads on each list's presence and is not a steady state). Counted: the
# instructions of the loop as issued, less the slow paths of IEEE division and square root (a
# block that a forward branch skips and that calls the out-of-line routine), which run only for
# operands out of the fast path's range (denormals, overflow). The statistics' kernel streams its
# elements in two passes (update_ops.cuh): pass 1, the sums of squares, is the steady state; pass
# 2, which counts NaN and Inf (its loops test |x| against +INF) only where a thread's sums are not
# finite, is rare and not checked.
# Adam's element is torch's exact arithmetic (update_math.h: an IEEE division and an IEEE square
# root), about 46 instructions with its sums (amsgrad's NaN-propagating max about 4 more), within
# the budget wherever the optimizer's state is read. UPDATE_ARITHMETIC holds the one exception:
# Adam's first step (no state yet, the weights and gradients only: 4 bytes per 16-bit element, a
# bound of ~28) needs ~42-44 instructions per element, compute-bound by about 1.5x; it runs once
# per training run. Loops over their bound are reported as compute-bound.
ISSUE_RATE = 33.5e12  # H200 thread-instructions per second
BANDWIDTH = 4.8e12  # H200 bytes per second
UPDATE_MARGIN = 0.85
# (kind, dtype, rule, lists): instructions per element allowed where the arithmetic exceeds the traffic budget.
UPDATE_ARITHMETIC = {("update_stats", "bf16", "adam", "2r"): 48.0, ("update_stats", "fp16", "adam", "2r"): 48.0}
_UPDATE_KERNEL = re.compile(r"(UpdateStatsOp|UpdateClipOp)I(N3c108BFloat16E|N3c104HalfE|f|d)LNS_10UpdateRuleE(\d)E")
_UPDATE_KIND = {"UpdateStatsOp": "update_stats", "UpdateClipOp": "update_clip"}
_UPDATE_RULES = {"0": "sgd", "1": "adam"}
_ANY_LOAD16 = re.compile(r"^(@!?U?P\w+\s+)?LDG?\.E\.128\b")
_CALL = re.compile(r"^(?:@!?U?P\w+\s+)?CALL\b")
_NONFINITE_TEST = re.compile(r"^(?:@!?U?P\w+\s+)?[FD]SET\S*\s.*\|[^|]+\|(?:\.reuse)?,\s*\+INF\b")
_FWD_BRANCH = re.compile(r"^@!?U?P\w+\s+BRA(?:\.\S+)?\s+(?:.*,\s*)?0x([0-9a-f]+)\s*$")


@dataclasses.dataclass
class UpdateLoop(TrafficLoop):
    kernel: str  # mangled name
    kind: str  # update_stats / update_clip
    dtype: str
    rule: str  # sgd / adam
    elem_bytes: int
    loop: Loop
    loads16: int
    stores16: int
    cold: int  # slow-path instructions in the loop body, not issued in the steady state

    @property
    def issued(self) -> int:
        return self.loop.instructions - self.cold

    @property
    def arithmetic_floor(self) -> float:
        return UPDATE_ARITHMETIC.get((self.kind, self.dtype, self.rule, self.lists), 0.0)


def cold_indices(body: list[str], start: int) -> set[int]:
    """Indices into `body` (which starts at instruction index `start`) of the blocks that a
    conditional forward branch skips and that hold a CALL: the out-of-line slow paths."""
    cold = set()
    for i, ins in enumerate(body):
        m = _FWD_BRANCH.match(ins)
        if not m:
            continue
        target = int(m.group(1), 16) // 16 - start
        if i < target <= len(body) and any(_CALL.match(b) for b in body[i + 1:target]):
            cold.update(range(i + 1, target))
    return cold


def update_kernel_loops(sass: str) -> list[UpdateLoop]:
    """The steady-state loops (every case of the state present) of every optimizer-update kernel
    instantiation in `sass`; raises when one has none."""
    result = []
    for name, instructions in split_functions(sass).items():
        m = _UPDATE_KERNEL.search(name)
        if not m:
            continue
        dtype, elem_bytes = _DTYPES[m.group(2)]
        found = []
        for lp in loops(instructions):
            body = instructions[lp.start:lp.end + 1]
            loads = [b for b in body if _ANY_LOAD16.match(b)]
            if loads:
                found.append((lp, body, loads))
        inner = innermost(found, lambda entry: entry[0])
        # Unpredicated loads (not the fallback), and not the statistics' rare pass 2 (non-finite tests).
        steady = [(lp, body, loads) for lp, body, loads in inner if not any(b.startswith("@") for b in loads)
                  and not any(_NONFINITE_TEST.match(b) for b in body)]
        if not steady:
            raise ValueError(f"no loop of unpredicated 16-byte loads found in {name}")
        for lp, body, loads in steady:
            stores = sum(bool(_STORE16.match(b)) for b in body)
            result.append(UpdateLoop(name, _UPDATE_KIND[m.group(1)], dtype, _UPDATE_RULES[m.group(3)], elem_bytes,
                                     lp, len(loads), stores, len(cold_indices(body, lp.start))))
    order = list(v[0] for v in _DTYPES.values())
    return sorted(result, key=lambda k: (k.kind, order.index(k.dtype), k.rule,
                                         int(k.table) if k.table.isdigit() else 0, k.loads16))


update_over_budget = loops_over_budget


def update_report(kernels: list[UpdateLoop], arch: str) -> str:
    lines = [f"optimizer-update kernels' loops (one per case of the state read), {arch}",
             f"{'kernel':<14}{'dtype':<6}{'rule':<6}{'table':>6}{'lists':>7}{'B/elem':>7}{'instr/trip':>11}"
             f"{'cold':>6}{'elems/trip':>11}{'instr/elem':>11}{'bound':>7}{'budget':>8}"]
    for k in kernels:
        budget = k.budget if arch == BUDGET_ARCH else None
        flag = "" if budget is None else ("  OVER BUDGET" if k.per_element > budget else
                                          "  ok, compute-bound" if k.per_element > k.bound else "  ok")
        lines.append(f"{k.kind:<14}{k.dtype:<6}{k.rule:<6}{k.table:>6}{k.lists:>7}{k.bytes_per_element:>7}"
                     f"{k.loop.instructions:>11}{k.cold:>6}{k.elements:>11}{k.per_element:>11.2f}{k.bound:>7.1f}"
                     f"{'' if budget is None else f'{budget:.1f}':>8}{flag}")
    return "\n".join(lines)


# ---- The fused optimizer step (StepOp<scalar_t, rule, stats> of csrc/cuda/step_ops.cuh), which
# streams the parameters, gradients and optimizer state with one loop per case of the lists it
# reads and writes (SGD: w, g -> w; w, g -> w, buf on its first step; w, g, buf -> w, buf. Adam:
# w, g, m, v -> w, m, v, with amsgrad v_max too), each with and without a gradient scale and an
# update rescale, and without its stores where the step only gives its statistics (write=False, a
# skipped step). Each loop moves one 16-byte pack of each list per trip, so its traffic per element
# is read off the loop, as the update kernels': (unpredicated 16-byte loads + stores) x element
# size. Counted: the instructions of the longest path through one trip, from the loop's first
# instruction to its backward branch (a trip issues one arm of each branch on the step's flags),
# less the blocks that a forward branch skips to call an out-of-line routine: IEEE division's and
# square root's slow paths (denormals, overflow) and the statistics' non-finite counts, which run
# only once a thread's sums are NaN or Inf. Budget: the traffic times the H200's instructions per
# byte at full bandwidth (~7), times STEP_MARGIN; STEP_ARITHMETIC holds the exceptions.
# torch's Adam in 16 bits is a long chain of exact operations, each rounded to the dtype (two IEEE
# divisions, an IEEE square root, float16's through double, nine roundings to 16 bits): up to 87
# (bfloat16) and 96 (float16) instructions per element without the statistics and 94 and 102 with
# them, against a bound of ~98 for the 14 bytes it moves. With its stores it is within its bound
# but for float16 with the statistics (1.04x); without them (the statistics-only pass of an
# update-RMS limit, 8 or 10 bytes per element, a bound of 56 or 70) it is compute-bound by
# 1.4-1.8x. SGD's statistics-only pass in 16 bits (4 bytes per element, a bound of 28) is
# compute-bound by up to 1.3x with its flags, scale and rescale all on. float32 and float64 are
# within their budgets with a wide margin (float64's FP64 instructions issue at half rate on an
# H100 / H200, which the count does not model: within 2x of their budgets still).
STEP_MARGIN = UPDATE_MARGIN
# (dtype, rule, lists, with statistics): instructions per element allowed where the arithmetic
# exceeds the traffic budget (the worst loop measured, plus ~4%).
STEP_ARITHMETIC = {
    # Adam with its stores: within the bound (0.89x, 0.98x), the statistics' sums added: 0.96x, 1.04x
    ("bf16", "adam", "4r3w", False): 90.0, ("fp16", "adam", "4r3w", False): 99.0,
    ("bf16", "adam", "4r3w", True): 98.0, ("fp16", "adam", "4r3w", True): 106.0,
    # the statistics only: Adam 1.65x / 1.78x its bound, with amsgrad 1.37x / 1.46x; SGD 1.30x / 1.24x
    ("bf16", "adam", "4r", True): 96.0, ("fp16", "adam", "4r", True): 103.0,
    ("bf16", "adam", "5r", True): 99.0, ("fp16", "adam", "5r", True): 106.0,
    ("bf16", "sgd", "2r", True): 38.0, ("fp16", "sgd", "2r", True): 36.0,
    # SGD's momentum read (statistics only), its first step and its momentum without a buffer
    # (with statistics): 0.87-0.88x
    ("bf16", "sgd", "3r", True): 38.0, ("bf16", "sgd", "2r1w", True): 39.0, ("fp16", "sgd", "2r1w", True): 39.0,
}
_STEP_KERNEL = re.compile(r"StepOpI(N3c108BFloat16E|N3c104HalfE|f|d)LNS_10UpdateRuleE(\d)ELb([01])E")
_ANY_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA(?:\.\S+)?\s+(?:.*,\s*)?0x([0-9a-f]+)\s*$")


@dataclasses.dataclass
class StepLoop(TrafficLoop):
    kernel: str  # mangled name
    dtype: str
    rule: str  # sgd / adam
    stats: bool  # the kernel with the statistics rows
    elem_bytes: int
    loop: Loop
    loads16: int  # unpredicated
    stores16: int
    issued: int  # instructions of the longest trip, slow paths not counted

    @property
    def arithmetic_floor(self) -> float:
        return STEP_ARITHMETIC.get((self.dtype, self.rule, self.lists, self.stats), 0.0)


def trip_instructions(body: list[str], start: int) -> int:
    """The instructions of the longest path through one trip of the loop `body` (its first
    instruction at index `start`; its last, the backward branch), slow paths not counted: every
    branch inside the body goes forward, so the paths form a DAG walked in address order."""
    cold = cold_indices(body, start)
    unreached = -1
    longest = [unreached] * len(body)
    longest[0] = 0 if 0 in cold else 1
    for i, ins in enumerate(body[:-1]):
        if longest[i] == unreached:
            continue
        m = _ANY_BRANCH.match(ins)
        if m:
            target = int(m.group(2), 16) // 16 - start
            successors = ([target] if i < target < len(body) else []) + ([i + 1] if m.group(1) else [])
        elif ins.startswith(("EXIT", "RET")):
            successors = []
        else:
            successors = [i + 1]
        for j in successors:
            longest[j] = max(longest[j], longest[i] + (0 if j in cold else 1))
    return longest[-1]


def step_kernel_loops(sass: str) -> list[StepLoop]:
    """Every streaming loop (innermost, 16-byte loads) of every fused-step kernel instantiation in
    `sass`; raises when one kernel has none."""
    result = []
    for name, instructions in split_functions(sass).items():
        m = _STEP_KERNEL.search(name)
        if not m:
            continue
        dtype, elem_bytes = _DTYPES[m.group(1)]
        found = [(lp, instructions[lp.start:lp.end + 1]) for lp in loops(instructions)]
        found = [(lp, body) for lp, body in found if any(_ANY_LOAD16.match(b) for b in body)]
        inner = innermost(found, lambda entry: entry[0])
        if not inner:
            raise ValueError(f"no loop of 16-byte loads found in {name}")
        for lp, body in inner:
            loads = sum(bool(_ANY_LOAD16.match(b)) and not b.startswith("@") for b in body)
            stores = sum(bool(_STORE16.match(b)) for b in body)
            result.append(StepLoop(name, dtype, _UPDATE_RULES[m.group(2)], m.group(3) == "1", elem_bytes, lp, loads,
                                   stores, trip_instructions(body, lp.start)))
    order = list(v[0] for v in _DTYPES.values())
    return sorted(result, key=lambda k: (order.index(k.dtype), k.rule, k.stats,
                                         int(k.table) if k.table.isdigit() else 0, k.loads16, k.stores16))


step_over_budget = loops_over_budget


def step_report(kernels: list[StepLoop], arch: str) -> str:
    """One line per kernel and case of lists: its loops (scale, rescale, flags) and the worst."""
    groups: dict[tuple, list[StepLoop]] = {}
    for k in kernels:
        groups.setdefault((k.dtype, k.rule, k.stats, k.table, k.lists), []).append(k)
    lines = [f"fused optimizer step's loops (one per case of the lists read and written; the worst shown), {arch}",
             f"{'dtype':<6}{'rule':<6}{'stats':<7}{'table':>6}{'lists':>7}{'loops':>6}{'B/elem':>7}{'instr/trip':>11}"
             f"{'elems/trip':>11}{'instr/elem':>11}{'bound':>7}{'budget':>8}"]
    for (dtype, rule, stats, table, lists), group in groups.items():
        k = max(group, key=lambda g: g.per_element)
        budget = k.budget if arch == BUDGET_ARCH else None
        flag = "" if budget is None else ("  OVER BUDGET" if k.per_element > budget else
                                          f"  ok, compute-bound {k.per_element / k.bound:.2f}x"
                                          if k.per_element > k.bound else "  ok")
        lines.append(f"{dtype:<6}{rule:<6}{'yes' if stats else 'no':<7}{table:>6}{lists:>7}{len(group):>6}"
                     f"{k.bytes_per_element:>7}{k.issued:>11}{k.elements:>11}{k.per_element:>11.2f}{k.bound:>7.1f}"
                     f"{'' if budget is None else f'{budget:.1f}':>8}{flag}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", nargs="?", help="a .so / .cubin / fatbin (default: gradfuse/_C*.so)")
    ap.add_argument("--arch", default=BUDGET_ARCH, help=f"SASS architecture (default {BUDGET_ARCH}; "
                    "the budget applies to it only)")
    ap.add_argument("--resources", action="store_true", help="also print registers, spills, "
                    "argument bytes and bytes in flight per kernel")
    args = ap.parse_args(argv)
    try:
        binary = Path(args.binary) if args.binary else default_binary()
        sass = disassemble(binary, args.arch)
        kernels = stats_kernel_loops(sass)
        clip_kernels = clip_kernel_loops(sass)
        hist_kernels = hist_kernel_loops(sass)
        update_kernels = update_kernel_loops(sass)
        step_kernels = step_kernel_loops(sass)
        res = resources(binary, args.arch) if args.resources else None
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"sass_budget: {e}", file=sys.stderr)
        return 2
    if not kernels:
        print(f"sass_budget: no {args.arch} stats_kernel in {binary}", file=sys.stderr)
        return 2
    print(report(kernels, args.arch))
    if hist_kernels:
        print()
        print(hist_report(hist_kernels, args.arch))
    if res is not None:
        print()
        print(resource_report(res, kernels, args.arch))
    if clip_kernels:
        print()
        print(clip_report(clip_kernels, args.arch))
    if update_kernels:
        print()
        print(update_report(update_kernels, args.arch))
    if step_kernels:
        print()
        print(step_report(step_kernels, args.arch))
    if args.arch == BUDGET_ARCH and over_budget(kernels):
        print("over budget: " + ", ".join(sorted({k.dtype for k in over_budget(kernels)})), file=sys.stderr)
        return 1
    if args.arch == BUDGET_ARCH and clip_over_budget(clip_kernels):
        print("over budget: " + ", ".join(sorted({f"{k.kind} {k.dtype}" for k in clip_over_budget(clip_kernels)})),
              file=sys.stderr)
        return 1
    if args.arch == BUDGET_ARCH and update_over_budget(update_kernels):
        print("over budget: " + ", ".join(sorted({f"{k.kind} {k.dtype} {k.rule} {k.lists}"
                                                  for k in update_over_budget(update_kernels)})), file=sys.stderr)
        return 1
    if args.arch == BUDGET_ARCH and step_over_budget(step_kernels):
        print("over budget: " + ", ".join(sorted({f"step {k.dtype} {k.rule} {k.lists}{' stats' if k.stats else ''}"
                                                  for k in step_over_budget(step_kernels)})), file=sys.stderr)
        return 1
    if args.arch == BUDGET_ARCH and hist_over_budget(hist_kernels):
        print("hist_kernel over budget: " + ", ".join(sorted({k.dtype for k in hist_over_budget(hist_kernels)})),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
