"""JSONL: ``JsonlSink`` appends one JSON line per record, ``read_jsonl`` reads them back.

Layer: monitor. Imports nothing of gradfuse.
"""
from __future__ import annotations

import json
import os


class JsonlSink:
    """Appends one JSON object per record to ``path``: safe to read while training.

    Each record is one ``write`` of one line to an unbuffered file (``fsync=True`` also forces it
    to disk). The line is the whole record (its keys are listed on the Data reference page,
    under "The record"). A path that cannot be opened fails here, at construction, not at the
    first logged step. A line torn by a crash or a failed write (a full disk) is set apart with a
    newline before the next record, and ``read_jsonl`` skips it. NaN and Inf are written as the
    JSON extensions ``NaN`` / ``Infinity``, which Python's json reads back. ``last_step`` is the
    last step the file holds (read from its end). An existing file is appended to.

    Args:
        path: The file; its directory is created when missing.
        fsync: Force each record to disk (``os.fsync``) after writing it.

    Attributes:
        path (str): The file's path.
        fsync (bool): Whether each record is forced to disk.

    Raises:
        OSError: ``path`` cannot be opened for appending (the message names it).

    Example:
        ```python
        sink = gradfuse.JsonlSink("runs/exp1/grads.jsonl")
        monitor = gradfuse.GradMonitor(model, every=100, sinks=[sink])
        ...
        monitor.close()
        records = gradfuse.sinks.read_jsonl("runs/exp1/grads.jsonl")
        ```
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = False):
        self.path = os.fspath(path)
        self.fsync = fsync
        d = os.path.dirname(self.path)
        try:
            if d:
                os.makedirs(d, exist_ok=True)
            self._f = open(self.path, "ab", buffering=0)
        except OSError as e:
            raise OSError(e.errno, f"gradfuse.JsonlSink cannot open {self.path!r} for appending: "
                                   f"{e.strerror or e}") from e
        self._torn = self._ends_without_newline()
        self._last_step = None

    def _ends_without_newline(self) -> bool:
        if not os.path.isfile(self.path) or os.path.getsize(self.path) == 0:
            return False
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"

    def last_step(self) -> int | None:
        """The step of the last record in the file (this run's, or a previous run's).

        Returns:
            The step, or None when the file holds no complete record.
        """
        if self._last_step is None and os.path.isfile(self.path):
            rec = _last_record(self.path)
            self._last_step = None if rec is None else rec.get("step")
        return self._last_step

    def write(self, record: dict) -> None:
        """Appends ``record`` as one JSON line (forced to disk with ``fsync=True``).

        Args:
            record: The record.
        """
        line = json.dumps(record) + "\n"
        data = (("\n" if self._torn else "") + line).encode("utf-8")
        self._torn = True  # until the whole line is out
        view = memoryview(data)
        while view:
            view = view[self._f.write(view):]
        if self.fsync:
            os.fsync(self._f.fileno())
        self._torn = False
        self._last_step = record["step"]

    def close(self) -> None:
        """Closes the file."""
        self._f.close()


def _last_record(path: str, block: int = 1 << 20) -> dict | None:
    """The last complete, parseable record of a JSONL file, read backwards in blocks (a log of a
    long run can be gigabytes; a record of a large model, megabytes)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        pos = f.tell()
        tail = b""
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            tail = f.read(pos - start) + tail
            pos = start
            lines = tail.split(b"\n")
            # lines[0] may be cut by the block boundary unless the file starts there
            for line in reversed(lines if pos == 0 else lines[1:]):
                if line.strip():
                    try:
                        return json.loads(line)
                    except ValueError:
                        continue  # a torn line: look further back
            tail = lines[0] if pos > 0 else b""
    return None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL log, skipping a torn line left by a crash.

    Args:
        path: A file a ``JsonlSink`` wrote.

    Returns:
        The records, in file order (their keys: see the Data reference page).

    Raises:
        OSError: the file cannot be opened (``FileNotFoundError`` when it does not exist).

    Example:
        ```python
        records = gradfuse.sinks.read_jsonl("run.jsonl")
        norms = [r["total_norm"] for r in records]
        ```
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
