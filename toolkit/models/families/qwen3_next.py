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
load (``_keys_to_ignore_on_load_unexpected``) and the converters carry (``MTP_MODULE``): vLLM's
Qwen3NextMultiTokenPredictor computes fc(concat(pre_fc_norm_embedding(embedding of the next
token), pre_fc_norm_hidden(hidden))), one gated-attention MoE decoder layer (``mtp.layers.0.*``),
``mtp.norm``, the shared head: megatron-core's MultiTokenPredictionLayer (eh_proj, enorm, hnorm,
transformer_layer, final_layernorm; Megatron-Bridge's Qwen3NextBridge maps the same names), its
layer built as the last decoder layer's kind (``problems``: that must be a gated-attention one).

Megatron-core's side: megatron's GatedDeltaNet (its in_proj rows are q, k, v, z, b, a over all
heads: DeltaNetInProj reorders HF's per-key-head groups), its out_norm (1 + w) under
layernorm_zero_centered_gamma, so megatron's weight = HF's - 1 (the table's ``shift``,
converters.shifted); SelfAttention with attention_output_gate (GatedQKV: per query group
its queries, their gates, k, v); the gated shared expert as Qwen2-MoE's. in_proj and conv1d split
over tp by parts (weights.PARTS); torch_dist stores them one key per part (``part_names``, as
GatedDeltaNet.sharded_state_dict names them). The recipes' runtime
trains it (megatron's GatedDeltaNet on CPU through toolkit.mcore.gated_delta_net; what megatron-core
cannot run with it: plan.linear_attention_rules).
"""
from __future__ import annotations

from ...errors import SpecError
from ..family import Family, register
from ..shape import LinearAttentionShape, ModelShape, MoEShape
from ..weights import (
    LINEAR,
    PARTS,
    QKV,
    SOFTMAX,
    Column,
    Mapping,
    Replicated,
    Row,
    Table,
    dim,
    scoped,
    whole,
)
from ._common import (
    DENSE_MLP,
    FULL,
    GATED_SHARED_EXPERT,
    PRE_MLP_NORM,
    QK_NORM,
    ROUTED,
    decoder,
    dense_fields,
    dense_hf,
    moe_layers,
    partial_rotary,
    sparse_step,
    typed_layers,
)

LINEAR_TYPE = "linear_attention"  # transformers' layer_types (the others: FULL)
INTERVAL = 4  # Qwen3NextConfig.__post_init__: full_attention_interval defaults to 4
DEFAULT_ROTARY = 0.25  # Qwen3NextConfig.__post_init__: kwargs.setdefault("partial_rotary_factor", 0.25)


def linear_layers(cfg) -> tuple[bool, ...]:
    """Per decoder layer, whether it is a gated delta net layer: ``layer_types``, else every
    ``full_attention_interval``-th layer full (as Qwen3NextConfig fills it in)."""
    return typed_layers(cfg, getattr(cfg, "full_attention_interval", None) or INTERVAL, LINEAR_TYPE)


def _linear_attention(cfg) -> LinearAttentionShape:
    la = LinearAttentionShape(key_heads=cfg.linear_num_key_heads, value_heads=cfg.linear_num_value_heads,
                              key_head_dim=cfg.linear_key_head_dim, value_head_dim=cfg.linear_value_head_dim,
                              conv_kernel=cfg.linear_conv_kernel_dim, layers=linear_layers(cfg))
    if la.value_heads % la.key_heads:
        raise SpecError(f"linear_num_value_heads={la.value_heads} is not a multiple of linear_num_key_heads="
                        f"{la.key_heads} (each key head serves a group of value heads)")
    return la


def _moe(cfg) -> MoEShape:
    return MoEShape(num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok,
                    ffn_hidden_size=cfg.moe_intermediate_size,
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
            "layer_types": [LINEAR_TYPE if x else FULL for x in la.layers],
            "linear_num_key_heads": la.key_heads, "linear_num_value_heads": la.value_heads,
            "linear_key_head_dim": la.key_head_dim, "linear_value_head_dim": la.value_head_dim,
            "linear_conv_kernel_dim": la.conv_kernel, "num_experts": m.num_experts, "num_experts_per_tok": m.topk,
            "moe_intermediate_size": m.ffn_hidden_size, "shared_expert_intermediate_size": m.shared_ffn_hidden_size,
            "norm_topk_prob": not m.pre_softmax, "decoder_sparse_step": step,
            "mlp_only_layers": [i for i, s in enumerate(m.layers) if not s and (i + 1) % step == 0],
            "router_aux_loss_coef": m.aux_loss_coeff}


class GatedQKV(QKV):
    """linear_qkv with megatron's attention output gate: per query group its query heads, their
    gates, its key, its value; HF's q_proj holds per head [q; gate] (Qwen3-Next)."""

    def hf_shapes(self, shape):
        q, kv = dim(shape, "q"), dim(shape, "kv")
        return [(2 * q, shape.hidden_size), (kv, shape.hidden_size), (kv, shape.hidden_size)]

    def to_global(self, shape, names, dst, padded_vocab):
        d, groups, cols = shape.head_dim, shape.num_query_groups, shape.hidden_size
        per = shape.num_attention_heads // groups
        out, row = [], 0
        for g in range(groups):
            for half in (0, d):  # the group's queries, then their gates
                for j in range(g * per, (g + 1) * per):
                    out.append(whole(names[0], dst, d, cols, src_row=2 * d * j + half, dst_row=row))
                    row += d
            for name in names[1:]:
                out.append(whole(name, dst, d, cols, src_row=g * d, dst_row=row))
                row += d
        return out


class DeltaNetConv(Column):
    """The delta net's depthwise conv1d [q; k; v channels, 1, kernel], as HF stores it; split over
    tp by parts (a rank's q, k and v channels)."""

    split = PARTS
    part_names = ("query", "key", "value")  # GatedDeltaNet.sharded_state_dict's split factory

    def parts(self, shape):
        la = shape.linear_attention
        return (la.qk_dim, la.qk_dim, la.v_dim)


class DeltaNetInProj(Mapping):
    """The gated delta net's in_proj: megatron's rows are q, k, v, z, b, a, each over all heads in
    head order; HF's in_proj_qkvz holds per key head [q, k, its value heads' v, their z] and
    in_proj_ba per key head [its value heads' b, their a] (Qwen3-Next). Split over tp by parts
    (a rank's q, k, v, z, b, a heads)."""

    split = PARTS
    part_names = ("query", "key", "value", "z", "beta", "alpha")  # GatedDeltaNet.sharded_state_dict's

    def parts(self, shape):
        la = shape.linear_attention
        return (la.qk_dim, la.qk_dim, la.v_dim, la.v_dim, la.value_heads, la.value_heads)

    def hf_shapes(self, shape):
        la, h = shape.linear_attention, shape.hidden_size
        return [(2 * la.qk_dim + 2 * la.v_dim, h), (2 * la.value_heads, h)]

    def to_global(self, shape, names, dst, padded_vocab):
        la, h = shape.linear_attention, shape.hidden_size
        r = la.value_heads // la.key_heads
        dk, rv = la.key_head_dim, r * la.value_head_dim
        qkvz = ((0, dk, 0), (dk, dk, la.qk_dim), (2 * dk, rv, 2 * la.qk_dim),
                (2 * dk + rv, rv, 2 * la.qk_dim + la.v_dim))
        ba = ((0, r, 2 * la.qk_dim + 2 * la.v_dim), (r, r, 2 * la.qk_dim + 2 * la.v_dim + la.value_heads))
        out = []
        for name, parts, block in ((names[0], qkvz, 2 * dk + 2 * rv), (names[1], ba, 2 * r)):
            for offset, rows, start in parts:
                out += [whole(name, dst, rows, h, src_row=g * block + offset, dst_row=start + g * rows)
                        for g in range(la.key_heads)]
        return out


GDN = "model.layers.{}.linear_attn."
# megatron's TE spec fuses a gated delta net layer's input norm into in_proj (experimental_attention_
# variant_module_specs); the local layers store theirs under the same key (toolkit.mcore.gated_delta_net),
# and so do torch_dist checkpoints (converters.formats.torch_dist)
GDN_NORM_KEY = "self_attention.in_proj.layer_norm_weight"
DELTA_NET: Table = {  # megatron-core's GatedDeltaNet (DeltaNetInProj: the in_proj's layout)
    "decoder.layers.{}.self_attention.in_proj.weight": DeltaNetInProj((GDN + "in_proj_qkvz.weight",
                                                                       GDN + "in_proj_ba.weight"), scope=LINEAR),
    "decoder.layers.{}.self_attention.conv1d.weight": DeltaNetConv(GDN + "conv1d.weight",
                                                                   dims=("conv", 1, "conv_kernel"), scope=LINEAR),
    "decoder.layers.{}.self_attention.dt_bias": Column(GDN + "dt_bias", dims=("value_heads",), scope=LINEAR),
    "decoder.layers.{}.self_attention.A_log": Column(GDN + "A_log", dims=("value_heads",), scope=LINEAR),
    "decoder.layers.{}.self_attention.out_norm.weight": Replicated(GDN + "norm.weight", dims=("value_head_dim",),
                                                                   scope=LINEAR, shift=-1.0),
    "decoder.layers.{}.self_attention.out_proj.weight": Row(GDN + "out_proj.weight", dims=("hidden", "v_dim"),
                                                            scope=LINEAR),
}
ATTN = "model.layers.{}.self_attn."
GATED_ATTENTION: Table = {  # megatron's SelfAttention with attention_output_gate and q/k norms
    "decoder.layers.{}.self_attention.linear_proj.weight": Row(ATTN + "o_proj.weight", dims=("hidden", "q"),
                                                               scope=SOFTMAX),
    "decoder.layers.{}.self_attention.linear_qkv.weight": GatedQKV((ATTN + "q_proj.weight", ATTN + "k_proj.weight",
                                                                    ATTN + "v_proj.weight"), scope=SOFTMAX),
    **scoped(QK_NORM, SOFTMAX),
}
INPUT_NORM: Table = {"decoder.layers.{}.input_layernorm.weight": Replicated("model.layers.{}.input_layernorm.weight")}


# megatron-core's MultiTokenPredictionLayer <- the checkpoints' mtp.* (one module: its names carry no
# number; its decoder layer is HF's mtp.layers.0.*, toolkit.models.weights.apart_mtp). Every norm here is
# (1 + w) on both sides (Qwen3NextRMSNorm; layernorm_zero_centered_gamma): copied as they are.
MTP_MODULE: Table = {
    "mtp.layers.{}.enorm.weight": Replicated("mtp.pre_fc_norm_embedding.weight"),
    "mtp.layers.{}.hnorm.weight": Replicated("mtp.pre_fc_norm_hidden.weight"),
    "mtp.layers.{}.eh_proj.weight": Column("mtp.fc.weight", dims=("hidden", "hidden2")),
    "mtp.layers.{}.final_layernorm.weight": Replicated("mtp.norm.weight"),
}


def weights(shape) -> Table:
    return {**decoder(shape, INPUT_NORM, DELTA_NET, GATED_ATTENTION, PRE_MLP_NORM, DENSE_MLP, ROUTED,
                      GATED_SHARED_EXPERT), **MTP_MODULE}


def problems(shape, cfg) -> list[str]:
    """MTP modules megatron-core would build otherwise than the checkpoint's: one only (the
    checkpoint names a single fc and norms), and megatron builds its decoder layer as the last
    decoder layer's kind, which must be gated attention (the MTP layer's) with the MoE MLP."""
    last, out = shape.num_layers - 1, []
    if shape.mtp_layers > 1:
        out.append(f"{shape.mtp_layers} MTP modules: Qwen3-Next's checkpoint format holds one (mtp.fc, mtp.norm)")
    if shape.mtp_layers and (shape.is_linear_attention_layer(last) or not shape.is_moe_layer(last)):
        out.append(f"an MTP module with decoder layer {last + 1} a gated delta net or dense layer: megatron-core "
                   "builds the MTP layer as the last decoder layer's kind, Qwen3-Next's is gated attention + MoE")
    return out



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

register(Family("qwen3_next", ("Qwen3NextForCausalLM",), from_hf, to_hf, weights, problems=problems,
                tiny={"qwen3-next-tiny": QWEN3_NEXT_TINY},
                hf_forward={"qk_norm": "each", "shared_experts": "first"}))
