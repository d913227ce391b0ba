"""Qwen3: the Llama table plus per-head q/k RMSNorm (megatron's q_layernorm / k_layernorm)."""
from __future__ import annotations

from ..fused import Replicated
from . import Table, weight_table, without_output_when_tied
from .llama import ATTENTION, DENSE_MLP, EMBEDDING, HEAD, PRE_MLP_NORM

QK_NORM: Table = {
    "decoder.layers.{}.self_attention.q_layernorm.weight": Replicated("model.layers.{}.self_attn.q_norm.weight",
                                                                      dims=("head_dim",)),
    "decoder.layers.{}.self_attention.k_layernorm.weight": Replicated("model.layers.{}.self_attn.k_norm.weight",
                                                                      dims=("head_dim",)),
}


@weight_table("Qwen3ForCausalLM")
def qwen3(shape) -> Table:
    return without_output_when_tied(shape, {**EMBEDDING, **ATTENTION, **QK_NORM, **PRE_MLP_NORM, **DENSE_MLP,
                                            **HEAD})
