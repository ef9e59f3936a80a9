"""PyTorch's FSDP2 clip_grad_norm_ test run on gradfuse (2 gloo ranks on CPU), with its
CommDebugMode count of functional all-reduces; a 2-d (HSDP) mesh on 2 and 4 ranks; and the
monitor's per-step collectives. See tests/fsdp2_clip_workers.py."""
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import fsdp2_clip_workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
pytest.importorskip("expecttest")  # torch.testing._internal (the test's Transformer) needs it

RUNS = {2: ["torch_1d", "hsdp", "monitor"], 4: ["hsdp"]}


@pytest.fixture(scope="module", params=sorted(RUNS))
def results(request, tmp_path_factory):
    world = request.param
    d = tmp_path_factory.mktemp(f"fsdp2clip{world}")
    mp.spawn(fsdp2_clip_workers.worker, args=(world, str(d / "init"), RUNS[world], str(d)),
             nprocs=world, join=True)
    return world, d


def _check(results, name):
    world, d = results
    if name not in RUNS[world]:
        pytest.skip(f"not run on {world} ranks")
    for rank in range(world):
        status = (d / f"{name}.{rank}").read_text()
        assert status == "ok", f"rank {rank} of {world}:\n{status}"


def test_torch_fsdp2_clip_grad_norm_1d_unchanged_on_gradfuse(results):
    _check(results, "torch_1d")


def test_hsdp_2d_mesh_clip_grad_norm_as_torch(results):
    _check(results, "hsdp")


def test_monitor_ordinary_step_one_scalar_all_reduce(results):
    _check(results, "monitor")
