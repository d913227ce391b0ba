"""Qwen2 / Qwen2.5: the Llama table plus q/k/v biases (fused like the weights)."""
from __future__ import annotations

from ..fused import QKV
from . import Table, weight_table, without_output_when_tied
from .llama import ATTENTION, DENSE_MLP, EMBEDDING, HEAD, PRE_MLP_NORM

QKV_BIAS: Table = {
    "decoder.layers.{}.self_attention.linear_qkv.bias": QKV((
        "model.layers.{}.self_attn.q_proj.bias", "model.layers.{}.self_attn.k_proj.bias",
        "model.layers.{}.self_attn.v_proj.bias")),
}


@weight_table("Qwen2ForCausalLM")
def qwen2(shape) -> Table:
    return without_output_when_tied(shape, {**EMBEDDING, **ATTENTION, **QKV_BIAS, **PRE_MLP_NORM, **DENSE_MLP,
                                            **HEAD})
