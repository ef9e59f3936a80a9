"""Sinks under torch.distributed (2 gloo processes): rank 0 writes by default, every rank with
GradMonitor(sink_ranks="all") (records with a ``rank`` key, Prometheus metrics with a ``rank``
label), one chosen rank with sink_ranks=1."""
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("prometheus_client")
import sink_rank_workers  # noqa: E402
from gloo_checks import assert_ranks_ok  # noqa: E402

from gradfuse import GradMonitor  # noqa: E402
from gradfuse.sinks import read_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    d = tmp_path_factory.mktemp("ranks")
    mp.spawn(sink_rank_workers.worker, args=(2, str(d / "init"), str(d)), nprocs=2, join=True)
    return d


def test_rank_zero_writes_by_default(ranks_dir):
    assert_ranks_ok(ranks_dir, "default", 2)
    recs = read_jsonl(ranks_dir / "default.rank0.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2] and all("rank" not in r for r in recs)
    assert read_jsonl(ranks_dir / "default.rank1.jsonl") == []          # opened, never written
    assert b"gradfuse_total_norm " in (ranks_dir / "default.rank0.prom").read_bytes()
    rank1 = (ranks_dir / "default.rank1.prom").read_text()
    assert "gradfuse_steps_total 0.0" in rank1 and "gradfuse_clipped_steps_total 0.0" in rank1


def test_every_rank_writes_with_sink_ranks_all(ranks_dir):
    assert_ranks_ok(ranks_dir, "all", 2)
    for rank in (0, 1):
        recs = read_jsonl(ranks_dir / f"all.rank{rank}.jsonl")
        assert [r["step"] for r in recs] == [0, 1, 2] and {r["rank"] for r in recs} == {rank}
        prom = (ranks_dir / f"all.rank{rank}.prom").read_text()
        assert f'gradfuse_total_norm{{rank="{rank}"}}' in prom
        assert f'gradfuse_layer_l2{{layer="0",rank="{rank}"}}' in prom
        assert f'gradfuse_steps_total{{rank="{rank}"}} 3.0' in prom


def test_one_chosen_rank(ranks_dir):
    assert_ranks_ok(ranks_dir, "rank1", 2)
    assert read_jsonl(ranks_dir / "rank1.rank0.jsonl") == []
    recs = read_jsonl(ranks_dir / "rank1.rank1.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2] and all("rank" not in r for r in recs)


def test_without_a_process_group_every_record_is_written_without_rank():
    import torch
    from torch import nn
    got = []

    class Keep:
        def write(self, r):
            got.append(r)

    model = nn.Linear(2, 2)
    mon = GradMonitor(model, every=1, sinks=[Keep()], sink_ranks="all")
    model(torch.ones(1, 2)).sum().backward()
    mon.step()
    assert len(got) == 1 and "rank" not in got[0]
    with pytest.raises(ValueError, match="sink_ranks"):
        GradMonitor(model, sink_ranks="some")
