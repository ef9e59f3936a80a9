"""Statistics of gradients held in pieces across ranks, as DeepSpeed ZeRO 1-3 holds them: after
the reduction each rank holds flat fragments of the averaged gradients of some parameters (of a
parameter split between ranks, a piece each; of others, nothing).

The fused pass runs over this rank's fragments, one row per watched parameter (an empty
fragment gives a row of zeros). Every row is a sum over the elements (sums, sums of squares,
NaN / Inf / zero counts, numel) or a maximum (max |x|), so the rows of the full gradients follow
from all ranks' rows in one collective per step: an all-gather of the ``[n, 8]`` float64 rows
(counts exact below 2**53), combined on each rank as ``gradfuse.ops.layout`` says. The total
norm, the non-finite flags and the clip coefficient come from the full rows, the same on every
rank; the clip scales each rank's fragments in place. Nothing is gathered per parameter.

Layer: core. Imports ``gradfuse.ops`` and the core's engine, norms, params and watch.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gradfuse.core.engine import fused_stats, raise_if_nonfinite, scale_to_max_norm
from gradfuse.core.grad_stats import GradStats
from gradfuse.core.norms import norm_accumulator, norm_dtype, root
from gradfuse.core.params import check_max_norm, check_norm_type
from gradfuse.core.watch import GradWatch
from gradfuse.ops.layout import MAX_FLOAT_COLUMNS, NAN, NUM_FLOAT_STATS, SUMMED_FLOAT_COLUMNS


def all_gather_rows(packed: torch.Tensor, group) -> torch.Tensor:
    """``[world, n, k]``: every rank's ``[n, k]`` rows, by one all-gather over ``group``."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    out = packed.new_empty((world * packed.shape[0], packed.shape[1]))
    # torch >= 2.12 names the single-tensor all-gather all_gather_single (the older name warns there)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, packed, group=group)
    return out.view(world, *packed.shape)


