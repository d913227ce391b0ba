"""Qwen2-MoE: Qwen2 attention (q/k/v bias); MoE layers have routed experts plus a shared
expert behind a sigmoid gate; layers left dense by decoder_sparse_step / mlp_only_layers
keep the Llama MLP."""
from __future__ import annotations

from ..fused import MOE, Gated, Replicated, Row
from . import Table, weight_table, without_output_when_tied
from .llama import ATTENTION, DENSE_MLP, EMBEDDING, HEAD, PRE_MLP_NORM
from .qwen2 import QKV_BIAS

ROUTED: Table = {
    "decoder.layers.{}.mlp.router.weight": Replicated("model.layers.{}.mlp.gate.weight", dims=("experts", "hidden"),
                                                      scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight": Gated((
        "model.layers.{}.mlp.experts.{}.gate_proj.weight", "model.layers.{}.mlp.experts.{}.up_proj.weight"),
        ffn="expert_ffn", scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight": Row(
        "model.layers.{}.mlp.experts.{}.down_proj.weight", dims=("hidden", "expert_ffn"), scope=MOE),
}

SHARED: Table = {
    "decoder.layers.{}.mlp.shared_experts.gate_weight": Replicated("model.layers.{}.mlp.shared_expert_gate.weight",
                                                                   dims=(1, "hidden"), scope=MOE),
    "decoder.layers.{}.mlp.shared_experts.linear_fc1.weight": Gated((
        "model.layers.{}.mlp.shared_expert.gate_proj.weight", "model.layers.{}.mlp.shared_expert.up_proj.weight"),
        ffn="shared_ffn", scope=MOE),
    "decoder.layers.{}.mlp.shared_experts.linear_fc2.weight": Row(
        "model.layers.{}.mlp.shared_expert.down_proj.weight", dims=("hidden", "shared_ffn"), scope=MOE),
}


@weight_table("Qwen2MoeForCausalLM")
def qwen2_moe(shape) -> Table:
    return without_output_when_tied(shape, {**EMBEDDING, **ATTENTION, **QKV_BIAS, **PRE_MLP_NORM, **DENSE_MLP,
                                            **ROUTED, **SHARED, **HEAD})
