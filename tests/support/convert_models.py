"""Tiny HF checkpoints made on the fly with transformers, from the registry's tiny configs.

Every parameter is random (norm weights around 1, biases non-zero) so that a mis-mapped
norm or bias changes the logits; the vocabulary is 500 so Megatron pads it (512 at tp 1,
2 and 4), exercising the padding and its removal on export.
"""
from __future__ import annotations

from pathlib import Path

import torch

from toolkit.models import named_models, shape_from_hf

VOCAB = 500
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}

# name -> (registry tiny model, config overrides, dtype the weights are saved in)
DENSE = {
    "llama": ("llama-tiny", {}, torch.float32),
    "llama31": ("llama-tiny", {"rope_parameters": LLAMA31_ROPE, "rope_theta": None, "max_position_embeddings": 131072},
                torch.float32),
    "mistral": ("mistral-tiny", {}, torch.bfloat16),
    "qwen2": ("qwen2-tiny", {}, torch.float32),  # q/k/v bias, tied embeddings
    "qwen3": ("qwen3-tiny", {}, torch.float32),  # q/k norm, head_dim 32 != hidden/heads
    # sliding window 16 on 4 of 6 layers with their own rope base, linear rope 8 on the others, (1 + w)
    # norms before and after attention and MLP, tanh-GeGLU, embeddings x sqrt(hidden), tied
    "gemma3": ("gemma3-tiny", {}, torch.float32),
}


# Mixtral (4 experts, top-2); Qwen2-MoE (shared expert + sigmoid gate, softmax before top-k,
# layer 2 left dense by mlp_only_layers); Qwen3-MoE (8 fine-grained experts, q/k norm,
# renormalised top-k); GLM-4.5 (GQA with q/k/v biases and q/k norm, heads x head_dim = 2 x hidden,
# rope on half of each head, a dense first layer, shared expert, sigmoid router with a random
# expert bias and routed scaling 2.5).
MOE = {
    "mixtral": ("mixtral-tiny", {}, torch.float32),
    "qwen2_moe": ("qwen2-moe-tiny", {"mlp_only_layers": [2]}, torch.float32),
    "qwen3_moe": ("qwen3-moe-tiny", {}, torch.bfloat16),
    "glm4_moe": ("glm4-moe-tiny", {}, torch.float32),
    # GPT-OSS: attention sinks, sliding window 16 on layers 0 and 2, q/k/v/o, router and expert
    # biases, clamped SwiGLU with +1 (limit 0.5), yarn rope, experts stored as 3-D tensors (converters.packed)
    "gpt_oss": ("gpt-oss-tiny", {"swiglu_limit": 0.5}, torch.float32),  # the clamp cuts ~1 in 5 of the tiny values
}
ALL = {**DENSE, **MOE}
# Qwen3-Next (gated delta net layers 1-3, gated attention 4, (1 + w) norms but a w gated norm,
# 8 experts + a gated shared expert): converted at tp 1 in the legacy format only so far, so
# tested on its own (tests/toolkit/models/families/test_qwen3_next.py), not in MOE's layouts
NEXT = {"qwen3_next": ("qwen3-next-tiny", {}, torch.float32)}
# MoE models whose experts have biases: megatron-core builds them only at etp=1 (tp > 1 needs ep > 1)
BIASED = ("gpt_oss",)


def hf_config(name: str, variants: dict = ALL) -> dict:
    base, over, _ = variants[name]
    cfg = dict(named_models()[base]["config"], vocab_size=VOCAB)
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def randomize(model: torch.nn.Module, seed: int, norm_centre: float = 1.0, plain_norms: frozenset = frozenset()) -> None:
    """Random weights; norm weights ``norm_centre`` + noise (0 for norms applying (1 + w), Gemma's:
    their scale is then around 1 too), around 1 for the ``plain_norms`` (HF names) of such a
    model that apply w (Qwen3-Next's gated delta net norm)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            centre = 1.0 if name in plain_norms else norm_centre
            p.copy_(centre + 0.1 * noise if "norm" in name else 0.05 * noise)
        for name, buf in model.named_buffers():  # a sigmoid router's expert bias: it must change the routing
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))


def plain_norms(shape) -> frozenset:
    """HF norm weights megatron stores minus 1 (a weight table's shift): they apply w, not (1 + w)."""
    from converters.mapping import ModelMap

    padded = -(-shape.vocab_size // 128) * 128  # (only the names matter here)
    return frozenset(t.entry.hf[0] for t in ModelMap(shape, padded).tensors if t.entry.mapping.shift)


def make_hf(name: str, out: Path, variants: dict = ALL, seed: int = 0) -> Path:
    """Save a randomly initialised tiny model of this variant to ``out`` (safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = hf_config(name, variants)
    model_type = cfg.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    shape = shape_from_hf({**cfg, "model_type": model_type})
    randomize(model, seed, 0.0 if shape.zero_centered_norm else 1.0, plain_norms(shape))
    dtype = variants[name][2]
    model.to(dtype).save_pretrained(out)
    return out
