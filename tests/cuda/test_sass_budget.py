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


# ---- The optimizer-update functors (csrc/cuda/update_ops.cuh)
UPDATE_BF16_ADAM = ("_ZN8gradfuse4cuda19multi_tensor_kernelINS0_13UpdateStatsOpIN3c108BFloat16ELNS_10UpdateRuleE1EEE"
                    "NS0_11LaunchTableILi64ELb0ELi5EEEEEvT0_T_")
UPDATE_FP32_CLIP_SGD = ("_ZN8gradfuse4cuda19multi_tensor_kernelINS0_12UpdateClipOpIfLNS_10UpdateRuleE0EEE"
                        "NS0_11LaunchTableILi512ELb0ELi5EEEEEvT0_T_")


def test_update_loops_one_per_case_without_slow_paths_nor_fallback():
    # Loop 1 (4 lists, aligned): 4 loads, a division whose slow path (3 instructions, a CALL) is
    # branched around, 8 instructions more. Loop 2: the fallback, two of its loads predicated.
    # Loop 3: 2 lists. Then the slow-path routine.
    div = """
        MUFU.RCP R9, R8
        FCHK P5, R4, R8
        FFMA R10, R4, R9, RZ
        @!P5 BRA @{skip}
        MOV R2, R8
        MOV R28, 0x40
        CALL.REL.NOINC @40
        BSYNC B2"""
    body = ["LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E.128 R8, desc[UR4][R12.64]", "LDG.E.128 R16, desc[UR4][R14.64]",
            "LD.E.128 R20, desc[UR4][R24.64]"]
    body += [ln.strip() for ln in div.strip().splitlines()] + ["FFMA R30, R4, R4, R30"] * 8 + ["@P0 BRA @0"]
    body[4 + 3] = body[4 + 3].format(skip=4 + 7)
    fallback = ["LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E.128 R8, desc[UR4][R12.64]",
                "@P1 LDG.E.128 R16, desc[UR4][R14.64]", "@P2 LDG.E.128 R20, desc[UR4][R24.64]",
                "FFMA R30, R4, R4, R30", f"@P0 BRA @{len(body)}"]
    two = ["LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E.128 R8, desc[UR4][R12.64]", "FFMA R30, R4, R4, R30",
           f"@P0 BRA @{len(body) + len(fallback)}"]
    tail = ["EXIT"] + ["NOP"] * (40 - len(body) - len(fallback) - len(two) - 1) + ["RET.REL.NODEC R28 0x0"]
    sass = fake_sass(UPDATE_BF16_ADAM, "\n".join(body + fallback + two + tail))
    k4, k2 = sorted(sass_budget.update_kernel_loops(sass), key=lambda k: -k.loads16)
    assert (k4.kind, k4.dtype, k4.rule, k4.table, k4.lists) == ("update_stats", "bf16", "adam", "64", "4r")
    # 21 instructions, 3 of them the slow path; 8 bf16 elements per trip of 4 x 2 bytes each.
    assert (k4.loop.instructions, k4.cold, k4.elements, k4.bytes_per_element) == (21, 3, 8, 8)
    # With its state, Adam's statistics are held to the traffic budget; its first step (2 lists)
    # to the floor of its exact arithmetic, which is above its bound.
    assert k4.per_element == 18 / 8 and k4.bound == pytest.approx(8 * 33.5 / 4.8)
    assert k4.budget == pytest.approx(8 * 33.5 / 4.8 * sass_budget.UPDATE_MARGIN)
    assert (k2.lists, k2.cold, k2.per_element, k2.bytes_per_element) == ("2r", 0, 4 / 8, 4)
    assert k2.budget == sass_budget.UPDATE_ARITHMETIC["update_stats", "bf16", "adam", "2r"] > k2.bound
    assert not sass_budget.update_over_budget([k4, k2])
    # The rare pass 2 of the statistics (its loops test values against +INF) is not a steady state.
    pass2 = two[:2] + ["FSET.BF.GEU.AND R21, |R23|, +INF , PT", "FADD R30, R21, R30", "@P0 BRA @4", "EXIT"]
    (k,) = sass_budget.update_kernel_loops(fake_sass(UPDATE_BF16_ADAM, "\n".join(two[:-1] + ["@P0 BRA @0"] + pass2)))
    assert k.loop.instructions == 4
    with pytest.raises(ValueError, match="no loop of unpredicated 16-byte loads"):
        sass_budget.update_kernel_loops(fake_sass(UPDATE_BF16_ADAM, "\n".join(fallback[:-1] + ["@P0 BRA @0", "EXIT"])))


