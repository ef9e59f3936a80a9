"""Pictures of a run from its JSONL log: gradient flow, exponent histograms and noise scale
(:mod:`~gradfuse.viz.gradflow`), activations (:mod:`~gradfuse.viz.activations`). matplotlib is
imported on first use.

Layer: viz, above the monitor (it reads the monitor's records). Imports :mod:`gradfuse.monitor`,
:mod:`gradfuse.numerics` and :mod:`gradfuse.utils`.
"""
