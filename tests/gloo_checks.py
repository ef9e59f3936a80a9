"""How the multi-process tests run: each rank joins a gloo group and runs named checks, writing
"ok" or its traceback to result_dir/<name>.<rank> (a check failing on one rank must not hang the
others in a collective: the group times out); the test then reads every rank's file."""
import datetime
import traceback
from pathlib import Path

import torch.distributed as dist


def run_checks(rank, world, init_file, result_dir, checks, timeout_s=60):
    """checks: (name, fn(rank, world)) pairs, run in order, a barrier after each."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for name, check in checks:
            try:
                check(rank, world)
                status = "ok"
            except Exception:
                status = traceback.format_exc()
            with open(f"{result_dir}/{name}.{rank}", "w") as f:
                f.write(status)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_checks(worker, world, checks, result_dir: Path) -> Path:
    """Runs worker(rank, world, init_file, checks, result_dir) on `world` processes; returns
    result_dir. A rank killed by a signal after every rank wrote every check's result died in the
    teardown of its gloo group (seen as SIGABRT, "terminate called without an active exception"):
    the results stand and are read as usual. A run that died earlier is made once more (in a
    sibling folder), then the error stands."""
    import torch.multiprocessing as mp
    for attempt in range(2):
        d = Path(f"{result_dir}{'-again' if attempt else ''}")
        d.mkdir(parents=True, exist_ok=True)
        try:
            mp.spawn(worker, args=(world, str(d / "init"), checks, str(d)), nprocs=world, join=True)
            return d
        except mp.ProcessExitedException:
            if all((d / f"{name}.{rank}").exists() for name in checks for rank in range(world)):
                return d
            if attempt:
                raise
    raise AssertionError("unreachable")


def assert_ranks_ok(result_dir, name, world):
    for rank in range(world):
        status = (Path(result_dir) / f"{name}.{rank}").read_text()
        assert status == "ok", f"rank {rank} of {world}:\n{status}"
