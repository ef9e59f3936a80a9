"""torchtitan on the CPU with gloo and no downloads, for the torchtitan integration's tests:
``apply()`` (before torchtitan is imported) adapts torch and torchtitan 0.3.0 to a machine
without a GPU, ``make_assets`` writes a small tokenizer and data set, ``config(root, args)``
makes the ``Trainer.Config`` of the llama3 debug model.

What ``apply`` changes, and why (torchtitan assumes a GPU):
- ``torch._utils._get_available_device_type`` says "cpu" (torchtitan's device falls back to
  "cuda"; gloo is then chosen);
- ``torch.cpu`` gets the device functions torchtitan's memory monitor and process-group setup
  call (``current_device``, ``get_device_name``, ``memory_stats`` ...);
- FSDP2's reduce-scatter uses SUM and a post-divide (torchtitan's divide factor 1.0 asks for
  ``PREMUL_SUM``, which gloo lacks): the same result;
- FlexAttention (no backward on the CPU) is SDPA with the dense mask of the block mask's
  ``mask_mod`` (the per-document causal mask kept), and the block mask is built uncompiled.
"""
from __future__ import annotations

import inspect
import json
import os
import random
import sys

import torch

_WORDS = (
    "the a of and to in is was for on that with as by at from it be this an "
    "gradient norm clip model layer train step loss data token shard tensor "
    "pipeline parallel fused monitor value small large fast slow cpu device"
).split()


def make_assets(root: str) -> tuple[str, str]:
    """Create ``root/tokenizer`` (HF tokenizer.json + tokenizer_config.json)
    and ``root/c4_test/data.json`` (JSONL with a ``text`` field, what
    ``load_dataset(path, split="train")`` in text_datasets.py reads)."""
    tok_dir = os.path.join(root, "tokenizer")
    data_dir = os.path.join(root, "c4_test")
    data_file = os.path.join(data_dir, "data.json")
    rng = random.Random(0)
    docs = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 200))) + "."
        for _ in range(200)
    ]
    if not os.path.exists(data_file):
        os.makedirs(data_dir, exist_ok=True)
        tmp = f"{data_file}.{os.getpid()}"
        with open(tmp, "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        os.replace(tmp, data_file)
    if not os.path.exists(os.path.join(tok_dir, "tokenizer_config.json")):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=512,  # must stay <= debugmodel vocab_size (2048)
            special_tokens=[bos, eos],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(docs, trainer=trainer)
        os.makedirs(tok_dir, exist_ok=True)
        tmp = os.path.join(tok_dir, f"tokenizer.json.{os.getpid()}")
        tok.save(tmp)
        os.replace(tmp, os.path.join(tok_dir, "tokenizer.json"))
        cfg = {"bos_token": bos, "eos_token": eos, "add_bos_token": True,
               "add_eos_token": False}
        tmp = os.path.join(tok_dir, f"tokenizer_config.json.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(cfg, f)
        os.replace(tmp, os.path.join(tok_dir, "tokenizer_config.json"))
    return tok_dir, data_dir


_applied = False


def _sdpa_flex_attn(q, k, v, *, score_mod=None, block_mask=None, scale=None,
                    enable_gqa=False, return_aux=None, kernel_options=None):
    """Drop-in for FlexAttention._compiled_flex_attn: SDPA with the dense
    boolean mask materialised from block_mask.mask_mod (causal + per-doc)."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None, "score_mod not supported by the CPU shim"
    assert return_aux is None or not return_aux.lse, "lse not supported"
    B, _, Lq, _ = q.shape
    Lkv = k.shape[2]
    mask = create_mask(block_mask.mask_mod, B, None, Lq, Lkv, device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out, AuxOutput()


def apply() -> None:
    """Adapts torch and torchtitan to the CPU (the module docstring says what and why); before
    torchtitan is imported, once per process."""
    global _applied
    if _applied:
        return
    _applied = True
    assert "torchtitan" not in sys.modules, "apply() must run before torchtitan is imported"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    torch._utils._get_available_device_type = lambda: "cpu"

    class Props:
        total_memory = 1 << 40

    cpu = torch.cpu
    cpu.current_device = lambda: 0
    cpu.get_device_name = lambda *a, **k: "cpu"
    cpu.get_device_properties = lambda *a, **k: Props()
    cpu.memory_stats = lambda *a, **k: {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                                        "num_alloc_retries": 0, "num_ooms": 0}
    cpu.reset_peak_memory_stats = lambda *a, **k: None
    cpu.empty_cache = lambda *a, **k: None

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    factors, signature = fc._get_gradient_divide_factors, inspect.signature(fc._get_gradient_divide_factors)

    def sum_only(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["force_sum_reduction_for_comms"] = True
        return factors(*bound.args, **bound.kwargs)

    fc._get_gradient_divide_factors = sum_only

    import torchtitan.models.common.attention as attn
    import torchtitan.models.common.decoder as decoder
    from torch.nn.attention.flex_attention import create_block_mask

    attn.FlexAttention._compiled_flex_attn = staticmethod(_sdpa_flex_attn)
    attn.create_attention_mask = decoder.create_attention_mask = create_block_mask


DEFAULT_ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "4",
                "--training.seq-len", "64", "--training.local-batch-size", "2",
                "--training.mixed-precision-param", "float32",
                "--parallelism.pipeline-parallel-microbatch-size", "1", "--training.disable-cuda-graphs",
                "--metrics.log-freq", "1", "--debug.seed", "0"]


def config(root: str, args: list[str]):
    """The ``Trainer.Config`` of torchtitan's llama3 debug model with the assets of ``root``,
    ``DEFAULT_ARGS`` and ``args`` (torchtitan's command-line options)."""
    apply()
    tok_dir, data_dir = make_assets(root)
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(DEFAULT_ARGS + ["--hf-assets-path", tok_dir, "--dataloader.dataset-path",
                                                      data_dir, "--dump-folder", os.path.join(root, "outputs"),
                                                      *args])
