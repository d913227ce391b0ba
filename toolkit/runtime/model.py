"""megatron-core GPTModel(s) of a Plan (local layer spec, no TransformerEngine)."""
from __future__ import annotations

from typing import Any

import torch

from ..emit.megatron import gpt_model_kwargs, load_transformer_config, transformer_config_kwargs
from . import cpu_compat


def transformer_config(plan, **overrides: Any):
    return load_transformer_config(transformer_config_kwargs(plan), **{**cpu_compat.config_overrides(), **overrides})


def block_spec(plan, config, vp_stage: int | None):
    """megatron's local layer spec for this model, as a block spec for one (virtual) stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    shape = plan.shape
    layer = get_gpt_layer_local_spec(
        num_experts=shape.moe.num_experts if shape.moe else None, moe_grouped_gemm=plan.spec.moe.grouped_gemm,
        qk_layernorm=shape.qk_norm, multi_latent_attention=shape.mla is not None, normalization="RMSNorm")
    norm = WrappedTorchNorm
    if config.sequence_parallel:
        norm = cpu_compat.SequenceParallelRMSNorm
        layer = cpu_compat.swap_torch_norms(layer, norm)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=norm)


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
