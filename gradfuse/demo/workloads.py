"""Parameter sets with the shapes of real models, for the demo and the benchmarks (no downloads).

Each function returns ``[(name, shape), ...]``; ``make_grads`` turns one into parameters with
random (never zero) gradients.
"""
from __future__ import annotations

import math

import torch
from torch import nn

Shapes = list[tuple[str, tuple[int, ...]]]


def gpt2_small(layers: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> Shapes:
    """GPT-2 small: 124M parameters in 148 tensors."""
    s: Shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(layers):
        p = f"h.{i}."
        s += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
              (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
              (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
              (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
              (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
              (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]
    return s + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def llama_1b(layers: int = 16, d: int = 2048, ffn: int = 8192, kv: int = 512,
             vocab: int = 128256) -> Shapes:
    """A Llama-3.2-1B-style configuration: 1.24B parameters in 146 tensors (tied embedding)."""
    s: Shapes = [("embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        p = f"layers.{i}."
        s += [(p + "input_layernorm.weight", (d,)),
              (p + "self_attn.q_proj.weight", (d, d)), (p + "self_attn.k_proj.weight", (kv, d)),
              (p + "self_attn.v_proj.weight", (kv, d)), (p + "self_attn.o_proj.weight", (d, d)),
              (p + "post_attention_layernorm.weight", (d,)),
              (p + "mlp.gate_proj.weight", (ffn, d)), (p + "mlp.up_proj.weight", (ffn, d)),
              (p + "mlp.down_proj.weight", (d, ffn))]
    return s + [("norm.weight", (d,))]


def resnet50() -> Shapes:
    """ResNet-50: 25.6M parameters in 161 tensors, many of them small BatchNorm vectors."""
    s: Shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for stage, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}."
            s += [(p + "conv1.weight", (planes, inplanes, 1, 1)), (p + "bn1.weight", (planes,)),
                  (p + "bn1.bias", (planes,)), (p + "conv2.weight", (planes, planes, 3, 3)),
                  (p + "bn2.weight", (planes,)), (p + "bn2.bias", (planes,)),
                  (p + "conv3.weight", (planes * 4, planes, 1, 1)),
                  (p + "bn3.weight", (planes * 4,)), (p + "bn3.bias", (planes * 4,))]
            if b == 0:
                s += [(p + "downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                      (p + "downsample.1.weight", (planes * 4,)), (p + "downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    return s + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def many_small(count: int = 10_000, lo: int = 1024, hi: int = 4096, seed: int = 0) -> Shapes:
    """``count`` tensors of ``lo``..``hi`` elements: per-tensor overhead dominates."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [(f"p.{i}", (n,)) for i, n in enumerate(sizes)]


def tiny(count: int = 10_000, lo: int = 4, hi: int = 16, seed: int = 0) -> Shapes:
    """``count`` gradients of ``lo``..``hi`` elements: the data is negligible, what a step costs
    is per-parameter host work."""
    return many_small(count, lo, hi, seed)


def few_large(count: int = 4, numel: int = 32 * 2**20) -> Shapes:
    """A handful of tensors of tens of millions of elements: bandwidth dominates."""
    return [(f"big.{i}", (numel,)) for i in range(count)]


WORKLOADS = {"gpt2_small": gpt2_small, "llama_1b": llama_1b, "resnet50": resnet50,
             "many_small": many_small, "tiny": tiny, "few_large": few_large}


def numel(shapes: Shapes) -> int:
    """The total number of elements of ``shapes``."""
    return sum(math.prod(s) for _, s in shapes)


def make_grads(shapes: Shapes, dtype: torch.dtype = torch.float32, device="cpu",
               seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    """Parameters (storage-free placeholders) with random gradients in (-1, 1), never zero."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for name, shape in shapes:
        grad = torch.rand(shape, generator=g, dtype=dtype, device=device)
        grad.mul_(2).sub_(1).add_(1e-3)  # exact zeros are counted; keep them out
        # The parameter's values are never read: a zero-stride view of one element gives it the
        # gradient's shape without the memory.
        p = nn.Parameter(torch.zeros((), dtype=dtype, device=device).expand(shape))
        p.grad = grad
        out.append((name, p))
    return out