def test_update_clip_traffic_counts_the_store_and_over_budget_fails():
    loop = ["LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E.128 R8, desc[UR4][R12.64]"]
    loop += ["FFMA R4, R8, R9, R4"] * 60 + ["STG.E.128 desc[UR4][R2.64], R4", "@P0 BRA @0", "EXIT"]
    (k,) = sass_budget.update_kernel_loops(fake_sass(UPDATE_FP32_CLIP_SGD, "\n".join(loop)))
    assert (k.kind, k.rule, k.table, k.lists, k.bytes_per_element, k.elements) == ("update_clip", "sgd", "512", "2r1w",
                                                                                    12, 4)
    # 64 instructions per 4 elements (16) within 12 bytes x ~7 x 0.85 (71): SGD has no arithmetic floor.
    assert k.per_element == 64 / 4 and k.budget == pytest.approx(12 * 33.5 / 4.8 * 0.85)
    assert not sass_budget.update_over_budget([k])
    loop[2:62] = ["FFMA R4, R8, R9, R4"] * 300
    (k,) = sass_budget.update_kernel_loops(fake_sass(UPDATE_FP32_CLIP_SGD, "\n".join(loop)))
    assert sass_budget.update_over_budget([k]) == [k]


def test_built_update_kernels_within_instruction_budget(built_sass):
    import torch
    if not hasattr(torch.ops.gradfuse, "multi_tensor_update_stats"):
        pytest.skip("gradfuse._C built without the optimizer-update ops")
    kernels = sass_budget.update_kernel_loops(built_sass)
    report = sass_budget.update_report(kernels, "sm_90")
    print(report)
    assert {(k.kind, k.dtype, k.rule, k.table) for k in kernels} == {
        (kind, d, r, t) for kind in ("update_stats", "update_clip") for d in ("bf16", "fp16", "fp32", "fp64")
        for r in ("sgd", "adam") for t in ("64", "512")}, report
    # The cases of the state present: stats SGD reads w, g (+ buffer); Adam w, g (+ m, v (+ v_max)).
    cases = {(k.kind, k.rule, k.lists) for k in kernels}
    assert {("update_stats", "sgd", "2r"), ("update_stats", "sgd", "3r"), ("update_stats", "adam", "2r"),
            ("update_stats", "adam", "4r"), ("update_stats", "adam", "5r"), ("update_clip", "adam", "3r1w")} <= cases
    assert not sass_budget.update_over_budget(kernels), report


# ---- The fused optimizer step (csrc/cuda/step_ops.cuh)
STEP_BF16_ADAM_STATS = ("_ZN8gradfuse4cuda19multi_tensor_kernelINS0_6StepOpIN3c108BFloat16ELNS_10UpdateRuleE1ELb1EEE"
                        "NS0_11LaunchTableILi64ELb0ELi5EEEEEvT0_T_")
STEP_FP32_SGD = ("_ZN8gradfuse4cuda19multi_tensor_kernelINS0_6StepOpIfLNS_10UpdateRuleE0ELb0EEE"
                 "NS0_11LaunchTableILi512ELb0ELi5EEEEEvT0_T_")


def test_step_loop_counts_one_trip_without_its_slow_paths():
    # One trip: 4 loads; an if / else on a flag (3 or 5 instructions: the longer arm counts); a
    # division whose slow path (a CALL, 3 instructions) is branched around; 3 stores; the branch back.
    body = ["LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E.128 R8, desc[UR4][R12.64]", "LDG.E.128 R16, desc[UR4][R14.64]",
            "LDG.E.128 R20, desc[UR4][R24.64]",
            "@!P3 BRA @{else_arm}", "FFMA R4, R8, R9, R4", "FFMA R4, R8, R9, R4", "BRA @{join}",
            "FMUL R4, R8, R9", "FMUL R4, R4, R9", "FMUL R4, R4, R9", "FMUL R4, R4, R9", "FMUL R4, R4, R9",
            "BSSY B2, @{after}", "MUFU.RCP R9, R8", "FCHK P5, R4, R8", "@!P5 BRA @{fast}",
            "MOV R2, R8", "MOV R28, 0x40", "CALL.REL.NOINC @60", "FFMA R10, R4, R9, RZ", "BSYNC B2",
            "STG.E.128 desc[UR4][R2.64], R4", "STG.E.128 desc[UR4][R12.64], R8", "STG.E.128 desc[UR4][R14.64], R16",
            "@P0 BRA @0"]
    marks = {"else_arm": 8, "join": 13, "after": 21, "fast": 20}
    body = [ins.format(**marks) for ins in body]
    tail = ["EXIT"] + ["NOP"] * (60 - len(body) - 1) + ["RET.REL.NODEC R28 0x0"]
    (k,) = sass_budget.step_kernel_loops(fake_sass(STEP_BF16_ADAM_STATS, "\n".join(body + tail)))
    assert (k.dtype, k.rule, k.stats, k.table, k.lists, k.elements) == ("bf16", "adam", True, "64", "4r3w", 8)
    # 26 instructions; a trip issues the 5-instruction arm and not the 3 of the slow path, nor the
    # other arm's 3 (its FFMAs and the branch over the else arm): 26 - 3 - 3 = 20.
    assert k.loop.instructions == 26 and k.issued == 20 and k.per_element == 20 / 8
    assert k.bytes_per_element == 14 and k.bound == pytest.approx(14 * 33.5 / 4.8)
    # bf16 Adam with its statistics is held to the floor of its arithmetic, above its bound
    assert k.budget == sass_budget.STEP_ARITHMETIC["bf16", "adam", "4r3w", True] > k.bound
    assert not sass_budget.step_over_budget([k])
    with pytest.raises(ValueError, match="no loop of 16-byte loads"):
        sass_budget.step_kernel_loops(fake_sass(STEP_BF16_ADAM_STATS, "FFMA R4, R8, R9, R4\n@P0 BRA @0\nEXIT"))


