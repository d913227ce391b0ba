"""megatron-core GPTModel(s) of a Plan, built with the kernels the plan counted.

Which layer spec and fusions are built comes from ``toolkit.kernels`` (the memory estimate
reads the same): flash attention = megatron's TransformerEngine layer spec with
``attention_backend=flash``; unfused = the local layer spec (DotProductAttention). On CUDA
megatron's fused SwiGLU kernel is on (``bias_activation_fusion``); on CPU every fusion is
off (toolkit.mcore.cpu_compat). Megatron initialises the weights as it builds them (that
is also where it marks tensor-parallel weights and their partition stride, which DeepSpeed's
gradient norm and the redraw read), then toolkit.runtime.init draws every weight again from
its global name on every device, so all layouts (and every pipeline stage) start as one model.
The training runtime builds it inside ZeRO-3's ``deepspeed.zero.Init`` (toolkit.runtime.model).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..backends.megatron import load_transformer_config, own_layer_features
from ..emit.megatron import gpt_model_kwargs, transformer_config_kwargs
from ..kernels import spec_kernels
from . import cpu_compat


def build_overrides(plan, cuda: bool | None = None) -> dict[str, Any]:
    """TransformerConfig fields the runtime sets beyond the generated megatron_config.
    ``cuda``: whether the ranks have GPUs (default: this machine); without, every fusion is off."""
    k = spec_kernels(plan.spec)
    fused = k.fused_swiglu and plan.shape.activation == "swiglu"  # megatron fuses SwiGLU and erf-GeGLU only
    d: dict[str, Any] = dict(gradient_accumulation_fusion=False, bias_activation_fusion=fused)
    if k.transformer_engine:
        from megatron.core.transformer.enums import AttnBackend

        d.update(attention_backend=AttnBackend.flash, apply_rope_fusion=rope_fusion_allowed(plan),
                 bias_dropout_fusion=True)
    return {**d, **cpu_compat.config_overrides(cuda)}


def rope_fusion_allowed(plan) -> bool:
    """Whether megatron-core accepts ``apply_rope_fusion`` for this model: for multi-latent
    attention only with yarn rope (MLATransformerConfig raises otherwise: DeepSeek's tiny
    flavours have plain rope); every other attention takes TransformerEngine's fused rope."""
    kw = transformer_config_kwargs(plan)
    return not kw.get("multi_latent_attention") or kw.get("rope_type") == "yarn"


def transformer_config(plan, cuda: bool | None = None, **overrides: Any):
    """megatron-core's (MLA)TransformerConfig of the plan as the runtime builds it (``cuda``:
    as on GPUs or on a CPU; default: this machine), validated by megatron's __post_init__."""
    return load_transformer_config(transformer_config_kwargs(plan), **{**build_overrides(plan, cuda), **overrides})


def block_spec(plan, config, vp_stage: int | None):
    """megatron's layer specs for this (virtual) stage, dense or MoE layer by layer as
    config.moe_layer_freq says (megatron's own get_gpt_decoder_block_spec)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = spec_kernels(plan.spec).transformer_engine
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=config.normalization,
                                      vp_stage=vp_stage, pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    if config.sequence_parallel and not te:
        spec = cpu_compat.swap_torch_norms(spec, cpu_compat.SequenceParallelRMSNorm)
    if config.add_bias_linear and config.num_moe_experts and not te:  # experts with biases: toolkit.mcore.expert_bias
        from .expert_bias import expert_bias_spec

        spec = expert_bias_spec(spec)
    if config.context_parallel_size > 1 and not te:  # TE's attention splits the sequence itself
        from .context_parallel import context_parallel_spec

        spec = context_parallel_spec(spec)
    spec = _with_model_layers(spec, plan.shape, te)
    if plan.shape.linear_attention is not None:  # Qwen3-Next: gated delta net layers
        from .gated_delta_net import hybrid_block_spec

        spec = hybrid_block_spec(spec, plan.shape, config, te, vp_stage, parallel_state.get_pipeline_model_parallel_rank())
    return spec


def _with_model_layers(spec, shape, te: bool):
    """The spec with our modules for what megatron's GPT specs lack (toolkit.mcore.layers: Gemma 3's
    post-norms, (1 + w) norms on the local spec, per-layer rope bases)."""
    if not own_layer_features(shape):
        return spec
    from .layers import model_spec

    return model_spec(spec, shape, te)


def mtp_block_spec(plan, config, layers, vp_stage: int | None):
    """megatron's multi-token-prediction block for this (virtual) stage, or None: all MTP
    modules sit on the last pipeline stage (megatron's get_gpt_mtp_block_spec decides, from
    config.mtp_num_layers), each a decoder layer of the last layer's kind (MoE for DeepSeek-V3)
    with its own norms and projection; it embeds the shifted tokens itself, so that stage
    holds a copy of the word embedding (toolkit.runtime.grads sums the copies' gradients)."""
    if not config.mtp_num_layers:
        return None
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    spec = get_gpt_mtp_block_spec(config, layers, use_transformer_engine=spec_kernels(plan.spec).transformer_engine,
                                  vp_stage=vp_stage, pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    if spec is not None and not spec_kernels(plan.spec).transformer_engine:  # its own norms, as block_spec's
        if plan.shape.zero_centered_norm:  # (1 + w): the local spec's WrappedTorchNorm refuses it (Qwen3-Next)
            from .layers import ZeroCenteredRMSNorm

            spec = cpu_compat.swap_torch_norms(spec, ZeroCenteredRMSNorm)
        elif config.sequence_parallel:
            spec = cpu_compat.swap_torch_norms(spec, cpu_compat.SequenceParallelRMSNorm)
    return spec


def build_model_chunks(plan, init: contextlib.AbstractContextManager | None = None,
                       **config_overrides: Any) -> list[torch.nn.Module]:
    """This rank's model: one GPTModel per virtual pipeline chunk (one when vpp = 1).
    parallel_state must be initialised for the plan's layout. ``init``: a context the modules
    are built in (the runtime's ZeRO-3 partitioning, toolkit.runtime.model.zero_init)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(plan, **config_overrides)
    vpp = plan.layout.vpp
    chunks = []
    with init or contextlib.nullcontext():
        for v in range(vpp):
            vp_stage = v if vpp > 1 else None
            pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
            layers = block_spec(plan, config, vp_stage)
            chunks.append(GPTModel(config=config, transformer_layer_spec=layers,
                                   mtp_block_spec=mtp_block_spec(plan, config, layers, vp_stage),
                                   pre_process=pre, post_process=post, vp_stage=vp_stage, **gpt_model_kwargs(plan)))
            if pre and plan.shape.embedding_scale is not None:
                from .layers import scale_embeddings

                scale_embeddings(chunks[-1], plan.shape.embedding_scale)
            if plan.shape.attention_sinks or (plan.shape.moe is not None and plan.shape.linear_bias):
                from .layers import mark_unmarked_tensor_parallel

                mark_unmarked_tensor_parallel(chunks[-1])
    return chunks
