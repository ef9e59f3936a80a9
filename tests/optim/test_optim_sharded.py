"""gradfuse.optim's step of FSDP2-sharded parameters (2 gloo ranks on CPU) equals torch's step of the
same sharded model bit for bit; its update-statistics rows and its update clipping are those of the
same model unsharded. See tests/optim/optim_sharded_workers.py."""
import dist_workers
import optim_sharded_workers
import pytest
import torch.distributed as dist
from gloo_checks import assert_ranks_ok, spawn_checks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
CHECKS = ["step", "rows", "max_update_rms"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist_workers.FSDP2_ON_CPU:
        pytest.skip(dist_workers.FSDP2_SKIP_REASON)
    return spawn_checks(optim_sharded_workers.worker, 2, CHECKS, tmp_path_factory.mktemp("optim_sharded"))


@pytest.mark.parametrize("name", CHECKS)
def test_sharded_step(results, name):
    assert_ranks_ok(results, name, 2)
