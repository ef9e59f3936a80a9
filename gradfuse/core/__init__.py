"""The core every capability builds on: the parameters and arguments of a call
(``gradfuse.core.params``), grouping by (device, dtype) (``gradfuse.core.grouping``), the
arithmetic of norms and clip coefficients (``gradfuse.core.norms``), DTensor, sharded and
``group=`` reductions (``gradfuse.core.distributed``, ``gradfuse.core.sharded``), the
per-tensor paths the kernels do not serve (``gradfuse.core.slow_paths``), the fused-stats
engine (``gradfuse.core.engine``) and its result ``gradfuse.core.grad_stats.GradStats`` (its text
and HTML tables: ``gradfuse.core.stats_table``), the list walk in C++
(``gradfuse.core.walk_cache``), the entry calls (``gradfuse.core.entry``), the watch handle
(``gradfuse.core.watch``) and the AMP unscale (``gradfuse.core.amp``).

Layer: core. Imports ``gradfuse.ops`` and ``gradfuse.utils``, never a capability, the
monitor or an integration.
"""
