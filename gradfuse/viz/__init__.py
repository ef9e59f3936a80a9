"""Pictures of a run from its JSONL log: gradient flow, exponent histograms and noise scale
(``gradfuse.viz.gradflow``), activations (``gradfuse.viz.activations``), the optimizer's updates
(``gradfuse.viz.updates``); and the diagnosis of a
flight-recorder dump, as data, text and a picture (``gradfuse.viz.explain``, with its bands in
``gradfuse.viz.bands`` and its picture in ``gradfuse.viz.explain_plot``). matplotlib is imported on
first use.

Layer: viz, above the monitor (it reads the monitor's records). Imports ``gradfuse.monitor``,
``gradfuse.numerics`` and ``gradfuse.utils``.
"""
