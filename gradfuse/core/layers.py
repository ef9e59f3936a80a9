"""Rows by layer: the layer a parameter belongs to, host rows summed per layer, exponent
histograms as records keep them, and per-row columns read to the host in one transfer.

Layer: core. Imports nothing of gradfuse.
"""
from __future__ import annotations

import torch


def layer_of(name: str, depth: int | None = None) -> str:
    """The module prefix of a parameter name, leaving out the parameter's own name: up to and
    including the first numeric part, a block index (``transformer.h.3.attn.c_attn.weight`` ->
    ``transformer.h.3``; the whole module path when there is none), or with ``depth`` its first
    ``depth`` dotted parts (``layers.3.attn.weight`` -> ``layers.3`` at depth 2)."""
    parts = name.split(".")[:-1] or [name]
    if depth is None:
        index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
        return ".".join(parts[:index + 1])
    return ".".join(parts[:max(depth, 1)])


def sum_by_key(keys: list[str], rows: torch.Tensor) -> dict[str, list]:
    """The rows of a 2-d tensor (one per key) summed per key, in its dtype, on the host, in one
    ``index_add_``: ``{key: [sums]}``, the keys in the order they first come (a layer's rows
    added up, e.g. keys from ``layer_of``)."""
    first: dict[str, int] = {}
    index = torch.tensor([first.setdefault(key, len(first)) for key in keys], dtype=torch.int64)
    rows = rows.cpu()[:len(keys)]
    return dict(zip(first, rows.new_zeros((len(first), rows.shape[1])).index_add_(0, index, rows).tolist()))


def exponents_entry(counts: list) -> dict:
    """An exponent histogram (one count per bin, as ``gradfuse.ops.layout`` numbers the bins)
    as a monitor record keeps it: ``{"first_bin": b, "counts": [...]}`` without the empty bins
    at both ends (``{"first_bin": 0, "counts": []}`` when every bin is empty)."""
    counts = [int(v) for v in counts]
    nz = [i for i, c in enumerate(counts) if c]
    first, last = (nz[0], nz[-1]) if nz else (0, -1)
    return {"first_bin": first, "counts": counts[first:last + 1]}


def columns_to_host(names: list[str], columns: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per-row columns ({column: [n] tensor}) as {name: {column: value}}, with one
    device-to-host transfer."""
    if not names:
        return {}
    keys = list(columns)
    packed = torch.stack([columns[k] for k in keys], 1).cpu().tolist()
    return {name: dict(zip(keys, row)) for name, row in zip(names, packed)}
