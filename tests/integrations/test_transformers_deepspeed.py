"""The Hugging Face Trainer under DeepSpeed ZeRO 1, 2 and 3 with gradfuse.integrations.transformers.attach,
on 2 gloo processes on the CPU (one process pair for the module): gradfuse's records reach the
Trainer's logs and the sinks, its total norm is the Trainer's grad_norm, and its clip trains as
DeepSpeed's own clip does (the same losses)."""
import importlib.util
import json
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

# Not imported here: DeepSpeed sets itself up on import (its accelerator, its logger); only the
# spawned processes import it.
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs deepspeed (requirements-deepspeed.txt)", allow_module_level=True)
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers_deepspeed_workers as W  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer_deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(W.worker, args=(2, port, str(d), W.STAGES), nprocs=2, join=True)
    return d, [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)]


stages = pytest.mark.parametrize("stage", W.STAGES)


@stages
def test_gradfuse_records_reach_the_trainers_logs(results, stage):
    _d, outs = results
    for out in (o[str(stage)] for o in outs):
        log = out["gradfuse"]["log"]
        assert [h["step"] for h in log] == list(range(1, W.STEPS + 1))
        for h in log:
            # The Trainer's grad_norm is gradfuse's total norm (before its clip), and every update clipped.
            assert h["grad_norm"] == pytest.approx(h["grad/total_norm"], rel=1e-6)
            assert h["grad/total_norm"] > W.MAX_GRAD_NORM and h["grad/clipped"] == 1
            assert h["grad/clip_coef"] == pytest.approx(W.MAX_GRAD_NORM / h["grad/total_norm"], rel=1e-5)
            assert h["grad_l2/transformer.h.0"] > 0 and "grad_nonfinite/transformer.ln_f" in h
        counters = out["gradfuse"]["counters"]
        assert counters["steps"] == W.STEPS + 1 and counters["clipped_steps"] == W.STEPS
        # After train(), DeepSpeed's own clip is back (the Trainer's max_grad_norm).
        assert out["gradfuse"]["engine_clip_after"] == W.MAX_GRAD_NORM
        assert out["gradfuse"]["optimizer_clip_after"] == W.MAX_GRAD_NORM


@stages
def test_clip_and_norm_equal_deepspeeds_own(results, stage):
    _d, outs = results
    for out in (o[str(stage)] for o in outs):
        ours, theirs = out["gradfuse"]["log"], out["deepspeed"]["log"]
        assert [h["grad_norm"] for h in ours] == pytest.approx([h["grad_norm"] for h in theirs], rel=1e-5)
        assert [h["loss"] for h in ours] == pytest.approx([h["loss"] for h in theirs], rel=1e-5)
        assert abs(ours[-1]["loss"] - ours[0]["loss"]) > 1e-2  # the weights moved


@stages
def test_records_written_on_rank_zero(results, stage):
    d, outs = results
    records = [json.loads(line) for line in (d / f"stage{stage}_run0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, W.STEPS + 1))
    logged = [h["grad/total_norm"] for h in outs[0][str(stage)]["gradfuse"]["log"]]
    assert [r["total_norm"] for r in records] == pytest.approx(logged)
    assert records[0]["params"]["transformer.h.0.mlp.c_fc.weight"]["numel"] == 32 * 128
    assert (d / f"stage{stage}_run1.jsonl").read_text() == ""
