"""Mixtral: Llama attention, every MLP a MoE layer (router ``gate``, experts w1/w3/w2)."""
from __future__ import annotations

from ..fused import MOE, Gated, Replicated, Row
from . import Table, weight_table, without_output_when_tied
from .llama import ATTENTION, EMBEDDING, HEAD, PRE_MLP_NORM

MOE_MLP: Table = {
    "decoder.layers.{}.mlp.router.weight": Replicated("model.layers.{}.block_sparse_moe.gate.weight",
                                                      dims=("experts", "hidden"), scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight": Gated((
        "model.layers.{}.block_sparse_moe.experts.{}.w1.weight", "model.layers.{}.block_sparse_moe.experts.{}.w3.weight"),
        ffn="expert_ffn", scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight": Row(
        "model.layers.{}.block_sparse_moe.experts.{}.w2.weight", dims=("hidden", "expert_ffn"), scope=MOE),
}


@weight_table("MixtralForCausalLM")
def mixtral(shape) -> Table:
    return without_output_when_tied(shape, {**EMBEDDING, **ATTENTION, **PRE_MLP_NORM, **MOE_MLP, **HEAD})