def combine_rows(floats: torch.Tensor, counts: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the full gradients from this rank's rows of its fragments (the same rows, in
    the same order, on every rank of ``group``): one all-gather, then summed and maximum columns
    combined locally. A backend's or a reduction's maximum may drop NaN; the summed NaN count
    puts it back."""
    packed = torch.cat([floats.to(torch.float64), counts.to(torch.float64)], dim=1).contiguous()
    parts = all_gather_rows(packed, group)
    summed, maxed = list(SUMMED_FLOAT_COLUMNS), list(MAX_FLOAT_COLUMNS)
    f = parts[:, :, :NUM_FLOAT_STATS]
    c_out = parts[:, :, NUM_FLOAT_STATS:].sum(0).round().to(torch.int64)
    has_nan = c_out[:, NAN:NAN + 1] > 0
    f_out = torch.empty_like(floats, dtype=torch.float64)
    f_out[:, summed] = f[:, :, summed].sum(0)
    f_out[:, maxed] = torch.where(has_nan, math.nan, f[:, :, maxed].amax(0))
    return f_out.to(floats.dtype), c_out


def check_fragment_order(norm_type: float) -> float:
    """``norm_type`` checked for fragments: an order whose total is a sum or a maximum over the
    elements (p > 0 or inf). The 0-"norm" counts tensors and negative orders take a minimum over
    whole tensors: those need every element of a tensor in one place."""
    p = check_norm_type(norm_type)
    if not p > 0:
        raise ValueError(f"gradfuse: norm_type={norm_type!r} cannot be taken of gradient fragments held by "
                         "several ranks (DeepSpeed ZeRO); use an order > 0 or inf")
    return p


def fragment_stats(names: list[str], fragments: list[torch.Tensor], norm_type: float, group) -> GradStats:
    """Statistics of the full gradients of ``names`` from this rank's ``fragments`` of them (one
    tensor per name, empty where this rank holds none): the fused pass, then one all-gather of
    the rows over ``group`` (see the module docstring). Every rank of ``group`` must call it, with
    the same names in the same order."""
    out_dtype = torch.float32
    for t in fragments:
        out_dtype = torch.promote_types(out_dtype, norm_dtype(t.dtype))
    return whole_stats(fused_stats(names, fragments, norm_type), names, group, out_dtype)


def whole_stats(local: GradStats, names: list[str], group, out_dtype: torch.dtype) -> GradStats:
    """``local``, statistics of this rank's fragments (its rows in any order), as those of the
    full gradients: the rows in the order of ``names``, combined over ``group`` in one all-gather
    (``clamped`` counts, where ``local`` has them, ride it as one more summed column), the total
    norm from them (as ``out_dtype``)."""
    floats, counts = local.floats, local.counts
    clamped = local.clamped is not None
    if clamped:
        counts = torch.cat([counts, local.clamped.to(counts.device, counts.dtype)[:, None]], 1)
    if list(local.names) != list(names):  # several (device, dtype) groups: rows in the order of names
        row_of = {n: i for i, n in enumerate(local.names)}
        order = torch.tensor([row_of[n] for n in names])
        if floats.device.type != "cpu":  # pinned, so that the copy does not wait for the device
            order = order.pin_memory().to(floats.device, non_blocking=True)
        floats, counts = floats[order], counts[order]
    floats, counts = combine_rows(floats, counts, group)
    out_counts = counts[:, :-1].contiguous() if clamped else counts
    total = root(norm_accumulator(floats, out_counts, local.norm_type), local.norm_type)
    out = GradStats(list(names), floats, out_counts, local.norm_type, total.to(out_dtype))
    if clamped:
        out.clamped, out.clip_value = counts[:, -1].contiguous(), local.clip_value
    return out


class FragmentWatch(GradWatch):
    """A ``GradWatch`` of gradients held in fragments across the ranks of ``group`` (DeepSpeed
    ZeRO): ``stats`` gives the rows of the full gradients (one all-gather per call), the clip
    scales this rank's fragments. ``GradMonitor`` takes one in place of a model.

    Args:
        names: The watched parameters' names, the same on every rank.
        params: The parameters, in the order of ``names``.
        fragments: Called once per ``stats`` / clip: this step's fragments, one tensor per
            parameter in the order of ``names`` (an empty one where this rank holds none); the
            clip scales them in place, so they must be the gradients the optimizer will read,
            not copies.
        group: The process group the fragments are spread over.
        norm_type: The order of the norms (> 0, or inf).

    Attributes:
        names (list[str]): As given.
        params (list[torch.Tensor]): As given.
        group: As given.
        norm_type (float): As given.
        last_path (str | None): ``"fragments"`` after the first call.
    """

    in_pieces = True  # named_grads gives this rank's pieces of the gradients

    def __init__(self, names: list[str], params: list[torch.Tensor],
                 fragments: Callable[[], list[torch.Tensor]], group, *, norm_type: float = 2.0):
        self.norm_type = check_fragment_order(norm_type)
        self.group = group
        self.names, self.params = list(names), list(params)
        self._fragments = fragments
        self._module = None
        self._fast = None
        self._row_names = None
        self.last_path = None

    def refresh(self) -> None:
        """Nothing to resolve: the parameters are fixed, their fragments read on every call."""

    def named_grads(self) -> tuple[list[str], list[torch.Tensor]]:
        """(names, this rank's fragments of their gradients), one per watched parameter.

        Returns:
            tuple: The names and the fragments (empty tensors where this rank holds none).

        Raises:
            RuntimeError: ``fragments`` returned a list of another length than ``names``.
        """
        frags = list(self._fragments())
        if len(frags) != len(self.names):
            raise RuntimeError(f"gradfuse FragmentWatch: {len(frags)} gradient fragments for "
                               f"{len(self.names)} parameters")
        return list(self.names), frags

    def stats(self, *, rows: bool = True) -> GradStats:
        """Statistics of the full gradients (one all-gather of the rows; every rank must call it).

        Args:
            rows: Ignored: the rows are always those of the full gradients (the one collective
                carries them with the total).

        Returns:
            GradStats: Per parameter and in total, the same on every rank.
        """
        self.last_path = "fragments"
        names, frags = self.counted_grads()
        return fragment_stats(names, frags, self.norm_type, self.group)

    def counted_grads(self) -> tuple[list[str], list[torch.Tensor]]:
        """(names, the pieces whose sums over the ranks are the full gradients'): the fragments
        of ``named_grads``, each held by one rank (a ``MeshPieces`` leaves copies out)."""
        return self.named_grads()

    @torch.no_grad()
    def clip_(self, max_norm: float, error_if_nonfinite: bool = False, *, rows: bool = True) -> GradStats:
        """Clips the fragments in place so that the full gradients' total norm is at most
        ``max_norm`` (torch's coefficient, from the full total).

        Args:
            max_norm: The largest total norm; a non-negative number.
            error_if_nonfinite: Raise when the total norm is NaN or Inf, naming the parameters.
            rows: Ignored (see ``stats``).

        Returns:
            GradStats: The statistics from before clipping, with ``clip_coef`` and ``clipped``.

        Raises:
            RuntimeError: ``error_if_nonfinite=True`` and the total norm is NaN or Inf.
            ValueError: ``max_norm`` is negative or NaN.
        """
        max_norm = check_max_norm(max_norm)
        s = self.stats()
        if error_if_nonfinite:
            raise_if_nonfinite(s)
        return self.clip_to(s, max_norm)

    @torch.no_grad()
    def clip_to(self, s: GradStats, max_norm: float) -> GradStats:
        """Scales this rank's fragments by the coefficient of the full total in ``s``.

        Args:
            s: This step's statistics (``stats``).
            max_norm: The largest total norm.

        Returns:
            GradStats: ``s`` with ``clip_coef`` (and ``clipped``) set.
        """
        _names, frags = self.named_grads()
        return scale_to_max_norm(s, frags, max_norm)

    def whole_of(self, s: GradStats) -> GradStats:
        """``s``, statistics of this rank's fragments of ``named_grads`` (a clamp's, with its
        ``clamped`` counts), as those of the full gradients (``whole_stats``; every rank must
        call it)."""
        return whole_stats(s, self.names, self.group, s.plain_total_norm.dtype)

    def combine_pieces(self, sums: torch.Tensor, maxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per watched parameter, values of this rank's pieces combined into those of the full
        gradients in one all-gather (every rank must call it): ``sums`` (``[n, a]``, a
        histogram, an element count) summed over the ranks, ``maxes`` (``[n, b]``, a max |x|)
        their maximum, NaN where any rank's is.

        Returns:
            tuple: New ``[n, a]`` and ``[n, b]`` tensors of the dtypes given.
        """
        a = sums.shape[1]
        parts = all_gather_rows(torch.cat([sums.to(torch.float64), maxes.to(torch.float64)], 1), self.group)
        top = parts[:, :, a:]
        top = torch.where(top.isnan().any(0), math.nan, top.amax(0))
        return parts[:, :, :a].sum(0).to(sums.dtype), top.to(maxes.dtype)

    def scale_by(self, coef: torch.Tensor) -> bool:
        """No fast path for fragments: returns False, nothing touched (the caller scales the
        fragments of ``named_grads``).

        Args:
            coef: A 0-d tensor.

        Returns:
            bool: False.
        """
        return False

    def __repr__(self) -> str:
        return f"FragmentWatch({len(self)} parameters, norm_type={self.norm_type})"
