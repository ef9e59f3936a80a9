"""WandbSink with a real wandb run in offline mode (no network, no server): what the run holds in
the process (config, summary), and what its offline .wandb file holds, read back record by record
(the file is a LevelDB-style log of wandb's own protobuf Records: 32 KiB blocks of chunks with a
7-byte header each, after a 7-byte file header)."""
import glob
import json
import math
import struct
import time

import pytest
import torch
from torch import nn

wandb = pytest.importorskip("wandb")
pytest.importorskip("matplotlib")

from helpers import ListSink  # noqa: E402

from gradfuse import GradMonitor, WandbSink  # noqa: E402
from gradfuse.sinks import exponent_buckets  # noqa: E402


def read_run_file(path):
    """The protobuf Records of an offline run's .wandb file."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # the zero padding at a block's end
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def finished_run_records(root, timeout=60.0):
    """The records of the one offline run under ``root``, once its ``exit`` record is written
    (wandb-core writes the file from its own process, after run.finish() has returned)."""
    deadline = time.monotonic() + timeout
    while True:
        paths = glob.glob(str(root / "wandb" / "offline-run-*" / "*.wandb"))
        recs = read_run_file(paths[0]) if len(paths) == 1 else []
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def history(records):
    """Step -> {key path: value} of the history records."""
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {tuple(i.nested_key) or (i.key,): json.loads(i.value_json) for i in r.history.item}
            out[r.history.step.num] = row
    return out


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    yield tmp_path
    wandb.teardown()  # the settings of wandb's process-wide singleton (its directory) go with it


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_offline_run_holds_metrics_histograms_images_summary_and_config(offline):
    run = wandb.init(project="gradfuse-test", dir=str(offline))
    model = make_model()
    keep = ListSink()
    records = keep.records

    try:
        mon = GradMonitor(model, max_norm=1e-3, every=2, histogram=True, explode_threshold=1e6,
                          sinks=[WandbSink(run, images_every=2), keep])
        for i in range(5):
            model.zero_grad()
            (model(torch.randn(3, 4)).square().mean() * (1e9 if i == 3 else 1.0)).backward()
            mon.step()
        mon.close()
        # in the process
        assert run.config["gradfuse"]["max_norm"] == 1e-3 and run.config["gradfuse"]["every"] == 2
        assert run.config["gradfuse"]["histogram"] is True
        assert run.summary["grad/last_anomaly"] == "explode"
        assert run.summary["grad/last_anomaly_step"] == 3
        assert run.summary["grad/anomalies/explode"] == 1
        assert "explode_threshold" in run.summary["grad/last_anomaly_message"]
        run_dir = run.dir
    finally:
        run.finish()
    assert [r["step"] for r in records] == [0, 2, 3, 4]

    recs = finished_run_records(offline)
    rows = history(recs)
    assert sorted(rows) == [0, 2, 3, 4], [r.WhichOneof("record_type") for r in recs]
    for r in records:
        row = rows[r["step"]]
        assert math.isclose(row[("grad/total_norm",)], r["total_norm"], rel_tol=1e-9)
        for layer, entry in r["exponents"].items():
            edges, counts = exponent_buckets(entry)
            assert row[(f"grad_exponent/{layer}", "_type")] == "histogram"
            assert row[(f"grad_exponent/{layer}", "values")] == counts
            assert row[(f"grad_exponent/{layer}", "bins")] == edges
    # pictures at the 2nd and 4th logged steps (2, 4), as image files of the run
    image_steps = [s for s, row in rows.items() if row.get(("grad/gradflow", "_type")) == "image-file"]
    assert image_steps == [2, 4]
    assert all(rows[s].get(("grad/exponents", "_type")) == "image-file" for s in image_steps)
    pngs = glob.glob(f"{run_dir}/media/images/**/*.png", recursive=True)
    assert len(pngs) == 4
    config = [json.loads(u.value_json) for r in recs if r.WhichOneof("record_type") == "config"
              for u in r.config.update if u.key == "gradfuse"]
    assert config and config[-1]["every"] == 2 and config[-1]["sink_ranks"] == 0
    summary = {u.key: json.loads(u.value_json) for r in recs if r.WhichOneof("record_type") == "summary"
               for u in r.summary.update if u.key}
    assert summary["grad/last_anomaly"] == "explode" and summary["grad/last_anomaly_step"] == 3


def test_offline_run_holds_the_activation_exponent_histograms(offline):
    run = wandb.init(project="gradfuse-test", dir=str(offline))
    model = make_model()
    keep = ListSink()
    records = keep.records

    try:
        mon = GradMonitor(model, every=2, histogram=True, activations=True,
                          sinks=[WandbSink(run), keep])
        for _ in range(4):
            model.zero_grad()
            model(torch.randn(3, 4)).square().mean().backward()
            mon.step()
        mon.close()
    finally:
        run.finish()
    with_act = [r for r in records if "act_exponents" in r]
    assert [r["step"] for r in with_act] == [0, 2]  # the steps the hooks were armed for
    numel = {"0": 3 * 8, "1": 3 * 8, "2": 3 * 2, "(root)": 3 * 2}  # batch 3: Linear(4, 8), ReLU, Linear(8, 2)
    rows = history(finished_run_records(offline))
    for r in with_act:
        row = rows[r["step"]]
        for key, prefix, stats in (("act_exponents", "activation_exponent", "act"),
                                   ("act_grad_exponents", "activation_grad_exponent", "act_grad")):
            assert sorted(r[key]) == sorted(numel)
            for layer, n in numel.items():
                edges, counts = exponent_buckets(r[key][layer])
                agg = r[stats][layer]
                assert agg["numel"] == n
                assert 0 < sum(counts) == n - agg["zero_count"] - agg["nan_count"] - agg["inf_count"]
                assert row[(f"{prefix}/{layer}", "_type")] == "histogram"
                assert row[(f"{prefix}/{layer}", "values")] == counts
                assert row[(f"{prefix}/{layer}", "bins")] == edges
        assert row[("grad_exponent/0", "_type")] == "histogram"  # the gradients' histograms beside them
    assert not any(k[0].startswith("activation_") for k in rows[3])  # step 3, logged on close: no hooks


def test_wandb_run_none_writes_to_the_current_run(offline):
    sink = WandbSink(None)
    rec = {"step": 1, "total_norm": 2.0, "nonfinite": False, "skipped": False, "clip_coef": None,
           "anomalies": [], "message": "", "layers": {}}
    with pytest.raises(RuntimeError, match="wandb.init"):
        sink.write(rec)
    run = wandb.init(project="gradfuse-test", dir=str(offline))
    try:
        sink.write(rec)
    finally:
        run.finish()
    recs = finished_run_records(offline)
    assert history(recs).get(1, {}).get(("grad/total_norm",)) == 2.0, [r.WhichOneof("record_type") for r in recs]


def test_a_plain_logger_still_works_as_before():
    logged = []

    class Logger:
        def log(self, m, step):
            logged.append((step, m))

    model = make_model()
    mon = GradMonitor(model, every=1, sinks=[WandbSink(Logger())])
    model(torch.randn(3, 4)).sum().backward()
    mon.step()
    assert logged[0][0] == 0 and "grad/total_norm" in logged[0][1]
    with pytest.raises(TypeError):
        WandbSink(object())


def test_a_tracker_raising_inside_write_is_counted_not_raised():
    class Down:
        def log(self, m, step):
            raise TimeoutError("wandb service gone")

    model = make_model()
    mon = GradMonitor(model, every=1, sinks=[WandbSink(Down(), images_every=1)])
    with pytest.warns(RuntimeWarning, match="failed to write"):
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            assert not mon.step().skip
    assert mon.dropped_records == 3 and "TimeoutError" in mon.sink_health()[0]["last_error"]
