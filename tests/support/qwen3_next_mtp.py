"""A tiny Qwen3-Next HF checkpoint with its multi-token prediction module, and the MTP module's
logits computed from those HF tensors as vLLM's Qwen3NextMultiTokenPredictor does (nobody here
wrote the pieces: transformers' Qwen3NextRMSNorm, its gated-attention MoE decoder layer and
rotary embedding; the checkpoint's tensors loaded through transformers' own loader).

transformers has no MTP (Qwen3NextForCausalLM drops ``mtp.*`` on load), so the module's tensors
are added as the hub's checkpoints name them: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and one decoder layer ``mtp.layers.0.*`` (a gated-attention
MoE layer, saved by transformers from a model one layer deeper whose extra layer is that kind).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.support.convert_models import NEXT, hf_config, make_hf, randomize

FULL = "full_attention"


def _layer_types(cfg: dict) -> list[str]:
    from transformers import AutoConfig

    return list(AutoConfig.for_model("qwen3_next", **{k: v for k, v in cfg.items() if k != "model_type"}).layer_types)


def _deeper(cfg: dict, tensors: dict[str, torch.Tensor] | None, out: Path, seed: int) -> Path:
    """An HF folder of the model one layer deeper, its extra layer gated attention + MoE:
    random (``tensors`` None), else these tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    n = cfg["num_hidden_layers"]
    deeper = {**cfg, "num_hidden_layers": n + 1, "layer_types": _layer_types(cfg) + [FULL]}
    if tensors is None:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_next", **{
            k: v for k, v in deeper.items() if k != "model_type"}))
        randomize(model, seed, 0.0)
        model.save_pretrained(out)
    else:
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(deeper))
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def mtp_tensors(cfg: dict, tmp: Path, seed: int = 7) -> dict[str, torch.Tensor]:
    """The MTP module as the hub's Qwen3-Next checkpoints hold it: random, (1 + w) norms near 0."""
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    saved = load_file(_deeper(cfg, None, tmp, seed) / "model.safetensors")
    shutil.rmtree(tmp)
    prefix = f"model.layers.{n}."
    out = {"mtp.layers.0." + k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
    g = torch.Generator().manual_seed(seed)
    out.update({f"mtp.{k}.weight": 0.1 * torch.randn(h, generator=g)
                for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    out["mtp.fc.weight"] = 0.05 * torch.randn(h, 2 * h, generator=g)
    return out


def make_hf_with_mtp(out: Path) -> Path:
    """The tiny Qwen3-Next (tests.support.convert_models.NEXT) with its MTP module added."""
    make_hf("qwen3_next", out, NEXT)
    state = load_file(out / "model.safetensors")
    save_file({**state, **mtp_tensors(hf_config("qwen3_next", NEXT), out.parent / f"{out.name}-deeper")},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


def _norm(weight: torch.Tensor, eps: float):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    norm = Qwen3NextRMSNorm(weight.shape[0], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def reference_mtp_logits(hf_dir: Path, tokens: torch.Tensor, tmp: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(main hidden states after the final norm, the MTP module's logits), [batch, seq, ...]:
    h = the main model's output; e = the embedding of the next token (the last position's: token
    0, as megatron's roll_tensor fills it); fc(concat(pre_fc_norm_embedding(e),
    pre_fc_norm_hidden(h))), the decoder layer at positions 0..s-1 (causal), mtp.norm, lm_head."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(hf_dir / "model.safetensors")
    cfg = json.loads((hf_dir / "config.json").read_text())
    n, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    main = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    layer = {f"model.layers.{n}." + k[len("mtp.layers.0."):]: v for k, v in tensors.items()
             if k.startswith("mtp.layers.0.")}
    deeper = _deeper(cfg, {**main, **layer}, tmp, 0)  # transformers loads the MTP layer as its layer n
    model = AutoModelForCausalLM.from_pretrained(deeper, dtype=torch.float32, attn_implementation="eager").eval()
    b, s = tokens.shape
    pos = torch.arange(s).expand(b, s)
    with torch.no_grad():
        h = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).model(input_ids=tokens).last_hidden_state
        nxt = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
        e = model.model.embed_tokens(nxt)
        x = torch.cat([_norm(tensors["mtp.pre_fc_norm_embedding.weight"], eps)(e),
                       _norm(tensors["mtp.pre_fc_norm_hidden.weight"], eps)(h)], dim=-1) @ tensors["mtp.fc.weight"].T
        mask = torch.full((s, s), float("-inf")).triu(1).expand(b, 1, s, s)
        out = model.model.layers[n](x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=mask,
                                    position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        logits = model.lm_head(_norm(tensors["mtp.norm.weight"], eps)(out))
    return h, logits
