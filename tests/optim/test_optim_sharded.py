"""gradfuse.optim's step of FSDP2-sharded parameters (2 gloo ranks on CPU) equals torch's step of the
same sharded model bit for bit. See tests/optim/optim_sharded_workers.py."""
import dist_workers
import optim_sharded_workers
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_checks import assert_ranks_ok

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
CHECKS = ["step"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist_workers.FSDP2_ON_CPU:
        pytest.skip(dist_workers.FSDP2_SKIP_REASON)
    for attempt in range(2):
        d = tmp_path_factory.mktemp("optim_sharded")
        try:
            mp.spawn(optim_sharded_workers.worker, args=(2, str(d / "init"), CHECKS, str(d)), nprocs=2, join=True)
            return d
        except mp.ProcessExitedException:
            # a rank that died in its gloo group's teardown after writing every result: they stand
            if all((d / f"{name}.{rank}").exists() for name in CHECKS for rank in range(2)):
                return d
            if attempt:
                raise


@pytest.mark.parametrize("name", CHECKS)
def test_sharded_step_is_torchs(results, name):
    assert_ranks_ok(results, name, 2)
