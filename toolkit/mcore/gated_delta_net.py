"""megatron-core's gated delta net (ssm/gated_delta_net.py) on CPU: a shim, installed only where
no CUDA device exists; on a GPU megatron's own path (flash-linear-attention's Triton kernels)
stays untouched.

megatron-core 0.16.1's GatedDeltaNet imports ``l2norm`` and ``chunk_gated_delta_rule`` from
the ``fla`` package (flash-linear-attention: GPU Triton kernels) and raises ImportError at
construction without it. Its two other GPU dependencies need no shim: without the
``causal_conv1d`` package it runs its ``nn.Conv1d`` (the same depthwise causal convolution,
then its activation), and its ``torch_chunk_gated_delta_rule`` is megatron's own torch version
of fla's chunked rule (used by megatron itself under ``deterministic_mode``; transformers'
Qwen3-Next computes the same reference). The shim gives the module:
  - ``l2norm``: fla's formula, ``x / sqrt(sum(x^2) + eps)`` over the last dim, eps 1e-6 (the
    one fla.modules.l2norm computes; transformers' torch l2norm is ``x * rsqrt(...)``);
  - ``chunk_gated_delta_rule`` = megatron's ``torch_chunk_gated_delta_rule`` (same arguments);
  - ``GatedDeltaNet._apply_gated_norm`` eager: megatron wraps it in its ``jit_fuser``
    (``torch.compile`` on torch >= 2.2), which on CPU builds C++ with inductor at the first step
    and again for new shapes (the tiny model's first step at tp2: 50 s compiled, 5.5 s eager; a
    2-rank launch of a dp2 and a tp2 run of 3 steps: 143 s, 95 s eager); the same function.
Nothing else of GatedDeltaNet changes: its projections, convolution, gating and norm run as
megatron wrote them.
"""
from __future__ import annotations

import torch

EPS = 1e-6  # fla.modules.l2norm's default


def fla_l2norm(x: torch.Tensor, dim: int = -1, eps: float = EPS) -> torch.Tensor:
    """fla's l2norm over ``dim``, computed in fp32 and cast back (fla's kernel accumulates in fp32)."""
    y = x.float()
    return (y / torch.sqrt((y * y).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def install() -> bool:
    """Give megatron's gated_delta_net module the torch rule when fla is absent and no CUDA
    device exists; True when installed (or already), False when megatron's own path applies."""
    from megatron.core.ssm import gated_delta_net as gdn

    if getattr(gdn, "_toolkit_cpu_shim", False):
        return True
    if gdn.HAVE_FLA or torch.cuda.is_available():
        return False
    gdn.l2norm = fla_l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    norm = gdn.GatedDeltaNet._apply_gated_norm
    gdn.GatedDeltaNet._apply_gated_norm = getattr(norm, "_torchdynamo_orig_callable", norm)
    gdn.HAVE_FLA = True
    gdn._toolkit_cpu_shim = True
    return True


def local_spec(config):
    """megatron's gated delta net module spec (experimental_attention_variant_module_specs.
    get_gated_delta_net_module_spec) on megatron's local layers, for CPU: that one asks for
    TransformerEngine, whose in_proj also carries the input norm. Here the layer's
    input_layernorm stays its own module; out_norm is (1 + w) under
    layernorm_zero_centered_gamma, as TransformerEngine's RMSNorm applies it there."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from .layers import ZeroCenteredRMSNorm

    norm = ZeroCenteredRMSNorm if config.layernorm_zero_centered_gamma else WrappedTorchNorm
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear))


def hybrid_block_spec(spec, shape, config, te: bool, vp_stage: int | None, pp_rank: int):
    """The decoder block spec with gated delta net layers where ``shape.linear_attention`` puts
    them. With TransformerEngine: megatron-core's own hybrid spec (get_transformer_block_with_
    experimental_attention_variant_spec). On megatron's local layers (CPU): ``spec`` (megatron's
    GPT block spec, the toolkit's norms already in) with each delta net layer's self_attention
    replaced by ``local_spec`` (the shim installed: no CUDA, no fla) and its input norm stored in
    torch_dist checkpoints under TE's key (toolkit.models.families.qwen3_next.GDN_NORM_KEY: megatron's TE spec
    fuses it into in_proj; its local GPT spec maps it to linear_qkv's, which a delta net layer lacks),
    so checkpoints load in either spec."""
    import copy

    if te:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage, pp_rank)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from ..models.families.qwen3_next import GDN_NORM_KEY

    install()
    norm_key = GDN_NORM_KEY.removesuffix("weight")
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    delta_net = local_spec(config)
    layers = []
    for i, layer in enumerate(spec.layer_specs):
        if shape.is_linear_attention_layer(offset + i):
            layer = copy.copy(layer)
            layer.submodules = copy.copy(layer.submodules)
            layer.submodules.self_attention = delta_net
            layer.submodules.sharded_state_dict_keys_map = {**layer.submodules.sharded_state_dict_keys_map,
                                                            "input_layernorm.": norm_key}
        layers.append(layer)
    out = copy.copy(spec)
    out.layer_specs = layers
    return out


def part_inits(chunk) -> dict[str, tuple[list[int], object]]:
    """Per parameter name of ``chunk``'s gated delta nets whose tp split is by parts, (the rows of
    each part in the one-rank model, the init megatron draws the whole tensor with). A tp rank
    holds its share of every part one after the other (the q, k, v, z, b, a rows of in_proj;
    the q, k, v channels of conv1d; A_log per value head), so a contiguous split of one full
    draw would give tp2 other weights than tp1 (toolkit.runtime.init draws by parts). conv1d:
    nn.Conv1d's own kaiming-uniform (megatron's conv_init unset; fan-in = kernel, the same at any
    tp); A_log: log of uniform(A_init_range), as GatedDeltaNet.reset_parameters."""
    import math

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    out = {}
    for prefix, m in chunk.named_modules():
        if not isinstance(m, GatedDeltaNet):
            continue
        qk, v, heads = m.qk_dim, m.v_dim, m.num_value_heads
        conv = ((lambda w, c=m.conv_init: torch.nn.init.uniform_(w, -c, c)) if m.conv_init is not None
                else (lambda w: torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))))
        out[f"{prefix}.in_proj.weight"] = ([qk, qk, v, v, heads, heads], m.config.init_method)
        out[f"{prefix}.conv1d.weight"] = ([qk, qk, v], conv)
        out[f"{prefix}.A_log"] = ([heads], lambda w, r=m.A_init_range: w.copy_(torch.empty_like(w).uniform_(*r).log()))
    return out
