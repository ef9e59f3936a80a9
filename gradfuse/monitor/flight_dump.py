"""The flight recorder's dump file: named arrays and a JSON header, in one file.

The layout is safetensors' (https://github.com/huggingface/safetensors), written and read here
without that package: an 8-byte little-endian header length, a JSON header, then the arrays' bytes.
The JSON header maps each array's name to ``{"dtype", "shape", "data_offsets"}`` (offsets into the
bytes after the header) and holds, under ``"__metadata__"``, ``{"gradfuse": "<JSON text>"}``: the
recorder's own header (format, version, names, layers, fields, config, the anomaly). So a dump
also opens with ``safetensors.torch.load_file`` and ``safetensors.safe_open(...).metadata()``.

Layer: monitor. Imports torch only.
"""
from __future__ import annotations

import ctypes
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "gradfuse-flight-recorder"
VERSION = 1

# safetensors' dtype names, for the dtypes a dump holds
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32",
           torch.bool: "BOOL", torch.uint8: "U8"}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}


@dataclass
class FlightDump:
    """A dump read back: the recorder's header and its arrays.

    Attributes:
        header: The JSON header: ``format``, ``version``, ``step`` (the step that triggered it),
            ``trigger`` (what triggered it), ``layers``, ``layer_fields``, ``scalar_fields``,
            ``config`` and what else the recorder wrote (the data reference lists every key).
        arrays: The arrays by name, on the CPU (``steps``, ``scalars``, ``layers``, ...).
    """

    header: dict
    arrays: dict[str, torch.Tensor]


def write_dump(path: str | os.PathLike, header: dict, arrays: dict[str, torch.Tensor]) -> Path:
    """Writes ``arrays`` and ``header`` to ``path`` (its folder is made), atomically: to a
    temporary name first, then renamed, so a crash never leaves half a dump.

    Args:
        path: Where to write.
        header: JSON-serialisable; ``format`` and ``version`` are added.
        arrays: Tensors of the dtypes of safetensors' F64, F32, I64, I32, BOOL, U8; copied to
            the CPU (the one transfer a dump takes).

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "version": VERSION, **header}
    entries, blobs, offset = {}, [], 0
    for name, tensor in arrays.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype not in _DTYPES:
            raise TypeError(f"gradfuse flight dump: array {name!r} is {t.dtype}; "
                            f"expected one of {sorted(str(d) for d in _DTYPES)}")
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = {"__metadata__": {"gradfuse": json.dumps(meta, allow_nan=True)}, **entries}
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)  # the arrays start 8-byte aligned
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)
    return path


def load_dump(path: str | os.PathLike) -> FlightDump:
    """Reads a dump written by :func:`write_dump`.

    Raises:
        ValueError: the file is not a gradfuse flight-recorder dump (or is truncated).
    """
    raw = Path(path).read_bytes()
    if len(raw) < 8:
        raise ValueError(f"{path}: not a gradfuse flight-recorder dump (too short)")
    (n,) = struct.unpack("<Q", raw[:8])
    try:
        head = json.loads(raw[8:8 + n])
        header = json.loads(head.pop("__metadata__")["gradfuse"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a gradfuse flight-recorder dump ({e})") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: not a gradfuse flight-recorder dump (format {header.get('format')!r})")
    body = memoryview(raw)[8 + n:]
    arrays = {}
    for name, entry in head.items():
        start, end = entry["data_offsets"]
        if end > len(body):
            raise ValueError(f"{path}: truncated: array {name!r} ends at byte {end} of {len(body)}")
        dtype = _BY_NAME[entry["dtype"]]
        if end > start:
            flat = torch.frombuffer(bytearray(body[start:end]), dtype=dtype)
        else:
            flat = torch.empty(0, dtype=dtype)
        arrays[name] = flat.reshape(entry["shape"])
    return FlightDump(header, arrays)
