"""gradfuse.attach on a DeepSpeed engine, ZeRO stages 0-3 in float32 and bfloat16,
on 2 gloo processes on the CPU (one process pair for the whole module, several checks per run):
the rows equal those of the full averaged gradient (safe_get_full_grad, plain DDP), one
collective per step, the clip equals DeepSpeed's own, a skipped step is DeepSpeed's overflow
skip, the checkpoint carries the monitor's state, unsupported options refuse; and, in this
process, the configurations that refuse."""
import importlib.util
import json
import socket
import types

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_checks import assert_ranks_ok

# Not imported here: DeepSpeed sets itself up on import (its accelerator, its logger); only the
# spawned processes import it.
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs deepspeed (requirements-deepspeed.txt)", allow_module_level=True)

import deepspeed_workers as W  # noqa: E402

from gradfuse.integrations import deepspeed as gds  # noqa: E402

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepspeed")
    mp.spawn(W.worker, args=(2, str(d / "init"), str(d), free_port()), nprocs=2, join=True)
    return d


@needs_gloo
@pytest.mark.parametrize("name", ["init", *W.CHECKS])
def test_deepspeed_two_ranks(results, name):
    assert_ranks_ok(results, name, 2)


@needs_gloo
@pytest.mark.parametrize("tag", ["stage0_fp32", "stage3_fp32", "stage2_bf16"])
def test_records_written_by_rank_zero(results, tag):
    totals = json.loads((results / f"{tag}.totals.json").read_text())
    records = [json.loads(line) for line in (results / f"{tag}.jsonl").read_text().splitlines()]
    # every=1: one record per optimizer step (the skipped one and the one after it too), from rank 0 only
    assert [r["step"] for r in records] == list(range(W.STEPS + 2))
    assert [r["total_norm"] for r in records[:W.STEPS]] == pytest.approx(totals, rel=1e-6)
    assert records[0]["params"]["0.weight"]["numel"] == 91
    assert records[W.STEPS]["anomalies"] == ["explode"] and records[W.STEPS]["counters"]["skipped_steps"] == 1


def fake_engine(stage=2, offload_optimizer="none", offload_param="none", fp16=False, **attrs):
    """Stands for a DeepSpeedEngine's configuration readers (refusals need no process group)."""
    setting = types.SimpleNamespace
    engine = types.SimpleNamespace(
        zero_optimization_stage=lambda: stage, fp16_enabled=lambda: fp16,
        zero_offload_optimizer=lambda: setting(device=setting(value=offload_optimizer)),
        zero_offload_param=lambda: setting(device=setting(value=offload_param)),
        optimizer=types.SimpleNamespace(), mpu=None, has_moe_layers=False)
    for k, v in attrs.items():
        setattr(engine, k, v)
    return engine


@pytest.mark.parametrize("kwargs, words", [
    ({}, None),
    ({"offload_optimizer": "cpu"}, "zero_optimization.offload_optimizer (device=cpu)"),
    ({"offload_optimizer": "nvme"}, "zero_optimization.offload_optimizer (device=nvme)"),
    ({"stage": 3, "offload_param": "nvme"}, "zero_optimization.offload_param (device=nvme)"),
    ({"fp16": True}, "fp16 (DeepSpeed's loss scaler)"),
    ({"has_moe_layers": True}, "MoE layers"),
    ({"mpu": object()}, "model parallelism (mpu=)"),
])
def test_unsupported_settings_are_named(kwargs, words):
    found = gds.unsupported_setting(fake_engine(**kwargs))
    assert (found is None) if words is None else (words in found), found


def test_the_pipeline_engine_is_refused():
    class DeepSpeedEngine:  # noqa: D401 - stands for deepspeed.runtime.engine.DeepSpeedEngine
        pass

    class PipelineEngine(DeepSpeedEngine):
        pass

    DeepSpeedEngine.__module__ = PipelineEngine.__module__ = "deepspeed.runtime.pipe.engine"
    engine = PipelineEngine()
    engine.__dict__.update(vars(fake_engine()))
    assert gds.is_deepspeed_engine(engine)
    assert "the pipeline engine" in gds.unsupported_setting(engine)


@pytest.mark.parametrize("version", ["0.18.9", "0.20.0", "1.0.0"])
def test_versions_outside_the_tested_range_are_refused(version):
    with pytest.raises(RuntimeError, match=f"DeepSpeed {version} is outside"):
        gds.check_version(version)


@pytest.mark.parametrize("version", ["0.19.0", "0.19.8", "0.19.10+abc"])
def test_versions_in_the_tested_range_pass(version):
    gds.check_version(version)
