"""Distributed statistics with torch.distributed on CPU (gloo), in 2 and 4 processes started
here, against one process holding the full gradients and against torch's clip_grad_norm_."""

import dist_workers
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_checks import assert_ranks_ok

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module", params=[2, 4])
def results(request, tmp_path_factory):
    world = request.param
    d = tmp_path_factory.mktemp(f"dist{world}")
    checks = [c for c in dist_workers.CHECKS
              if dist_workers.FSDP2_ON_CPU or c not in dist_workers.NEEDS_FSDP2]
    mp.spawn(dist_workers.worker, args=(world, str(d / "init"), checks, str(d)),
             nprocs=world, join=True)
    return world, d


def _check(results, name):
    world, d = results
    if name in dist_workers.NEEDS_FSDP2 and not dist_workers.FSDP2_ON_CPU:
        pytest.skip(dist_workers.FSDP2_SKIP_REASON)
    assert_ranks_ok(d, name, world)


def test_dtensor_sharded_dim0_dim1_uneven_empty_and_nan_on_one_rank(results):
    _check(results, "dtensor")


def test_group_pipeline_stages(results):
    _check(results, "group")


def test_fsdp2_fully_shard_end_to_end(results):
    _check(results, "fsdp2")


def test_fsdp2_clip_grad_norm_as_torch(results):
    _check(results, "fsdp2_clip")


def test_2d_mesh_total_norm_placements_and_collectives(results):
    _check(results, "mesh2d")
