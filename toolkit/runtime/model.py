"""megatron-core GPTModel(s) of a Plan (local layer spec, no TransformerEngine)."""
from __future__ import annotations

from typing import Any

import torch

from ..emit.megatron import gpt_model_kwargs, load_transformer_config, transformer_config_kwargs
from . import cpu_compat


def transformer_config(plan, **overrides: Any):
    return load_transformer_config(transformer_config_kwargs(plan), **{**cpu_compat.config_overrides(), **overrides})


def block_spec(plan, config, vp_stage: int | None):
    """megatron's local layer specs for this (virtual) stage, dense or MoE layer by layer as
    config.moe_layer_freq says (megatron's own get_gpt_decoder_block_spec)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                      vp_stage=vp_stage, pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    if config.sequence_parallel:
        spec = cpu_compat.swap_torch_norms(spec, cpu_compat.SequenceParallelRMSNorm)
    return spec


def build_model_chunks(plan, **config_overrides: Any) -> list[torch.nn.Module]:
    """This rank's model: one GPTModel per virtual pipeline chunk (one when vpp = 1).
    parallel_state must be initialised for the plan's layout."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(plan, **config_overrides)
    vpp = plan.layout.vpp
    chunks = []
    for v in range(vpp):
        vp_stage = v if vpp > 1 else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunks.append(GPTModel(config=config, transformer_layer_spec=block_spec(plan, config, vp_stage),
                               pre_process=pre, post_process=post, vp_stage=vp_stage, **gpt_model_kwargs(plan)))
    return chunks
