"""Qwen3-MoE: Qwen3 attention (q/k norm), many fine-grained routed experts, no shared one."""
from __future__ import annotations

from . import Table, weight_table, without_output_when_tied
from .llama import ATTENTION, DENSE_MLP, EMBEDDING, HEAD, PRE_MLP_NORM
from .qwen2_moe import ROUTED
from .qwen3 import QK_NORM


@weight_table("Qwen3MoeForCausalLM")
def qwen3_moe(shape) -> Table:
    return without_output_when_tied(shape, {**EMBEDDING, **ATTENTION, **QK_NORM, **PRE_MLP_NORM, **DENSE_MLP, **ROUTED,
                                            **HEAD})
