"""gradfuse.integrations.torchtitan on torchtitan's own Trainer and llama3 debug model, on 2 gloo
processes on the CPU (torchtitan_workers.py, one process pair per layout: FSDP2, tensor
parallel, pipeline parallel): per step the rows equal the full gradients' norms (a float64
``full_tensor()`` per parameter, the reference), the total norm torchtitan's own within its
float32 rounding, one collective for the statistics (and one for a logged step's histograms),
the gradients clipped as torchtitan's clip would, a NaN planted on one rank skipped on both (the
optimizers not stepped; by default decided on the device, nothing read on the host), the
records in the sink (their exponent histograms counting every
element once); a run resumed from torchtitan's checkpoint continuing the monitor's numbering
and counters; and the versions outside the tested range refused."""
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gradfuse.integrations import torchtitan as gtt

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / ".venv" / "torchtitan"  # requirements-torchtitan.txt, installed by scripts/setup.sh test
HERE = Path(__file__).resolve().parent
STEPS, NAN_AT, PARAMS = 4, 2, 45  # the debug model's parameters

needs_torchtitan = pytest.mark.skipif(not (SITE / "torchtitan").is_dir(),
                                      reason="needs .venv/torchtitan (bash scripts/setup.sh test)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(layout: str, out: Path):
    """Two ranks of torchtitan_workers.py: their results and rank 0's records."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), str(HERE), str(ROOT)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(HERE / "torchtitan_workers.py"), layout, str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((out / f"{layout}.rank{r}.json").read_text()) for r in range(2)]
    return ranks, [json.loads(line) for line in (out / f"{layout}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=["fsdp", "tp", "pp"])
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return request.param, *launch(request.param, out), out


@needs_torchtitan
def test_rows_total_norm_and_clip_are_those_of_the_full_gradients(run):
    layout, ranks, _, _ = run
    for rank, r in enumerate(ranks):
        assert len(r["names"]) == PARAMS and not any("_checkpoint_wrapped_module" in n for n in r["names"])
        # a pipeline stage holds some of the parameters, each rank all of them otherwise
        assert (len(r["local"]) < PARAMS) == (layout == "pp"), len(r["local"])
        assert len(r["steps"]) == STEPS
        for step, s in enumerate(r["steps"]):
            # the rows in one all-gather, the logged step's histograms in another
            assert s["collectives"] == 2, (layout, rank, step, s["collectives"])
            if step == NAN_AT:
                continue
            assert math.isclose(s["ours"], s["theirs"], rel_tol=2e-4), (layout, rank, step, s)
            assert s["ours"] > 0.5 and s["scaled_like_theirs"], (layout, rank, step, s)  # it clipped, as theirs
            for name, norm in s["full"].items():
                assert math.isclose(s["rows"][name], norm, rel_tol=1e-6), (layout, rank, step, name)
            assert set(s["full"]) == set(r["local"]) and len(s["rows"]) == PARAMS


@needs_torchtitan
def test_a_nan_on_one_rank_is_skipped_on_both(run):
    layout, ranks, records, _ = run
    for r in ranks:
        assert [s["skip"] for s in r["steps"]] == [step == NAN_AT for step in range(STEPS)], layout
        assert r["stepped"] == [step + 1 for step in range(STEPS) if step != NAN_AT]  # no optimizer step there
        assert r["blocking"] and all(s["host_reads"] > 0 for s in r["steps"])  # blocking=True: decided on the host
        assert r["counters"]["skipped_steps"] == 1 and r["counters"]["clipped_steps"] == STEPS - 1
        assert r["refused"] and "clip_value= is not available" in r["refused"]
        # the flight recorder's ring: each step's total norm
        ours = [s["ours"] for s in r["steps"]]
        assert len(r["recorded_norms"]) == STEPS and all(
            math.isclose(a, b, rel_tol=1e-6) or (math.isnan(a) and math.isnan(b))
            for a, b in zip(r["recorded_norms"], ours)), (r["recorded_norms"], ours)
    assert [rec["step"] for rec in records] == list(range(STEPS))
    assert all(len(rec["params"]) == PARAMS and rec["layers"] for rec in records)
    assert records[NAN_AT]["skipped"] and "nonfinite" in records[NAN_AT]["anomalies"]


@needs_torchtitan
def test_histograms_count_every_element_once(run):
    """Each layer's exponent histogram holds each of its elements once over the ranks: shards
    summed, tensor-parallel copies counted once, every pipeline stage's layers there."""
    layout, ranks, records, _ = run
    numel = {**ranks[0]["numel"], **ranks[1]["numel"]}
    assert len(numel) == PARAMS
    for rec in records:
        for layer, entry in rec["exponents"].items():
            want = sum(n for name, n in numel.items() if name == layer or name.startswith(layer + "."))
            assert sum(entry["counts"]) == want, (layout, rec["step"], layer)
        assert set(rec["exponents"]) == set(rec["layers"]), layout


@needs_torchtitan
def test_the_skip_decided_on_the_device_reads_nothing_on_the_host(tmp_path):
    """By default (torchtitan's fused AdamW takes found_inf) the monitor decides on the device:
    gradfuse reads nothing on the host in any step, the NaN step leaves the weights as they were
    on both ranks, and its report, counters and record come a step later, as with blocking=True."""
    ranks, records = launch("device", tmp_path)
    for rank, r in enumerate(ranks):
        assert r["blocking"] is False
        assert [s["host_reads"] for s in r["steps"]] == [0] * STEPS, (rank, r["steps"])
        assert [s["skip"] for s in r["steps"]] == [None] * STEPS  # settled at the next step
        assert r["moved"] == [step != NAN_AT for step in range(STEPS)], (rank, r["moved"])
        assert r["counters"]["skipped_steps"] == 1 and r["counters"]["clipped_steps"] == STEPS - 1
        for step, s in enumerate(r["steps"]):
            if step != NAN_AT:
                assert math.isclose(s["ours"], s["theirs"], rel_tol=2e-4) and s["scaled_like_theirs"], (rank, step)
    assert [rec["step"] for rec in records] == list(range(STEPS)) and records[NAN_AT]["skipped"]


@needs_torchtitan
def test_records_go_to_torchtitans_tensorboard_too(run):
    """With torchtitan's TensorBoard on (the pipeline run), gradfuse's metrics are in its event
    file, written on the rank torchtitan writes from (the last stage's)."""
    layout, _, records, out = run
    if layout != "pp":
        pytest.skip("the pipeline run has torchtitan's TensorBoard on")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = list(out.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "grad/total_norm" in tags and "loss_metrics/global_avg_loss" in tags, tags
    steps = [e.step for e in acc.Scalars("grad/total_norm")]
    assert steps == list(range(STEPS)), steps
    assert all(rec.get("rank") is None for rec in records)  # one writer: the records carry no rank


@needs_torchtitan
def test_the_checkpoint_carries_the_monitors_state(tmp_path):
    """With checkpoint.enable, a run resumed from torchtitan's checkpoint of step 4 continues the
    monitor's numbering and counters (its skipped step among them)."""
    saved, _ = launch("saved", tmp_path)
    assert saved[0]["counters"]["steps"] == STEPS and saved[0]["counters"]["skipped_steps"] == 1
    resumed, records = launch("resumed", tmp_path)
    for r in resumed:
        assert len(r["steps"]) == 2  # steps 5 and 6 of 6
        assert r["counters"]["steps"] == STEPS + 2 and r["counters"]["skipped_steps"] == 1, r["counters"]
        assert r["counters"]["clipped_steps"] == STEPS + 1
    assert [rec["step"] for rec in records] == [STEPS, STEPS + 1]


@pytest.mark.parametrize("version", ["0.2.9", "0.4.0", "1.0.0"])
def test_versions_outside_the_tested_range_are_refused(version):
    with pytest.raises(RuntimeError, match=f"torchtitan {version} is outside the versions"):
        gtt.check_version(version)


def test_versions_in_the_tested_range_pass():
    gtt.check_version("0.3.0")
    gtt.check_version("0.3.1.dev0+git1234")
    assert importlib.util.find_spec("gradfuse.integrations.torchtitan") is not None
