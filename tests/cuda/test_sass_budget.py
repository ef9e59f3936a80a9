"""The instruction budget of the stats kernel, read from the sm_90 SASS of this build
(scripts/sass_budget.py), so that a change cannot silently make the kernel compute-bound again.
Runs wherever the extension was built with CUDA kernels for sm_90 (CI builds them on a machine
without a GPU); the loop finder itself is checked on hand-written SASS everywhere."""
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from gradfuse.ops import library

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sass_budget", ROOT / "scripts" / "sass_budget.py")
sass_budget = sys.modules["sass_budget"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_budget)

BF16_NONE = "_ZN8gradfuse4cuda12stats_kernelIN3c108BFloat16ELNS_7PowModeE0EEEvNS0_11LaunchTableEfPfPl"
FP32_ABS = "_ZN8gradfuse4cuda12stats_kernelIfLNS_7PowModeE1EEEvNS0_11LaunchTableEfPfPl"


@pytest.fixture(scope="module")
def built_sass():
    """The sm_90 SASS of this build's gradfuse._C, disassembled once for the module's tests."""
    if not library.has_kernel("cuda"):
        pytest.skip("gradfuse._C built without CUDA kernels")
    if "9.0" not in library.build_info()["cuda_archs"].replace("+PTX", "").split(";"):
        pytest.skip("the budget is defined for sm_90, which this build does not include")
    return sass_budget.disassemble(library.extension.__file__, "sm_90")


