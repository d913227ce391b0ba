"""The multi-token prediction module of a tiny model's HF folder, as the hub's checkpoints hold it
(``toolkit tiny-model``; the converters carry it: the family's ``MTP_MODULE`` table).

transformers' Qwen3NextForCausalLM has no MTP module (it drops ``mtp.*`` on load), but the hub's
Qwen3-Next checkpoints have one, and vLLM's Qwen3NextMultiTokenPredictor reads it: ``mtp.fc``
[hidden, 2 hidden], the (1 + w) norms ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` and
``mtp.norm`` [hidden], and one gated-attention MoE decoder layer ``mtp.layers.0.*`` with
transformers' decoder-layer names (experts one by one). It is made by transformers itself: a model
one layer deeper whose extra layer is of that kind, initialised and saved by transformers (which
names the experts as checkpoints do), its last layer renamed; the fc and norms are transformers'
Linear and Qwen3NextRMSNorm, initialised by the model's own ``_init_weights``.
"""
from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

FULL = "full_attention"  # transformers' layer_types: the MTP layer is gated (softmax) attention
Init = Callable[[torch.nn.Module], None]


def _qwen3_next(config, init: Init | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    n, h, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers, deeper.layer_types = n + 1, [*config.layer_types, FULL]
    model = AutoModelForCausalLM.from_config(deeper)
    model.mtp = torch.nn.ModuleDict({"fc": torch.nn.Linear(2 * h, h, bias=False),
                                     **{k: Qwen3NextRMSNorm(h, eps=eps)
                                        for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    model.mtp.apply(model._init_weights)
    if init is not None:
        init(model)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    layer = f"model.layers.{n}."  # (transformers' save leaves mtp.* out, as its load drops them)
    return {**{f"mtp.{k}": v.detach().clone() for k, v in model.mtp.state_dict().items()},
            **{"mtp.layers.0." + k[len(layer):]: v for k, v in saved.items() if k.startswith(layer)}}


MTP_MODULES: dict[str, Callable[..., dict[str, torch.Tensor]]] = {"qwen3_next": _qwen3_next}  # by model_type


def mtp_tensors(config, init: Init | None = None) -> dict[str, torch.Tensor]:
    """{HF name ('mtp.fc.weight', 'mtp.layers.0.self_attn.q_proj.weight', ...): tensor} of the
    MTP module of a model with this transformers config ({} for a model type with none here):
    transformers' initialisation (under torch's global seed), then ``init`` on the whole deeper
    model, its ``mtp`` submodule included (tests: random norms)."""
    build = MTP_MODULES.get(config.model_type)
    return build(config, init) if build is not None else {}
