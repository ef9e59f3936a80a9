"""A sink that fails must never stop training: one warning per sink with the reason, dropped
records counted on the monitor, the other sinks keep going, and the documented back-off:
after the k-th consecutive failure a sink sits out min(2**(k-1), 64) records."""
import errno
import json
import os
import socket
import threading
import urllib.request
import warnings

import pytest
import torch
from torch import nn

from gradfuse import GradMonitor, JsonlSink, MetricsSink
from gradfuse.monitor.sink_set import SINK_MAX_BACKOFF
from gradfuse.sinks import read_jsonl


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def train(mon, model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        assert not mon.step().skip
        opt.step()


class Recorder:
    def __init__(self):
        self.steps = []

    def write(self, record):
        self.steps.append(record["step"])


def run_with_failing_sink(bad, steps=12):
    """Trains ``steps`` steps logging every step into ``bad`` and a healthy recorder."""
    model = make_model()
    good = Recorder()
    mon = GradMonitor(model, every=1, sinks=[bad, good])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(mon, model, steps)
    sink_warnings = [w for w in caught if "failed to write" in str(w.message)]
    return mon, good, sink_warnings


def test_disk_full_jsonl(tmp_path):
    """A real ENOSPC: /dev/full accepts the open and fails every write."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    mon, good, warned = run_with_failing_sink(JsonlSink("/dev/full"))
    assert good.steps == list(range(12))                 # the other sink kept going
    assert len(warned) == 1 and "No space left on device" in str(warned[0].message)
    assert warned[0].filename == __file__                # the warning names the training line
    health = mon.sink_health()[0]
    # Attempts at records 0, 2, 5, 10 (sitting out 1, 2, 4 after failures 1, 2, 3); all dropped.
    assert health["written"] == 0 and health["dropped"] == 12 == mon.dropped_records
    assert health["failures"] == 4 and health["retry_in"] == 7 and "OSError" in health["last_error"]


class ReadOnlyThenWritable:
    """A file system that turns read-only for a while (EROFS), then recovers."""

    def __init__(self, failing_calls):
        self.calls = 0
        self.failing_calls = failing_calls
        self.steps = []

    def write(self, record):
        self.calls += 1
        if self.calls <= self.failing_calls:
            raise OSError(errno.EROFS, "Read-only file system", "/mnt/logs/run.jsonl")
        self.steps.append(record["step"])


def test_read_only_then_recovers_back_off_schedule():
    bad = ReadOnlyThenWritable(failing_calls=2)
    mon, good, warned = run_with_failing_sink(bad, steps=12)
    # Call 1 at record 0 fails (sit out 1), call 2 at record 2 fails (sit out 2), call 3 at
    # record 5 succeeds: from then on every record is written again.
    assert bad.steps == [5, 6, 7, 8, 9, 10, 11] and good.steps == list(range(12))
    assert len(warned) == 1 and "Read-only file system" in str(warned[0].message)
    assert mon.dropped_records == 5
    assert mon.sink_health()[0]["failures"] == 0 and mon.counters()["dropped_records"] == 5


def test_closed_writer():
    """A sink whose file was closed under it (ValueError: I/O operation on closed file)."""
    path_sink = JsonlSink(os.devnull)
    path_sink.close()
    mon, good, warned = run_with_failing_sink(path_sink)
    assert good.steps == list(range(12)) and len(warned) == 1
    assert "closed file" in str(warned[0].message) and "ValueError" in mon.sink_health()[0]["last_error"]
    mon.close()  # closing a closed sink again does not raise either


class HttpMetricsClient:
    """A minimal network metrics client: POSTs each log call as JSON, with a timeout."""

    def __init__(self, url, timeout):
        self.url, self.timeout = url, timeout

    def log(self, metrics, step):
        body = json.dumps({"step": step, "metrics": metrics}).encode()
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=self.timeout).read()


def test_network_client_times_out():
    """A metrics server that accepts connections and never answers: each attempt times out
    (a real socket timeout), the back-off keeps the number of attempts logarithmic."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []
    stop = threading.Event()

    def accept_and_hang():
        server.settimeout(0.05)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_hang, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.getsockname()[1]}/log"
        sink = MetricsSink(HttpMetricsClient(url, timeout=0.2))
        mon, good, warned = run_with_failing_sink(sink, steps=12)
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()
    assert good.steps == list(range(12)) and len(warned) == 1
    assert "timed out" in str(warned[0].message)
    health = mon.sink_health()[0]
    assert health["failures"] == 4 and health["dropped"] == 12  # 4 attempts in 12 records


def test_back_off_is_capped_and_close_failures_do_not_raise():
    class AlwaysFails:
        def write(self, record):
            raise RuntimeError("metrics backend gone")

        def close(self):
            raise OSError(errno.EIO, "Input/output error")

    mon = GradMonitor(make_model(), every=1, sinks=[AlwaysFails()])
    record = {"step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(1000):
            mon.write(record)
        health = mon.sink_health()[0]
        mon.close()
    # The documented rule, step by step: attempts at records 0, 2, 5, 10, 19, 36, 69, 134, ...
    attempts, next_try = 0, 0
    for i in range(1000):
        if i == next_try:
            attempts += 1
            next_try = i + min(2 ** (attempts - 1), SINK_MAX_BACKOFF) + 1
    assert attempts == 21 and health["failures"] == attempts and health["dropped"] == 1000
    assert len([w for w in caught if "AlwaysFails" in str(w.message)]) == 1  # once per sink


def test_jsonl_unopenable_path_fails_at_construction(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(OSError, match=r"gradfuse.JsonlSink cannot open .*a_file/run.jsonl"):
        JsonlSink(tmp_path / "a_file" / "run.jsonl")   # parent is a file
    with pytest.raises(OSError, match="gradfuse.JsonlSink cannot open"):
        JsonlSink(tmp_path)                               # a directory


def test_jsonl_after_failed_write_starts_a_new_line(tmp_path):
    """A write cut short (disk full mid-line) leaves a torn line; the next record must not be
    glued to it."""
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path)
    sink.write({"step": 0})

    class FullAfter:
        def __init__(self, f, n):
            self.f, self.n = f, n

        def write(self, data):
            if self.n <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            k = min(self.n, len(data))
            self.n -= k
            return self.f.write(data[:k])

        def fileno(self):
            return self.f.fileno()

    real = sink._f
    sink._f = FullAfter(real, 5)
    with pytest.raises(OSError):
        sink.write({"step": 1, "total_norm": 1.0})
    sink._f = real
    sink.write({"step": 2})
    sink.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 2]
