"""Where training loops live: plain PyTorch (``gradfuse.attach``), PyTorch Lightning
(``gradfuse.integrations.lightning.GradfuseCallback``, in the clipping path of Lightning's precision
plugin: ``gradfuse.integrations.lightning_clip_path``) and the Hugging Face Trainer
(``gradfuse.integrations.transformers.attach``). Each module imports its framework only when it
is imported itself.

Layer: integrations, above the monitor. Imports ``gradfuse.monitor``, ``gradfuse.clip``,
``gradfuse.dynamics`` and ``gradfuse.utils``.
"""
