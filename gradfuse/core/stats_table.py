"""What a reader sees of ``GradStats``: the fixed-width text of ``GradStats.table`` and the HTML
table Jupyter shows, both drawn from the plain values of ``GradStats.to_dict`` (no tensor is read
here, so the one host transfer stays ``GradStats``'s).

Layer: core. Imports nothing of gradfuse.
"""
from __future__ import annotations

import html
import math


def sort_key(value: float) -> tuple[bool, float]:
    """Sorts NaN above every number (with ``reverse=True``: NaN first, then the largest)."""
    return (math.isnan(value), value if not math.isnan(value) else 0.0)


def text_table(d: dict, statistics, sort_by: str, top: int | None, nonfinite_names: list[str]) -> str:
    """The rows of ``d`` (a ``GradStats.to_dict()``), largest ``sort_by`` first, at most ``top``
    of them, in the columns of ``statistics`` (``Statistic`` entries) that have a header; the
    totals below, naming ``nonfinite_names`` when ``d`` is non-finite."""
    items = sorted(d["params"].items(), key=lambda kv: sort_key(kv[1][sort_by]), reverse=True)
    shown = items if top is None else items[:top]
    width = max([len("parameter")] + [len(n) for n, _ in shown])
    columns = [st for st in statistics if st.header is not None]
    head = f"{'parameter':<{width}}" + "".join(f"  {st.header:>{st.width}}" for st in columns)
    lines = [head, "-" * len(head)]
    for name, r in shown:
        lines.append(f"{name:<{width}}" + "".join(
            f"  {r[st.name] * st.scale if st.scale != 1 else r[st.name]:>{st.width}{st.spec}}" for st in columns))
    if len(shown) < len(items):
        lines.append(f"... {len(items) - len(shown)} more parameters")
    total = f"total norm ({d['norm_type']:g}): {d['total_norm']:.6g}"
    if d["clip_coef"] is not None and "clip_per" in d:
        total += (f"   per {d['clip_per']}: {d['clipped_params']} of {len(items)} clipped, "
                  f"smallest coef {d['clip_coef']:.4g}, max_norm {d['max_norm']:g}")
    elif d["clip_coef"] is not None:
        max_norm = "adaptive" if d["max_norm"] is None else f"{d['max_norm']:g}"
        total += (f"   clip coef: {d['clip_coef']:.4g} "
                  f"({'clipped' if d['clipped'] else 'not clipped'}, max_norm {max_norm})")
    if "clamped" in d:
        total += (f"   clip value {d['clip_value']:g}: {d['clamped']} elements clamped in "
                  f"{d['clipped_params']} of {len(items)}")
    if d["nonfinite"]:
        total += f"   NON-FINITE: {', '.join(nonfinite_names)}"
    lines.append(total)
    return "\n".join(lines)


def html_table(d: dict, title: str, fields: tuple[str, ...], max_rows: int) -> str:
    """The rows of ``d`` (a ``GradStats.to_dict()``) as an HTML table under ``title``, largest
    ``l2`` first, at most ``max_rows``, with the totals below; ``fields`` head an empty table."""
    items = sorted(d["params"].items(), key=lambda kv: sort_key(kv[1]["l2"]), reverse=True)
    columns = list(items[0][1]) if items else list(fields)

    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["name"] + columns)
    rows = "".join("<tr><td>" + html.escape(name) + "</td>"
                   + "".join(f"<td>{cell(r.get(c))}</td>" for c in columns) + "</tr>"
                   for name, r in items[:max_rows])
    more = (f"<p>... {len(items) - max_rows} more rows</p>" if len(items) > max_rows else "")
    totals = (f"total norm ({d['norm_type']:g}): {d['total_norm']:.6g}; "
              f"non-finite: {d['nonfinite']}"
              + (f"; clip coef: {d['clip_coef']:.4g}" if d["clip_coef"] is not None else ""))
    return (f"<div><b>{html.escape(title)}</b> ({len(items)} rows)"
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{more}"
            f"<p>{html.escape(totals)}</p></div>")
