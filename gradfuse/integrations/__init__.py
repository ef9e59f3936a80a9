"""Where training loops live: plain PyTorch (``gradfuse.attach``), PyTorch Lightning
(``gradfuse.integrations.lightning.GradfuseCallback``) and the Hugging Face Trainer
(``gradfuse.integrations.transformers.attach``). Each module imports its framework only when it
is imported itself.

Layer: integrations, above the monitor. Imports ``gradfuse.monitor``, ``gradfuse.clip``,
``gradfuse.dynamics`` and ``gradfuse.utils``.
"""