def test_step_over_budget_fails_the_script(tmp_path, monkeypatch, capsys):
    loop = ["LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E.128 R8, desc[UR4][R12.64]"]
    loop += ["FFMA R4, R8, R9, R4"] * 40 + ["STG.E.128 desc[UR4][R2.64], R4", "@P0 BRA @0", "EXIT"]
    (k,) = sass_budget.step_kernel_loops(fake_sass(STEP_FP32_SGD, "\n".join(loop)))
    # 44 instructions per 4 float32 elements, 12 bytes each: within 12 x ~7 x 0.85 (71); no floor
    assert (k.rule, k.stats, k.lists, k.per_element) == ("sgd", False, "2r1w", 44 / 4)
    assert k.budget == pytest.approx(12 * 33.5 / 4.8 * sass_budget.STEP_MARGIN)
    assert not sass_budget.step_over_budget([k])
    loop[2:42] = ["FFMA R4, R8, R9, R4"] * 300
    sass = fake_sass(STEP_FP32_SGD, "\n".join(loop))
    (k,) = sass_budget.step_kernel_loops(sass)
    assert sass_budget.step_over_budget([k]) == [k]
    assert "OVER BUDGET" in sass_budget.step_report([k], "sm_90")
    # the script, on a binary holding a stats kernel within budget and this step kernel
    stats_ok = fake_sass(BF16_NONE, "LDG.E.128 R4, desc[UR4][R2.64]\nFFMA R8, R4, R4, R8\n@P0 BRA @0\nEXIT")
    monkeypatch.setattr(sass_budget, "disassemble", lambda binary, arch: stats_ok + sass)
    assert sass_budget.main([str(tmp_path / "fake.so")]) == 1
    assert "step fp32 sgd 2r1w" in capsys.readouterr().err


def test_built_step_kernels_within_instruction_budget(built_sass):
    import torch
    if not hasattr(torch.ops.gradfuse, "multi_tensor_optim_step_"):
        pytest.skip("gradfuse._C built without the fused optimizer step")
    kernels = sass_budget.step_kernel_loops(built_sass)
    report = sass_budget.step_report(kernels, "sm_90")
    print(report)
    assert {(k.dtype, k.rule, k.stats, k.table) for k in kernels} == {
        (d, r, s, t) for d in ("bf16", "fp16", "fp32", "fp64") for r in ("sgd", "adam") for s in (False, True)
        for t in ("64", "512")}, report
    # Every case of the lists read and written has its loop: SGD w, g -> w; w, g -> w, buf (first
    # step); w, g, buf -> w, buf; Adam w, g, m, v -> w, m, v; and v_max; without the stores where
    # only the statistics are taken.
    cases = {(k.dtype, k.rule, k.stats, k.lists) for k in kernels}
    for d in ("bf16", "fp16", "fp32", "fp64"):
        for stats in (False, True):
            assert {(d, "sgd", stats, "2r1w"), (d, "sgd", stats, "2r2w"), (d, "sgd", stats, "3r2w"),
                    (d, "adam", stats, "4r3w"), (d, "adam", stats, "5r4w")} <= cases, report
        assert {(d, "sgd", True, "2r"), (d, "sgd", True, "3r"), (d, "adam", True, "4r"), (d, "adam", True, "5r")
                } <= cases, report
    assert not sass_budget.step_over_budget(kernels), report
