"""gradfuse.integrations.transformers.attach(trainer, noise_scale=True) under the Trainer's DDP
(2 CPU processes, gloo): the callback registers the bucket-norm communication hook, and the
estimate on the quadratic problem of tests/dynamics/test_noise_scale.py is within 10%."""
import json
import math
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_trainer_ddp_noise_scale_within_10_percent(tmp_path):
    import hf_ddp_workers as W
    mp.spawn(W.worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["world"] == 2 and out["ddp"] and out["batch_size"] == W.BATCH
        assert out["updates"] == W.STEPS and out["bucket_passes"] == W.STEPS and out["extra_passes"] == 0
        assert out["values"]["noise_scale"] == pytest.approx(16.0, rel=0.10)
        assert len(out["logged"]) == 3 and all(math.isfinite(v) for v in out["logged"])