def fake_sass(name, body):
    """Cuobjdump -sass text of one function: each line of `body` one instruction, addresses
    counted from 0; 'BRA @n' becomes a branch to instruction n."""
    lines = [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"']
    for i, ins in enumerate(textwrap.dedent(body).strip().splitlines()):
        if "BRA @" in ins:
            head, target = ins.rsplit("@", 1)
            ins = f"{head}0x{int(target) * 16:x}"
        lines.append(f"        /*{i * 16:04x}*/                   {ins.strip()} ;   /* 0x000fe20000000a00 */")
        lines.append("                                                          /* 0x000fe20000000a00 */")
    return "\n".join(lines) + "\n"


def test_finds_pass_one_main_loop_not_remainder_nor_rare_pass():
    sass = fake_sass(BF16_NONE, """
        S2R R0, SR_TID.X
        LDG.E.128 R4, desc[UR4][R2.64]
        FFMA R8, R4, R4, R8
        @P0 BRA @1
        LDG.E.128 R4, desc[UR4][R2.64]
        LDG.E.128 R12, desc[UR4][R2.64+0x1000]
        FADD R9, R4, R9
        FFMA R8, R4, R4, R8
        FFMA R8, R12, R12, R8
        IADD3 R2, R2, 0x2000, RZ
        @P1 BRA @4
        LDG.E.128 R4, desc[UR4][R2.64]
        LDG.E.128 R12, desc[UR4][R2.64+0x1000]
        FSETP.NAN.AND P2, PT, R4, R4, PT
        FSETP.NAN.AND P3, PT, R12, R12, PT
        FADD R20, R20, 1
        FADD R20, R20, 1
        FADD R20, R20, 1
        FADD R20, R20, 1
        @P1 BRA @11
        EXIT
    """)
    (k,) = sass_budget.stats_kernel_loops(sass)
    assert (k.dtype, k.mode, k.elem_bytes) == ("bf16", "none", 2)
    # The FFMA loop with two loads (instructions 4..10), not the remainder (one load) nor pass 2.
    assert (k.loop.start, k.loop.end, k.loop.instructions, k.loop.loads16) == (4, 10, 7, 2)
    assert k.elements == 16 and k.per_element == 7 / 16


def test_over_budget_is_reported_and_fails_the_script(tmp_path, monkeypatch, capsys):
    body = "LDG.E.128 R4, desc[UR4][R2.64]\n" + "FFMA R8, R4, R4, R8\n" * 40 + "@P0 BRA @0\nEXIT"
    long_body = "LDG.E.128 R4, desc[UR4][R2.64]\n" + "FFMA R8, R4, R4, R8\n" * 50 + "@P0 BRA @0\nEXIT"
    sass = (fake_sass(FP32_ABS, body) + fake_sass(FP32_ABS.replace("E1EE", "E0EE"), body)
            + fake_sass(FP32_ABS.replace("E1EE", "E3EE"), body)
            + fake_sass(FP32_ABS.replace("E1EE", "E3EE").replace("PfPl", "PfPd"), long_body))
    kernels = sass_budget.stats_kernel_loops(sass)
    assert [(k.mode, k.per_element) for k in kernels] == [
        ("abs", 42 / 4), ("moments", 42 / 4), ("moments", 52 / 4), ("none", 42 / 4)]
    # Budgets hold for PowMode::kNone (10 for fp32: 10.5 is over) and kMoments (12: 13 is over).
    assert [(k.mode, k.per_element) for k in sass_budget.over_budget(kernels)] == [
        ("moments", 52 / 4), ("none", 42 / 4)]
    monkeypatch.setattr(sass_budget, "disassemble", lambda binary, arch: sass)
    assert sass_budget.main([str(tmp_path / "any.so")]) == 1
    assert "OVER BUDGET" in capsys.readouterr().out


def test_a_stats_kernel_without_streaming_loop_is_an_error():
    sass = fake_sass(BF16_NONE, "FADD R1, R1, R2\n@P0 BRA @0\nEXIT")
    with pytest.raises(ValueError, match="no loop of 16-byte loads"):
        sass_budget.stats_kernel_loops(sass)


def test_built_stats_kernels_within_instruction_budget(built_sass):
    kernels = sass_budget.stats_kernel_loops(built_sass)
    report = sass_budget.report(kernels, "sm_90")
    print(report)
    found = sorted((k.dtype, k.mode, k.table) for k in kernels)
    assert found == sorted((d, m, t) for d in ("bf16", "fp16", "fp32", "fp64")
                           for m in ("none", "abs", "pow", "moments")
                           for t in ("64", "1280")), "one instantiation per dtype, norm mode and table size"
    assert not sass_budget.over_budget(kernels), report


# ---- The clipping functors (per-unit stats, scale, clamp; csrc/cuda/stats_ops.cuh, clip_ops.cuh)
SCALE_FP32 = "_ZN8gradfuse4cuda17unit_scale_kernelIfNS0_15UnitLaunchTableILi64EEEEvT0_PKfb"


def test_clip_loop_is_the_unrolled_load_store_loop():
    sass = fake_sass(SCALE_FP32, """
        S2R R0, SR_TID.X
        LDG.E.128 R4, desc[UR4][R2.64]
        LDG.E.128 R8, desc[UR4][R2.64+0x1000]
        FMUL R4, R4, R20
        FMUL R8, R8, R20
        STG.E.128 desc[UR4][R2.64], R4
        STG.E.128 desc[UR4][R2.64+0x1000], R8
        IADD3 R2, R2, 0x2000, RZ
        @P0 BRA @1
        LDG.E.128 R4, desc[UR4][R2.64]
        FMUL R4, R4, R20
        STG.E.128 desc[UR4][R2.64], R4
        @P1 BRA @9
        LDG.E.128 R4, desc[UR4][R2.64]
        FADD R9, R4, R9
        @P1 BRA @13
        EXIT
    """)
    (k,) = sass_budget.clip_kernel_loops(sass)
    assert (k.kind, k.dtype, k.table) == ("unit_scale_kernel", "fp32", "64")
    assert (k.loop.start, k.loop.end, k.loop.loads16, k.elements, k.per_element) == (1, 8, 2, 8, 1.0)
    assert not sass_budget.clip_over_budget([k])
    with pytest.raises(ValueError, match="no loop of 16-byte loads and stores"):
        sass_budget.clip_kernel_loops(fake_sass(SCALE_FP32, "LDG.E.128 R4, desc[UR4][R2.64]\n@P0 BRA @0\nEXIT"))


def test_built_clip_kernels_within_instruction_budget(built_sass):
    kernels = sass_budget.clip_kernel_loops(built_sass)
    report = sass_budget.clip_report(kernels, "sm_90")
    print(report)
    found = sorted((k.kind, k.dtype, k.table) for k in kernels)
    assert found == sorted((kind, d, t) for kind in ("unit_scale_kernel", "clamp_kernel")
                           for d in ("bf16", "fp16", "fp32", "fp64") for t in ("64", "512")), report
    assert not sass_budget.clip_over_budget(kernels), report
    scale = {k.dtype: k.per_element for k in kernels if k.kind == "unit_scale_kernel"}
    assert scale["fp32"] <= 2.0 and scale["bf16"] <= 4.0, report  # a multiply and a store per element


# ---- The exponent histogram functor (csrc/cuda/hist_ops.cuh)
HIST_BF16 = "_ZN8gradfuse4cuda11hist_kernelIN3c108BFloat16ENS0_11LaunchTableILi64EEEEEvT0_Pl"


def test_hist_finds_pass_one_loop_not_pass_two():
    # pass 1: 1 load (8 bf16) and 8 ATOMS; pass 2: 1 load and 16 ATOMS (2 per element).
    pass1 = "LDG.E.128 R4, desc[UR4][R2.64]\n" + "SHF.R.U32.HI R8, RZ, 0x7, R4\nATOMS.ADD RZ, [R8], R9\n" * 8
    pass2 = "LDG.E.128 R4, desc[UR4][R2.64]\n" + "ATOMS.ADD RZ, [R8], R9\n" * 16
    sass = fake_sass(HIST_BF16, pass1 + "@P0 BRA @0\n" + pass2 + "@P1 BRA @18\nEXIT")
    (k,) = sass_budget.hist_kernel_loops(sass)
    assert (k.dtype, k.mode, k.loop.start, k.loop.instructions, k.elements) == ("bf16", "hist", 0, 18, 8)
    assert k.per_element == 18 / 8 and not sass_budget.hist_over_budget([k])
    with pytest.raises(ValueError, match="no pass-1 loop"):
        sass_budget.hist_kernel_loops(fake_sass(HIST_BF16, pass2 + "@P1 BRA @0\nEXIT"))


def test_built_hist_kernels_within_instruction_budget(built_sass):
    kernels = sass_budget.hist_kernel_loops(built_sass)
    report = sass_budget.hist_report(kernels, "sm_90")
    print(report)
    assert sorted((k.dtype, k.table) for k in kernels) == sorted(
        (d, t) for d in ("bf16", "fp16", "fp32") for t in ("64", "1280"))
    assert not sass_budget.hist_over_budget(kernels), report
