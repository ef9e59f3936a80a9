"""PyTorch's FSDP2 clip_grad_norm_ test run on gradfuse (2 gloo ranks on CPU), with its
CommDebugMode count of functional all-reduces; a 2-d (HSDP) mesh on 2 and 4 ranks; and the
monitor's per-step collectives. See tests/clip/fsdp2_clip_workers.py."""
import dist_workers
import fsdp2_clip_workers
import pytest
import torch.distributed as dist
from gloo_checks import assert_ranks_ok, spawn_checks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
pytest.importorskip("expecttest")  # torch.testing._internal (the test's Transformer) needs it

RUNS = {2: ["torch_1d", "hsdp", "monitor"], 4: ["hsdp"]}


@pytest.fixture(scope="module", params=sorted(RUNS))
def results(request, tmp_path_factory):
    if not dist_workers.FSDP2_ON_CPU:  # every check here runs FSDP2 on CPU
        pytest.skip(dist_workers.FSDP2_SKIP_REASON)
    world = request.param
    d = spawn_checks(fsdp2_clip_workers.worker, world, RUNS[world], tmp_path_factory.mktemp(f"fsdp2clip{world}"))
    return world, d


def _check(results, name):
    world, d = results
    if name not in RUNS[world]:
        pytest.skip(f"not run on {world} ranks")
    assert_ranks_ok(d, name, world)


def test_torch_fsdp2_clip_grad_norm_1d_unchanged_on_gradfuse(results):
    _check(results, "torch_1d")


def test_hsdp_2d_mesh_clip_grad_norm_as_torch(results):
    _check(results, "hsdp")


def test_monitor_ordinary_step_one_scalar_all_reduce(results):
    _check(results, "monitor")


def test_fsdp2_comm_benchmark_smoke():
    """benchmarks/fsdp2_comm.py on a 1-layer GPT-2 shape set: gradfuse's total norm is one
    functional all-reduce of 8 bytes, the per-parameter rows two non-functional ones."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fsdp2_comm.py"
    out = subprocess.run([sys.executable, str(script), "--layers", "1"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in out.stdout.splitlines()
            if line.startswith("| ")}
    assert rows["gradfuse.clip_grad_norm_"].endswith("| 1 | 0 | 8 |"), out.stdout
    assert rows["torch.nn.utils.clip_grad_norm_"].startswith("| torch.nn.utils.clip_grad_norm_ | 1 | 0 |")
    assert rows["gradfuse.stats (per-parameter rows)"].endswith(f"| 0 | 2 | {16 * 64} |"), out.stdout
