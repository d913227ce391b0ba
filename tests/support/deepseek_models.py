"""Tiny DeepSeek-V2 / V3 HF checkpoints made on the fly with transformers (random weights,
norms around 1, V3's expert bias non-zero so it changes the routing), optionally with MTP
modules (transformers has no MTP: its tensors are added as DeepSeek's checkpoint names
them) or stored as FP8 with 128x128 block scales.

3 decoder layers (the first dense), so pp=2 splits unevenly (2 + 1); yarn rope with a short
original context so its frequencies matter at 64 tokens; rms_norm_eps 1e-6 (transformers'
latent norms use 1e-6 whatever it says); vocabulary 500 (megatron pads it).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.models import named_models

from tests.support.convert_models import VOCAB, randomize

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
COMMON = {"vocab_size": VOCAB, "num_hidden_layers": 3, "rms_norm_eps": 1e-6, "rope_parameters": YARN,
          "max_position_embeddings": 128, "rope_theta": None}
# V3: q LoRA, sigmoid scores + expert bias, 8 experts in 2 groups (1 chosen; top-2 sums as
# megatron's topk // group_topk = 2); V2: V2-Lite's form (no q LoRA, softmax, no renormalisation)
# Kimi-K2: V3 at Kimi's settings (no groups, yarn with beta_fast = beta_slow = 1: its own rope)
DEEPSEEK = {
    "deepseek_v3": ("deepseek-v3-tiny", COMMON, torch.float32),
    "deepseek_v2": ("deepseek-v2-tiny", COMMON, torch.float32),
    "kimi_k2": ("kimi-k2-tiny", {k: v for k, v in COMMON.items() if not k.startswith("rope_")}, torch.float32),
}


def hf_config(name: str) -> dict:
    base, over, _ = DEEPSEEK[name]
    cfg = dict(named_models()[base]["config"], **over)
    return {k: v for k, v in cfg.items() if not (v is None and k in over)}  # q_lora_rank null stays


def _model(cfg: dict, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
    return model


def mtp_tensors(cfg: dict, state: dict[str, torch.Tensor], tmp: Path, seed: int = 7) -> dict[str, torch.Tensor]:
    """One MTP module as DeepSeek-V3's checkpoint holds it (HF layer num_hidden_layers): a
    decoder layer (from a model one layer deeper, as transformers saves it), enorm, hnorm,
    eh_proj, shared_head.norm, and copies of the embedding and the head."""
    import shutil

    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    _model({**cfg, "num_hidden_layers": n + 1}, seed).save_pretrained(tmp)
    out = {k: v for k, v in _saved(tmp).items() if k.startswith(f"model.layers.{n}.")}
    shutil.rmtree(tmp)
    g = torch.Generator().manual_seed(seed)
    out.update({f"model.layers.{n}.{k}.weight": 1 + 0.1 * torch.randn(h, generator=g)
                for k in ("enorm", "hnorm", "shared_head.norm")})
    out[f"model.layers.{n}.eh_proj.weight"] = 0.05 * torch.randn(h, 2 * h, generator=g)
    out[f"model.layers.{n}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    out[f"model.layers.{n}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    return out


def make_hf(name: str, out: Path, *, mtp: bool = False, seed: int = 0, overrides: dict | None = None) -> Path:
    """Save a random tiny model of this variant to ``out`` (safetensors + config.json)."""
    from safetensors.torch import save_file

    cfg = {**hf_config(name), **(overrides or {})}
    model = _model(cfg, seed)
    model.to(DEEPSEEK[name][2]).save_pretrained(out)
    if mtp:
        state = _saved(out)
        save_file({**state, **mtp_tensors(cfg, state, out.parent / f"{out.name}-deeper")}, out / "model.safetensors",
                  metadata={"format": "pt"})
    return out


def _saved(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(d / "model.safetensors")


def quantize_fp8(src: Path, out: Path, block: int = 128) -> Path:
    """``src`` stored as DeepSeek-V3's official checkpoint is: every linear weight of the
    decoder layers (not the router) as float8 e4m3 with a float32 ``weight_scale_inv`` per
    block (amax / 448 per block), the rest bf16 but the expert bias (fp32);
    quantization_config set."""
    from safetensors.torch import save_file

    out.mkdir()
    tensors = {}
    for k, v in _saved(src).items():
        kept = ("mlp.gate.weight", "embed_tokens.weight", "head.weight")  # bf16 in DeepSeek's checkpoint
        if ".layers." in k and v.dim() == 2 and not k.endswith(kept):
            tensors[k], tensors[k + "_scale_inv"] = _quantize(v.float(), block)
        else:
            tensors[k] = v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text((src / "generation_config.json").read_text())
    return out


def _quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(br, block, bc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(br * block, bc * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float().contiguous()
