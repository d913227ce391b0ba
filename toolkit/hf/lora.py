"""The spec's ``finetune`` section on the Hugging Face Trainer's path: peft's ``get_peft_model``.

The same section as the recipes' runtime (toolkit.runtime.lora): rank, alpha, dropout and the
targets by megatron's names, here turned into the Hugging Face modules that hold those weights
by the family's weight table (linear_qkv -> q_proj, k_proj, v_proj; linear_proj -> o_proj;
linear_fc1 -> gate_proj, up_proj; linear_fc2 -> down_proj for Llama). One difference follows
from the modules: peft gives each HF module its own A, so q, k and v (and gate, up) each have
an A where megatron's fused layer has one shared A; the memory estimate counts each path's
own adapters (toolkit.models.params.lora_weights).
"""
from __future__ import annotations

from typing import Any

from ..models import ModelShape


def hf_target_modules(shape: ModelShape, targets: tuple[str, ...]) -> list[str]:
    """The HF modules holding the megatron targets' weights, from the family's weight table, as
    patterns with ``{}`` for the layer ('model.layers.{}.self_attn.q_proj'); experts excluded."""
    from ..models.family import table_for

    names = []
    for pattern, mapping in table_for(shape).items():
        if not (pattern.startswith("decoder.layers.{}.") and pattern.endswith(".weight")) or "experts" in pattern:
            continue
        if pattern.removesuffix(".weight").rsplit(".", 1)[-1] in targets:
            names += [hf.removesuffix(".weight") for hf in mapping.hf]
    return names


def target_regex(modules: list[str]) -> str:
    """peft's target_modules as one regular expression (peft full-matches a string against each
    module name), so exactly these modules get adapters (not experts of the same name)."""
    import re

    return "|".join(re.escape(m).replace(r"\{\}", r"\d+") for m in modules)


def peft_config(spec, shape: ModelShape) -> Any:
    """peft's LoraConfig for the spec's finetune.lora (B starts at zero, A as nn.Linear draws it)."""
    from peft import LoraConfig

    lora = spec.finetune.lora
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                      target_modules=target_regex(hf_target_modules(shape, lora.targets)), task_type="CAUSAL_LM")


def with_adapters(model, plan) -> Any:
    """The model wrapped by peft's get_peft_model when the spec says finetune.method lora."""
    if plan.spec.finetune.method != "lora":
        return model
    from peft import get_peft_model

    return get_peft_model(model, peft_config(plan.spec, plan.shape))
