"""Qwen3-Next (transformers' Qwen3NextForCausalLM): a hybrid of gated delta net layers (linear
attention) and gated softmax attention, three to one (``layer_types``, else every
``full_attention_interval``-th layer full: megatron-core's ``experimental_attention_variant=
"gated_delta_net"`` with the list form of ``linear_attention_freq``), every MLP a MoE layer of
many experts plus a shared expert behind a sigmoid gate (Qwen2-MoE's), and:
  - the softmax attention's q_proj projects q and an output gate per head ([q_h; gate_h] per
    head), the attention output times sigmoid(gate) before o_proj (megatron's
    ``attention_output_gate``); q/k RMSNorm per head; rope on the first 0.25 of each head's
    dims (``partial_rotary_factor``, rotate-half: megatron's ``rotary_percent``);
  - every RMSNorm outside the delta net applies (1 + w) (megatron's
    ``layernorm_zero_centered_gamma``); the delta net's own gated norm applies w (its weights
    start at 1) and silu(z) after it;
  - the delta net: in_proj_qkvz / in_proj_ba grouped per key head ([q, k, v.., z..] and
    [b.., a..] of the value heads of that key head), a depthwise causal conv1d over q, k, v
    (kernel ``linear_conv_kernel_dim``, silu), l2-normed q and k, A_log and dt_bias per value
    head, the chunked gated delta rule, the gated norm and out_proj.
The checkpoints also hold a multi-token prediction module (``mtp.*``) that transformers drops on
load (``_keys_to_ignore_on_load_unexpected``).

What the toolkit does with it so far: plans it (parameters as transformers builds them, the
megatron-core settings and Megatron-LM flags, rules for what megatron-core cannot run). The
converters do not map the delta net's tensors yet and the recipes' runtime does not build its
layers (megatron-core's hybrid block spec is TransformerEngine-only and its GatedDeltaNet needs
the ``fla`` GPU kernels): both refuse the model with that reason (``weights`` below;
plan.runtime_rules.runtime_linear_attention).
"""
from __future__ import annotations

from ...errors import SpecError, UnsupportedModelError
from ..family import Family, register
from ..shape import LinearAttentionShape, ModelShape, MoEShape
from ..weights import Table
from ._common import dense_fields, dense_hf, moe_layers, partial_rotary, sparse_step

LINEAR, FULL = "linear_attention", "full_attention"  # transformers' layer_types
INTERVAL = 4  # Qwen3NextConfig.__post_init__: full_attention_interval defaults to 4
DEFAULT_ROTARY = 0.25  # Qwen3NextConfig.__post_init__: kwargs.setdefault("partial_rotary_factor", 0.25)


def linear_layers(cfg) -> tuple[bool, ...]:
    """Per decoder layer, whether it is a gated delta net layer: ``layer_types``, else every
    ``full_attention_interval``-th layer full (as Qwen3NextConfig fills it in)."""
    n = cfg.num_hidden_layers
    every = getattr(cfg, "full_attention_interval", None) or INTERVAL
    types = getattr(cfg, "layer_types", None) or [LINEAR if (i + 1) % every else FULL for i in range(n)]
    unknown = sorted(set(types) - {LINEAR, FULL})
    if unknown or len(types) != n:
        raise SpecError(f"layer_types: {len(types)} entries for {n} layers"
                        + (f", unknown {unknown} (known: '{LINEAR}', '{FULL}')" if unknown else ""))
    return tuple(t == LINEAR for t in types)


def _linear_attention(cfg) -> LinearAttentionShape:
    la = LinearAttentionShape(key_heads=cfg.linear_num_key_heads, value_heads=cfg.linear_num_value_heads,
                              key_head_dim=cfg.linear_key_head_dim, value_head_dim=cfg.linear_value_head_dim,
                              conv_kernel=cfg.linear_conv_kernel_dim, layers=linear_layers(cfg))
    if la.value_heads % la.key_heads:
        raise SpecError(f"linear_num_value_heads={la.value_heads} is not a multiple of linear_num_key_heads="
                        f"{la.key_heads} (each key head serves a group of value heads)")
    return la


def _moe(cfg) -> MoEShape:
    return MoEShape(num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok, ffn_hidden_size=cfg.moe_intermediate_size,
                    layers=moe_layers(cfg.num_hidden_layers, cfg.decoder_sparse_step, list(cfg.mlp_only_layers or [])),
                    shared_ffn_hidden_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True,
                    pre_softmax=not cfg.norm_topk_prob, aux_loss_coeff=float(cfg.router_aux_loss_coef))


def from_hf(cfg) -> ModelShape:
    if getattr(cfg, "attention_bias", False):
        raise SpecError(f"{cfg.config_class} with attention_bias=true is not supported (o_proj's bias besides "
                        "q/k/v's: megatron-core's add_qkv_bias has none)")
    if not cfg.num_experts:
        raise SpecError(f"{cfg.config_class} with num_experts=0 is not supported (every Qwen3-Next is a MoE)")
    return ModelShape(architecture="Qwen3NextForCausalLM", qk_norm=True, zero_centered_norm=True,
                      attention_output_gate=True, rotary_fraction=partial_rotary(cfg, DEFAULT_ROTARY),
                      moe=_moe(cfg), linear_attention=_linear_attention(cfg), **dense_fields(cfg))


def to_hf(shape: ModelShape) -> dict:
    m, la = shape.moe, shape.linear_attention
    d = dense_hf(shape, "qwen3_next")
    d["rope_parameters"] = {**d["rope_parameters"], "partial_rotary_factor": shape.rotary_fraction}
    step = sparse_step(m.layers)
    return {**d, "partial_rotary_factor": shape.rotary_fraction, "attention_bias": False,
            "layer_types": [LINEAR if x else FULL for x in la.layers],
            "linear_num_key_heads": la.key_heads, "linear_num_value_heads": la.value_heads,
            "linear_key_head_dim": la.key_head_dim, "linear_value_head_dim": la.value_head_dim,
            "linear_conv_kernel_dim": la.conv_kernel, "num_experts": m.num_experts, "num_experts_per_tok": m.topk,
            "moe_intermediate_size": m.ffn_hidden_size, "shared_expert_intermediate_size": m.shared_ffn_hidden_size,
            "norm_topk_prob": not m.pre_softmax, "decoder_sparse_step": step,
            "mlp_only_layers": [i for i, s in enumerate(m.layers) if not s and (i + 1) % step == 0],
            "router_aux_loss_coef": m.aux_loss_coeff}


NOT_MAPPED = ("Qwen3NextForCausalLM: the converters do not map its gated delta net layers (in_proj_qkvz/ba, "
              "conv1d, A_log, dt_bias, the gated norm) to megatron-core's GatedDeltaNet yet")


def weights(shape) -> Table:
    """No weight table yet (see the module's docstring): every conversion is refused with the reason."""
    raise UnsupportedModelError(NOT_MAPPED)


QWEN3_NEXT_TINY = {  # layers 1-3 gated delta net, 4 gated attention (the 80B's 3:1), 8 experts of 2 + a shared one
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "attention_bias": False, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001
}

register(Family("qwen3_next", ("Qwen3NextForCausalLM",), from_hf, to_hf, weights,
                tiny={"qwen3-next-tiny": QWEN3_NEXT_TINY}))
