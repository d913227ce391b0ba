"""The architecture of a decoder-only transformer, independent of any framework.

A ModelShape is what every other part reads: the planner (parameters, FLOPs, activations),
the Megatron settings, the converters and the runtime. Its fields are the architecture's
features, each read generically; the families (toolkit/models/families/) build it from a
Hugging Face config and write it back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


GATED_ACTIVATIONS = ("swiglu", "geglu_tanh", "quick_geglu")  # geglu_tanh: gelu(x W_gate, approximate="tanh") * (x W_up)


@dataclass(frozen=True)
class MoEShape:
    """Routed experts (+ optional shared expert) of the MoE layers."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # per routed expert
    layers: tuple[bool, ...]  # per decoder layer: True where the MLP is a MoE layer
    shared_ffn_hidden_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) * shared_expert(x)
    score_function: str = "softmax"  # softmax | sigmoid
    # Qwen2-MoE / DeepSeek-V2 (norm_topk_prob=False): softmax over all experts, then top-k,
    # no renormalisation = megatron's moe_router_pre_softmax=True. Mixtral/Qwen3-MoE
    # renormalise over the k chosen = megatron's default (top-k on logits, softmax over k).
    pre_softmax: bool = False
    topk_scaling_factor: float | None = None
    num_groups: int | None = None  # device/group-limited routing (DeepSeek)
    group_topk: int | None = None
    expert_bias: bool = False  # DeepSeek-V3 aux-loss-free balancing bias
    aux_loss_coeff: float = 0.0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.layers)


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None  # None: q is projected directly from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class LinearAttentionShape:
    """Gated delta net layers (Qwen3-Next's linear attention; megatron-core's
    ``experimental_attention_variant="gated_delta_net"``): per token, q and k of ``key_heads``
    heads, v and the output gate z of ``value_heads`` heads, a short causal depthwise convolution
    over q, k, v, and per value head a decay (A_log, dt_bias, the projected a) and a write
    strength (the projected b)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[bool, ...]  # per decoder layer: True where its token mixer is the gated delta net

    @property
    def qk_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def v_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def in_proj_dim(self) -> int:
        """megatron's in_proj rows: q, k, v, z, b, a."""
        return 2 * self.qk_dim + 2 * self.v_dim + 2 * self.value_heads

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise convolution: q, k and v."""
        return 2 * self.qk_dim + self.v_dim


@dataclass(frozen=True)
class ModelShape:
    architecture: str  # the HF architecture, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int  # = num_key_value_heads
    head_dim: int  # kv_channels
    ffn_hidden_size: int  # dense MLP intermediate size
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    rope_scaling: dict[str, Any] | None = None  # HF rope_parameters when not "default"
    # Architectural features every consumer reads (the planner, the emitters, the converters, the
    # runtime's layer spec); backends.megatron says which values megatron-core builds, and the
    # model-scope rule megatron_features refuses the others with the value named.
    activation: str = "swiglu"  # the MLP: "swiglu" = silu(x W_gate) * (x W_up), fc1 = [gate; up]
    # ("quick_geglu": g * sigmoid(1.702 g) in place of silu(g), megatron's quick_gelu)
    norm: str = "rmsnorm"  # every norm of the model, before attention and before the MLP
    linear_bias: bool = False  # biases on every linear layer (megatron's add_bias_linear)
    rotary_fraction: float = 1.0  # the share of each head's dims that rope rotates (megatron's rotary_percent)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (GPT-OSS)
    # the gated MLP's clamp (gate <= c, -c <= linear <= c) and the offset added to its linear half
    glu_clamp: float | None = None
    glu_linear_offset: float = 0.0
    attention_dropout: float = 0.0  # dropout of the attention probabilities in training (HF's attention_dropout)
    moe: MoEShape | None = None
    mla: MLAShape | None = None
    # DeepSeek-V3 multi-token prediction modules after the last decoder layer (megatron's
    # mtp_num_layers); the converters count them from the weights, since transformers
    # writes num_nextn_predict_layers=1 into every DeepSeek-V3 config, with or without them
    mtp_layers: int = 0
    # Gemma 3: norm weights stored as w and applied as (1 + w) (megatron's layernorm_zero_centered_gamma)
    zero_centered_norm: bool = False
    post_norms: bool = False  # a norm after attention and after the MLP, each before its residual add
    embedding_scale: float | None = None  # the word embeddings multiplied by this (Gemma: sqrt(hidden_size))
    # per decoder layer: True where attention is sliding-window (None: every layer, when sliding_window is set)
    window_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None  # rope base of the sliding-window layers (None: rope_theta everywhere)
    softmax_scale: float | None = None  # the attention scores' scale (None: 1 / sqrt(head_dim))
    # a sigmoid gate on the attention output per head and channel, projected with q (Qwen3-Next;
    # megatron's attention_output_gate: linear_qkv is then q + gate + k + v wide)
    attention_output_gate: bool = False
    linear_attention: LinearAttentionShape | None = None  # gated delta net layers (Qwen3-Next)
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP's first linear layer holds two halves (gate; up): fc1 is 2 x ffn wide."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_window_layer(self, layer: int) -> bool:
        """Whether this layer's attention sees only the last ``sliding_window`` tokens."""
        return self.sliding_window is not None and (self.window_layers is None or self.window_layers[layer])

    def is_linear_attention_layer(self, layer: int) -> bool:
        """Whether this layer's token mixer is the gated delta net (no softmax attention)."""
        return self.linear_attention is not None and self.linear_attention.layers[layer]

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]
