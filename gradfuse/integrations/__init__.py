"""Where training loops live: plain PyTorch (``gradfuse.attach``), PyTorch Lightning
(``gradfuse.integrations.lightning.GradfuseCallback``, in the clipping path of Lightning's precision
plugin: ``gradfuse.integrations.lightning_clip_path``), the Hugging Face Trainer
(``gradfuse.integrations.transformers.attach``), DeepSpeed (``gradfuse.integrations.deepspeed``)
and torchtitan (``gradfuse.integrations.torchtitan``); ``gradfuse.integrations.step_gate`` is how
they skip a step. Each module imports its framework only when it
is imported itself.

Layer: integrations, above the monitor. Imports ``gradfuse.monitor``, ``gradfuse.clip``,
``gradfuse.dynamics`` and ``gradfuse.utils``.
"""
