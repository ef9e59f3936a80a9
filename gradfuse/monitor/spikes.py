"""Spike detection on the device for the flight recorder: the rolling histories of the loss, the
total gradient norm and the total update norm, the bands (mean, std) they give, and the message
that names the layers that moved.

Kept apart from the ring (``gradfuse.monitor.recorder``) because it is a statistic of its own: it
decides from a history of values, not from the rows of a step, and a checkpoint saves it.

Layer: monitor. Imports torch only.
"""
from __future__ import annotations

import math

import torch

SPIKE_QUANTITIES = ("loss", "grad_norm", "update_norm")
LOSS, GRAD, UPDATE = 0, 1, 2  # columns of the spike quantities (and of the scalars they come from)


class SpikeDetector:
    """Per quantity (``SPIKE_QUANTITIES``) a ring of its previous ``window`` finite values, on
    the device. With at least ``warmup`` of them, ``(mean, std) = torch.std_mean(history)``
    (unbiased) and a value is a spike when ``x - mean > sigma * std``: upward only, a drop is no
    spike. Deciding and pushing read nothing from the host.

    Args:
        window: The history's length.
        warmup: The values needed before the first decision.
        sigma: A spike is above ``mean + sigma * std``.
    """

    def __init__(self, window: int, warmup: int, sigma: float):
        self.window, self.warmup, self.sigma = window, warmup, sigma
        self.bound = False
        self._saved: dict | None = None

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        """Makes the histories on ``device`` (and restores a state loaded before)."""
        self.device, self.dtype = device, dtype
        kw = dict(device=device)
        self.history = torch.full((3, self.window), math.nan, dtype=dtype, **kw)  # per quantity, a ring
        self.history_index = torch.zeros(3, dtype=torch.int64, **kw)
        self.history_count = torch.zeros(3, dtype=torch.int64, **kw)
        self.bands = torch.full((3, 3), math.nan, dtype=dtype, **kw)  # mean, std, count at the latest decision
        self.bands[:, 2] = 0
        self._quantity_ids = {qs: torch.tensor(qs, dtype=torch.int64, **kw)
                              for qs in ((LOSS,), (LOSS, GRAD), (UPDATE,), (LOSS, GRAD, UPDATE))}
        self.bound = True
        if self._saved is not None:
            self._restore(self._saved)

    def decide(self, x: torch.Tensor, quantities: tuple[int, ...], skip: torch.Tensor | None = None) -> torch.Tensor:
        """Spike bits of values ``x`` of ``quantities`` against their history (before them);
        the bands (mean, std, count) are kept for the dump. ``skip``: a 0-d bool on the device,
        True for a step that does not count (skipped there): the bands stay, no bit is set."""
        q = self._quantity_ids[quantities]
        h, n = self.history.index_select(0, q), self.history_count.index_select(0, q)
        valid = torch.arange(self.window, device=self.device)[None, :] < n[:, None]
        nf = n.to(self.dtype)
        mean = torch.where(valid, h, 0.0).sum(1) / nf.clamp(min=1)
        var = torch.where(valid, (h - mean[:, None]) ** 2, 0.0).sum(1) / (nf - 1).clamp(min=1)
        std = var.sqrt()
        bands = torch.stack([mean, std, nf], 1)
        if skip is not None:
            bands = torch.where(skip, self.bands.index_select(0, q), bands)
        self.bands.index_copy_(0, q, bands)
        bits = (n >= self.warmup) & torch.isfinite(x) & (x - mean > self.sigma * std)
        return bits if skip is None else bits & ~skip

    def push(self, x: torch.Tensor, quantities: tuple[int, ...]) -> None:
        """Adds the finite values ``x`` to the histories of ``quantities``."""
        q = self._quantity_ids[quantities]
        ok = torch.isfinite(x)
        pos = self.history_index.index_select(0, q)
        old = self.history[q, pos]
        self.history.index_put_((q, pos), torch.where(ok, x, old))
        self.history_index.index_copy_(0, q, (pos + ok.to(torch.int64)) % self.window)
        count = self.history_count.index_select(0, q)
        self.history_count.index_copy_(0, q, (count + ok.to(torch.int64)).clamp(max=self.window))

    def band_values(self, bands: torch.Tensor | None = None) -> dict[str, dict]:
        """The latest bands (or ``bands``, a copy of them) per quantity, ``{quantity: {mean,
        std, count}}`` (reads the host)."""
        bands = self.bands if bands is None else bands
        return {q: {"mean": m, "std": sd, "count": int(c)}
                for q, (m, sd, c) in zip(SPIKE_QUANTITIES, bands.to(torch.float64).cpu().tolist())}

    def message(self, quantities: list[str], scalars: torch.Tensor, layer_values: torch.Tensor, layers: list[str],
                field: str, bands: torch.Tensor | None = None) -> str:
        """The message of a spike: each of ``quantities`` with its latest finite value (in the
        ``scalars`` rows) and its band, and the layers whose ``field`` (``layer_values``,
        ``[steps, layers]``) is furthest above its mean, in z-scores (reads the host). ``bands``:
        a copy of the bands to read in place of the latest."""
        bands = (self.bands if bands is None else bands).to(torch.float64).cpu().tolist()
        parts = []
        for q in quantities:
            i = SPIKE_QUANTITIES.index(q)
            col = scalars[:, i][torch.isfinite(scalars[:, i])]
            value = float(col[-1]) if len(col) else math.nan
            parts.append(f"{q} {value:.4g} > mean {bands[i][0]:.4g} + {self.sigma:g} * std {bands[i][1]:.4g}")
        moved = top_moved(layer_values, layers, self.window)
        text = "spike: " + "; ".join(parts)
        if moved:
            text += f"; layers that moved ({field} z-score): " + ", ".join(f"{name} (z={z:.3g})" for name, z in moved)
        return text

    def state_dict(self) -> dict:
        """The histories as plain values once bound, else nothing (reads the host)."""
        if not self.bound:
            return {}
        return {"history": self.history.to(torch.float64).cpu().tolist(),
                "history_index": self.history_index.cpu().tolist(),
                "history_count": self.history_count.cpu().tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict``'s output now once bound, else at binding."""
        self._saved = state
        if self.bound:
            self._restore(state)

    def _restore(self, state: dict) -> None:
        self.history.copy_(torch.tensor(state["history"], dtype=self.dtype))
        self.history_index.copy_(torch.tensor(state["history_index"]))
        self.history_count.copy_(torch.tensor(state["history_count"]))
        self._saved = None


def top_moved(values: torch.Tensor, layers: list[str], window: int, top: int = 3) -> list[tuple[str, float]]:
    """The layers whose last value is furthest above the mean of the rows before it (z-score,
    over at most ``window`` rows; NaN rows left out): ``[(layer, z)]``, largest first, at most
    ``top``, only those with a positive z."""
    if values.shape[0] < 3:
        return []
    last, before = values[-1], values[:-1][-window:]
    ok = torch.isfinite(before)
    n = ok.sum(0)
    mean = torch.where(ok, before, 0.0).sum(0) / n.clamp(min=1)
    var = torch.where(ok, (before - mean) ** 2, 0.0).sum(0) / (n - 1).clamp(min=1)
    z = (last - mean) / var.sqrt()
    z = torch.where((n >= 2) & ~torch.isnan(z), z, -math.inf)
    ranked = sorted(zip(layers, z.tolist()), key=lambda kv: -kv[1])
    return [(name, v) for name, v in ranked[:top] if v > 0]
