"""The core every capability builds on: the parameters and arguments of a call
(:mod:`~gradfuse.core.params`), grouping by (device, dtype) (:mod:`~gradfuse.core.grouping`), the
arithmetic of norms and clip coefficients (:mod:`~gradfuse.core.norms`), DTensor, sharded and
``group=`` reductions (:mod:`~gradfuse.core.distributed`, :mod:`~gradfuse.core.sharded`), the
per-tensor paths the kernels do not serve (:mod:`~gradfuse.core.slow_paths`), the fused-stats
engine (:mod:`~gradfuse.core.engine`) and its result :class:`~gradfuse.core.grad_stats.GradStats`,
the list walk in C++ (:mod:`~gradfuse.core.walk_cache`), the entry calls
(:mod:`~gradfuse.core.entry`), the watch handle (:mod:`~gradfuse.core.watch`) and the AMP unscale
(:mod:`~gradfuse.core.amp`).

Layer: core. Imports :mod:`gradfuse.ops` and :mod:`gradfuse.utils`, never a capability, the
monitor or an integration.
"""
