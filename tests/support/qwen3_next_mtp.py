"""A tiny Qwen3-Next HF checkpoint with its multi-token prediction module, and the MTP module's
logits computed from those HF tensors as vLLM's Qwen3NextMultiTokenPredictor does (nobody here
wrote the pieces: transformers' Qwen3NextRMSNorm, its gated-attention MoE decoder layer and
rotary embedding; the checkpoint's tensors loaded through transformers' own loader).

transformers has no MTP (Qwen3NextForCausalLM drops ``mtp.*`` on load), so the module's tensors
are added as the hub's checkpoints name them, by toolkit.runtime.tiny_mtp (what `toolkit tiny-model`
writes), every weight random here (norms near 0: they apply (1 + w)).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from toolkit.runtime.tiny_mtp import FULL

from tests.support.convert_models import NEXT, make_hf, randomize


def _layer_types(cfg: dict) -> list[str]:
    from transformers import AutoConfig

    return list(AutoConfig.for_model("qwen3_next", **{k: v for k, v in cfg.items() if k != "model_type"}).layer_types)


def _deeper(cfg: dict, tensors: dict[str, torch.Tensor], out: Path) -> Path:
    """An HF folder of the model one layer deeper, its extra layer (gated attention + MoE) holding
    the MTP module's decoder layer: these tensors."""
    n = cfg["num_hidden_layers"]
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n + 1,
                                                 "layer_types": _layer_types(cfg) + [FULL]}))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def make_hf_with_mtp(out: Path, seed: int = 7) -> Path:
    """The tiny Qwen3-Next (tests.support.convert_models.NEXT) with its MTP module added, random."""
    from transformers import AutoConfig

    from toolkit.runtime.tiny_mtp import mtp_tensors  # what `toolkit tiny-model` adds

    make_hf("qwen3_next", out, NEXT)
    state = load_file(out / "model.safetensors")
    mtp = mtp_tensors(AutoConfig.from_pretrained(out), lambda model: randomize(model, seed, 0.0))
    save_file({**state, **mtp}, out / "model.safetensors", metadata={"format": "pt"})
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
    deeper = _deeper(cfg, {**main, **layer}, tmp)  # transformers loads the MTP layer as its layer n
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
