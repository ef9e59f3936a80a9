"""The double-clip check under DDP with 2 gloo ranks: DDP's write-back of the reduced
gradients is not reported, a user's clip_grad_norm_ after the backward is, on every rank."""
import clip_ddp_workers
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_checks import assert_ranks_ok

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("clipddp")
    mp.spawn(clip_ddp_workers.worker, args=(2, str(d / "init"), str(d)), nprocs=2, join=True)
    return d


@pytest.mark.parametrize("name", list(clip_ddp_workers.CHECKS))
def test_double_clip_under_ddp_two_ranks(results, name):
    assert_ranks_ok(results, name, 2)
