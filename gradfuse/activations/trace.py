"""The first non-finite value of a forward and backward, traced to its module from the NaN / Inf
counts that every row of the hooks of ``gradfuse.activations.capture`` holds.

The forward rows are searched first, in execution order; when all are finite, the backward rows,
in the order backward computed them: the first non-finite gradient was handed back by the backward
of the module that produced the value whose gradient was still finite just before it, or, when no
gradient before it was finite, came from the loss or from code outside the watched modules.

Layer: activations (a capability). Imports ``gradfuse.ops.layout``.
"""
from __future__ import annotations

import torch

from gradfuse.activations.stats import HookRows
from gradfuse.ops.layout import INF, NAN


def nonfinite_counts(fwd: list[HookRows], bwd: list[HookRows]) -> torch.Tensor | None:
    """The NaN and Inf counts of every row of ``fwd`` then ``bwd`` (int64 ``[rows, 2]`` on the
    first one's device; None without rows): what ``nonfinite_origin`` reads."""
    events = fwd + bwd
    if not events:
        return None
    dev = events[0].counts.device
    return torch.cat([e.counts[:, [NAN, INF]].to(dev) for e in events])


def _nonfinite_rows(fwd: list[HookRows], bwd: list[HookRows], counts) -> tuple[list, list]:
    """Per row of forward and backward: (event index, row index, nan, inf); one transfer."""
    events = fwd + bwd
    if not events:
        return [], []
    counts = (nonfinite_counts(fwd, bwd) if counts is None else counts).cpu().tolist()
    rows, k = [], 0
    for i, e in enumerate(events):
        for j in range(len(e.names)):
            rows.append((i, j, counts[k][0], counts[k][1]))
            k += 1
    n_fwd = sum(len(e.names) for e in fwd)
    return rows[:n_fwd], [(i - len(fwd), j, a, b) for i, j, a, b in rows[n_fwd:]]


def nonfinite_origin(fwd: list[HookRows], bwd: list[HookRows], counts: torch.Tensor | None = None) -> dict | None:
    """Where the first non-finite value appeared, from the hook calls of the forward (``fwd``)
    and of the backward (``bwd``); reads their counts in one transfer.

    Args:
        fwd: The forward hook calls, in execution order.
        bwd: The backward hook calls, in the order backward computed them.
        counts: Their ``nonfinite_counts`` when taken already (a host copy); None: read now.

    Returns:
        None, or ``{"kind", "module", "row", "nan", "inf"}`` (and for backward
            ``"gradient_of"``, ``"entered"``), as ``ActivationCapture.nonfinite_origin``.
    """
    fwd_rows, bwd_rows = _nonfinite_rows(fwd, bwd, counts)
    for i, j, nan, inf in fwd_rows:
        if nan or inf:
            e = fwd[i]
            return {"kind": "forward", "module": e.module, "row": e.names[j],
                    "nan": int(nan), "inf": int(inf)}
    for k, (i, j, nan, inf) in enumerate(bwd_rows):
        if not (nan or inf):
            continue
        e = bwd[i]
        # The gradient just before was finite: the backward of the module that produced
        # that value ran next and handed back the first non-finite gradient.
        culprit = bwd[bwd_rows[k - 1][0]].producer if k else e.module
        return {"kind": "backward", "module": culprit, "row": e.names[j],
                "gradient_of": e.names[j], "nan": int(nan), "inf": int(inf),
                "entered": k == 0}
    return None


def describe_origin(o: dict | None) -> str | None:
    """An origin from ``nonfinite_origin`` in words (None for None)."""
    if o is None:
        return None
    counts = f"{o['nan']} NaN" + (f", {o['inf']} Inf" if o["inf"] else "") if o["nan"] else f"{o['inf']} Inf"
    if o["kind"] == "forward":
        where = o["row"] if o["row"] != o["module"] else o["module"]
        return f"first non-finite value in the forward output of {where} ({counts})"
    if o["entered"]:
        return (f"first non-finite value in backward: the gradient arriving at the output of "
                f"{o['gradient_of']} ({counts}), from the loss or code outside the watched modules")
    return (f"first non-finite value in the backward of {o['module']} (or code right after it "
            f"in forward): the gradient it handed back to the output of {o['gradient_of']} "
            f"holds {counts}, while its own output gradient was finite")
