"""The update statistics and update clipping of FSDP2-sharded parameters (2 gloo ranks on CPU)
equal those of the same model unsharded. See tests/dynamics/update_sharded_workers.py."""
import dist_workers
import pytest
import torch.distributed as dist
import update_sharded_workers
from gloo_checks import assert_ranks_ok, spawn_checks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
CHECKS = ["rows", "clip"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist_workers.FSDP2_ON_CPU:
        pytest.skip(dist_workers.FSDP2_SKIP_REASON)
    return spawn_checks(update_sharded_workers.worker, 2, CHECKS, tmp_path_factory.mktemp("update_sharded"))


@pytest.mark.parametrize("name", CHECKS)
def test_sharded_equals_unsharded(results, name):
    assert_ranks_ok(results, name, 2)
