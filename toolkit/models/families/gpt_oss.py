"""GPT-OSS (transformers' GptOssForCausalLM): grouped-query attention with biases on q/k/v and
o, a learned sink logit per head in every softmax's denominator (megatron's
``softmax_type="learnable"``: DotProductAttention's ``softmax_offset``), sliding-window and full
attention alternating as ``layer_types`` says (megatron's ``window_size`` with the per-layer list
form of ``window_attn_skip_freq``), yarn rope, and every MLP a MoE layer: a router with a bias
(top-k of the logits, softmax over the k: megatron's default), experts with biases and a clamped
SwiGLU: ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, l)`` (megatron's
quick_gelu GLU with ``activation_func_clamp_value`` l and ``glu_linear_offset`` 1).

What the checkpoint holds, not what the fields suggest:
  - the experts of a layer are three-dimensional tensors, ``gate_up_proj`` [E, hidden, 2 ffn]
    (x @ W: transposed against megatron's [out, in]) whose even columns are the gate and odd
    ones the linear half, ``gate_up_proj_bias`` [E, 2 ffn] interleaved alike, ``down_proj``
    [E, ffn, hidden] and ``down_proj_bias`` [E, hidden]. The table names each expert's
    gate/up/down weight and bias as its own [out, in] tensor (``PACKED`` says where they lie
    in the stored ones); the converters read and write the stored form through that
    (converters.packed);
  - transformers' experts ignore ``hidden_act`` (config.json says silu); the sigmoid gain is
    ``swiglu_alpha`` (1.702, megatron's quick_gelu constant).
The hub's checkpoints store the experts' weights in MXFP4 (``quantization_config`` quant_method
mxfp4: ``gate_up_proj_blocks`` / ``_scales``, ...): the converters dequantise them an expert at a
time as transformers does (converters.packed).
"""
from __future__ import annotations

from ..family import Family, register
from ..shape import ModelShape, MoEShape
from ..weights import MOE, Column, Gated, Replicated, Row, Table, dim
from ._common import ATTENTION, PRE_MLP_NORM, QKV_BIAS, decoder, dense_fields, dense_hf, layer_types, window_layers

QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu: x * sigmoid(1.702 x)
LINEAR_OFFSET = 1.0  # transformers' (up + 1)


class GatedBias(Gated):
    """linear_fc1's bias = [gate bias; up bias], split over tp like the weight's rows."""

    def hf_shapes(self, shape):
        return [(dim(shape, self.ffn),)] * 2


EXPERT = "model.layers.{}.mlp.experts.{}."  # one expert's tensors as the table names them (see PACKED)

GPT_OSS_LAYER: Table = {
    "decoder.layers.{}.self_attention.linear_proj.bias": Replicated("model.layers.{}.self_attn.o_proj.bias"),
    "decoder.layers.{}.self_attention.core_attention.softmax_offset": Column("model.layers.{}.self_attn.sinks",
                                                                             dims=("heads",)),
    "decoder.layers.{}.mlp.router.weight": Replicated("model.layers.{}.mlp.router.weight", dims=("experts", "hidden"),
                                                      scope=MOE),
    "decoder.layers.{}.mlp.router.bias": Replicated("model.layers.{}.mlp.router.bias", dims=("experts",), scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight": Gated(
        (EXPERT + "gate_proj.weight", EXPERT + "up_proj.weight"), ffn="expert_ffn", scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.bias": GatedBias(
        (EXPERT + "gate_proj.bias", EXPERT + "up_proj.bias"), ffn="expert_ffn", scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight": Row(
        EXPERT + "down_proj.weight", dims=("hidden", "expert_ffn"), scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.bias": Replicated(EXPERT + "down_proj.bias",
                                                                                scope=MOE),
}

# The stored expert tensors: (stored name, the per-expert tensors it holds, transposed). Several
# tensors in one are interleaved along its last axis (gate at 0::2, up at 1::2).
STORED = "model.layers.{}.mlp.experts."
PACKED = (
    (STORED + "gate_up_proj", (EXPERT + "gate_proj.weight", EXPERT + "up_proj.weight"), True),
    (STORED + "gate_up_proj_bias", (EXPERT + "gate_proj.bias", EXPERT + "up_proj.bias"), False),
    (STORED + "down_proj", (EXPERT + "down_proj.weight",), True),
    (STORED + "down_proj_bias", (EXPERT + "down_proj.bias",), False),
)


# GptOssConfig.__post_init__: a config.json without rope parameters gets this yarn (and without
# layer_types, sliding attention at the even layer indices)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def from_hf(cfg) -> ModelShape:
    moe = MoEShape(num_experts=cfg.num_local_experts, topk=cfg.num_experts_per_tok,
                   ffn_hidden_size=cfg.intermediate_size, layers=(True,) * cfg.num_hidden_layers,
                   aux_loss_coeff=float(cfg.router_aux_loss_coef))
    sliding = window_layers(cfg, 2)  # transformers' default: sliding, full, sliding, ...
    fields = dense_fields(cfg)
    if fields["rope_scaling"] is None:
        fields["rope_scaling"] = DEFAULT_ROPE
    return ModelShape(architecture="GptOssForCausalLM", activation="quick_geglu", linear_bias=True,
                      qkv_bias=bool(cfg.attention_bias), attention_sinks=True,
                      sliding_window=cfg.sliding_window if any(sliding) else None,
                      window_layers=sliding if any(sliding) else None, glu_clamp=float(cfg.swiglu_limit),
                      glu_linear_offset=LINEAR_OFFSET, moe=moe, **fields)


def to_hf(shape: ModelShape) -> dict:
    m = shape.moe
    sliding = shape.window_layers or (False,) * shape.num_layers
    return {**dense_hf(shape, "gpt_oss"), "attention_bias": shape.qkv_bias,
            "layer_types": layer_types(sliding),
            "sliding_window": shape.sliding_window, "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.topk, "router_aux_loss_coef": m.aux_loss_coeff,
            "swiglu_limit": shape.glu_clamp, "swiglu_alpha": QUICK_GELU_ALPHA}


def weights(shape) -> Table:
    return decoder(shape, ATTENTION, QKV_BIAS, PRE_MLP_NORM, GPT_OSS_LAYER)


def problems(shape, cfg) -> list[str]:
    """What megatron-core's GPTModel would compute differently from transformers' GptOss."""
    out = []
    alpha = float(getattr(cfg, "swiglu_alpha", None) or QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        out.append(f"swiglu_alpha={alpha}: megatron-core's quick_gelu fixes the sigmoid gain at {QUICK_GELU_ALPHA}")
    if not cfg.attention_bias:
        out.append("attention_bias=false: megatron-core's add_bias_linear puts biases on attention and experts "
                   "alike, and the experts have them")
    return out


def packed(shape: ModelShape):
    """The stored expert tensors (see PACKED) of every layer."""
    return [(name.format(layer), tuple(p.replace("{}", str(layer), 1) for p in parts), transposed)
            for layer in range(shape.num_layers) for name, parts, transposed in PACKED]


GPT_OSS_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "attention_bias": True, "attention_dropout": 0.0, "num_local_experts": 8, "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.9, "swiglu_limit": 7.0, "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 128},
}

# Megatron-LM checkpoint flags without an HF config: not given (its flags do not express GPT-OSS,
# backends.megatron.megatron_lm_problem), so only checkpoints with their HF config convert back
register(Family("gpt_oss", ("GptOssForCausalLM",), from_hf, to_hf, weights, problems=problems,
                tiny={"gpt-oss-tiny": GPT_OSS_TINY}, packed=packed))
