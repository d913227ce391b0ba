"""Llama 2 / 3 / 3.1 and Mistral: the base table the other dense families extend.

Megatron (local spec) <- HF. Order = megatron-core's module order (state_dict order).
"""
from __future__ import annotations

from ..fused import DENSE, QKV, Gated, Replicated, Row, Vocab
from . import Table, weight_table, without_output_when_tied

EMBEDDING: Table = {"embedding.word_embeddings.weight": Vocab("model.embed_tokens.weight")}

ATTENTION: Table = {
    "decoder.layers.{}.input_layernorm.weight": Replicated("model.layers.{}.input_layernorm.weight"),
    "decoder.layers.{}.self_attention.linear_proj.weight": Row("model.layers.{}.self_attn.o_proj.weight",
                                                               dims=("hidden", "q")),
    "decoder.layers.{}.self_attention.linear_qkv.weight": QKV((
        "model.layers.{}.self_attn.q_proj.weight", "model.layers.{}.self_attn.k_proj.weight",
        "model.layers.{}.self_attn.v_proj.weight")),
}

PRE_MLP_NORM: Table = {
    "decoder.layers.{}.pre_mlp_layernorm.weight": Replicated("model.layers.{}.post_attention_layernorm.weight"),
}

DENSE_MLP: Table = {
    "decoder.layers.{}.mlp.linear_fc1.weight": Gated(("model.layers.{}.mlp.gate_proj.weight",
                                                      "model.layers.{}.mlp.up_proj.weight"), scope=DENSE),
    "decoder.layers.{}.mlp.linear_fc2.weight": Row("model.layers.{}.mlp.down_proj.weight", scope=DENSE),
}

HEAD: Table = {
    "decoder.final_layernorm.weight": Replicated("model.norm.weight"),
    "output_layer.weight": Vocab("lm_head.weight"),
}


@weight_table("LlamaForCausalLM", "MistralForCausalLM")
def llama(shape) -> Table:
    return without_output_when_tied(shape, {**EMBEDDING, **ATTENTION, **PRE_MLP_NORM, **DENSE_MLP, **HEAD})
