"""Gradients spread over a whole world of ranks, as torchtitan spreads them: DTensors sharded
over some mesh dimensions (FSDP2, tensor parallel) and replicated over others, and the
parameters of a pipeline split between its stages (each rank holds some of them only).

``MeshPieces`` is a ``FragmentWatch`` over the names of every parameter of the model (every
rank's, in the same order on every rank): for each, this rank's piece of the full gradient is
its local shard, counted once over the ranks that hold copies of it (a replicated dimension:
the rank at coordinate 0 of that dimension; a plain tensor: the lowest rank holding it), or
nothing. The rows of the full gradients then follow from every rank's rows in one all-gather
over the world (``gradfuse.core.fragments``); the clip scales every local shard, copies
included.

Layer: core. Imports the core's fragments.
"""
from __future__ import annotations

import torch

from gradfuse.core.fragments import FragmentWatch

# Module wrappers whose names torch inserts in parameter names (activation checkpointing,
# torch.compile): left out of the names the records show.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """``name`` without the names of module wrappers (``_checkpoint_wrapped_module.`` ...)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _counts_here(p: torch.Tensor) -> bool | None:
    """Whether this rank's local shard of DTensor ``p`` counts towards the full gradient (it is at
    coordinate 0 of every dimension ``p`` is replicated over); None for a plain tensor.

    Raises:
        ValueError: a placement that is neither a shard nor a replica (a pending reduction).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return None
    here = True
    for dim, placement in enumerate(p.placements):
        if placement.is_replicate():
            here = here and p.device_mesh.get_local_rank(dim) == 0
        elif not (placement.is_shard() or hasattr(placement, "split_factor")):  # _StridedShard: a shard too
            raise ValueError(f"gradfuse: a parameter placed {placement} over its mesh dimension {dim}: only "
                             "sharded and replicated parameters are supported")
    return here


class MeshPieces(FragmentWatch):
    """A ``FragmentWatch`` of every parameter of a model whose gradients are spread over the
    ranks of ``group`` (see the module docstring). Every rank makes it with its own named
    parameters, at the same point: the names are gathered once (one collective).

    Args:
        named: This rank's (name, parameter) pairs (names as in the whole model).
        group: The process group of every rank holding any of the model (the world).
        norm_type: The order of the norms (> 0, or inf).
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]], group, *, norm_type: float = 2.0):
        import torch.distributed as dist

        mine = [(n, _counts_here(p)) for n, p in named]
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        names, first_holder = [], {}
        for rank, pairs in enumerate(every):  # rank by rank: the first stage's names first
            for n, _ in pairs:
                if n not in first_holder:
                    first_holder[n] = rank
                    names.append(n)
        rank = dist.get_rank(group)
        self._local = dict(named)
        self._counted = {n: (first_holder[n] == rank if here is None else here) for n, here in mine}
        super().__init__([clean_name(n) for n in names], [self._local.get(n) for n in names], self._pieces,
                         group, norm_type=norm_type)
        self._full_names = names
        self._empty: dict = {}
        self._checked: set[str] = set()

    def _grad(self, name: str, counted_only: bool) -> torch.Tensor:
        p = self._local.get(name)
        g = None if p is None else p.grad
        if g is not None and name not in self._checked:  # the copies counted as the parameter's placements say
            if getattr(g, "placements", None) != getattr(p, "placements", None):
                raise ValueError(f"gradfuse: the gradient of {clean_name(name)!r} is placed {g.placements}, its "
                                 f"parameter {p.placements}: only gradients placed as their parameters are supported")
            self._checked.add(name)
        if g is None or (counted_only and not self._counted[name]):
            like = p if p is not None else next(iter(self._local.values()))
            key = (like.dtype, like.device)
            if key not in self._empty:
                self._empty[key] = torch.empty(0, dtype=like.dtype, device=like.device)
            return self._empty[key]
        return g.to_local() if hasattr(g, "to_local") else g

    def _pieces(self) -> list[torch.Tensor]:
        return [self._grad(n, counted_only=False) for n in self._full_names]

    def counted_grads(self) -> tuple[list[str], list[torch.Tensor]]:
        """(names, this rank's pieces): each local shard where it counts, else an empty tensor."""
        return list(self.names), [self._grad(n, counted_only=True) for n in self._full_names]

    @property
    def local_names(self) -> list[str]:
        """The names (as ``names`` shows them) of the parameters this rank holds."""
        return [clean_name(n) for n in self._full_names if n in self._local]
