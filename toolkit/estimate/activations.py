"""Activation bytes one layer keeps for its backward pass, for the kernels the spec builds.

Counted from what autograd saves in megatron-core 0.16's layers, per token of a micro-batch's
sequence shard on one GPU (checked on CPU against ``torch.autograd.graph.saved_tensors_hooks``
on the real GPTModel: tests/toolkit/estimate/test_activations.py). w = bytes of the activation dtype,
h hidden, a heads, g query groups, d head size, f ffn size, s sequence length, t tp; head and
ffn terms are divided by t, the rest by t only under sequence parallelism:

  norms      2 x (w h + 4)           fused RMSNorm (CUDA): 16-bit input + fp32 1/rms
             2 x (8 h + 4)           torch's composite RMSNorm (CPU): two fp32 copies
             4 x that with post-norms (Gemma 3: after attention and after the MLP too; its
                                     (1 + w) keeps an h-sized (1 + w) per norm and layer besides)
  inputs     2 w h                   of linear_qkv and linear_fc1
  attention  flash     w (2ad + 2gd) + 4a         q, k, v, the output; fp32 log-sum-exp
             unfused   w (3ad + v) + (4 + w') a s q, k and the output (ad each), v (ad when
                       GQA expands it, (a + 2g) d when MHA keeps a view of the fused qkv
                       output), the fp32 softmax and its w'-byte cast (w' = 0 in fp32: no cast);
                       with attention dropout the dropped probabilities (w) and the dropout's
                       mask replace the cast: (4 + 1 + w) a s with CUDA's fused dropout (a bool
                       mask), (4 + 2w) a s on CPU (the noise, w)
             selective recompute of the unfused core: its inputs q, k (gd), v (a view of
                       the qkv output, (a + 2g) d) and the output
  MLP        fused SwiGLU 3 w f; unfused 5 w f (see toolkit.kernels), 6 w f for a clamped GLU
             (GPT-OSS: the clamped halves and the activation)
  sinks      the unfused core's fp32 softmax has the sink's column too (4 a; GPT-OSS)
  full recompute: w h, the layer input.
  op recompute (torchtitan's per-op checkpointing, dense layers): the layer input and the outputs
             the policy saves: wq (a d), wv (g d), the attention's output (a d) and fp32
             log-sum-exp (4a), w1 (f) and w2 (h); w (2h + 2ad + gd + f) + 4a (checked against
             torch's selective checkpointing on transformers' LlamaDecoderLayer:
             tests/toolkit/estimate/test_op_recompute.py).
  FP8 (TransformerEngine, fp8 section): a linear layer keeps its input quantized (1 byte) for
             its weight gradient (TE's docs, "Performance considerations": the column-wise FP8
             input is saved): the inputs of linear_qkv and linear_fc1 2 h instead of 2 w h,
             linear_fc2's (the SwiGLU output, an expert's input too) f instead of w f; the
             attention output, which flash attention keeps anyway, gets an FP8 copy besides
             (a d). Not checked against autograd here (no TransformerEngine on CPU).
Not counted: without TransformerEngine's fused rope, megatron's rotary embedding keeps cos
and sin for q and k in every layer, 4 d w bytes per sequence position (per token: divided
by the micro batch; 1 KB against ~270 KB per token and layer for Llama-70B); nor, unfused, a
sliding-window layer's [s, s] boolean mask, which megatron builds at every call and masked_fill
keeps (s bytes per sequence position, divided by the micro batch as the above).
MoE layers: per routed slot (top-k per token, experts split over etp; scaled by the capacity
settings, compute.routed_share) the expert's input (w h) and its SwiGLU (unfused: one f more,
the activation output the routing probability multiplies), the router's fp32 logits and
probabilities (8 E); a shared expert
counts as a dense MLP of its size, and its sigmoid gate (Qwen2-MoE) keeps the shared output
and the gate (w (h + 1)). MLA (DeepSeek) counts the latent projections' outputs
as replicated inputs and each head's q/k of size nope + rope.
"""
from __future__ import annotations

from ..kernels import Kernels
from ..models import ModelShape
from ..parallel.layout import Layout


def _swiglu(f: float, w: int, kernels: Kernels, clamped: bool = False, fp8: bool = False) -> float:
    """A gated MLP's activation; unfused, a clamped GLU (GPT-OSS) keeps one f more: the clamped
    gate, the clamped linear half + offset and the activation, beside fc1's output. Under FP8 the
    output, linear_fc2's input, is kept in FP8 (1 byte) for its weight gradient."""
    return (3 if kernels.fused_swiglu else 5 + clamped) * w * f - (w - 1) * f * fp8


def _norm(h: int, w: int, kernels: Kernels) -> float:
    return (w * h if kernels.fused_norm else 8 * h) + 4


def _probabilities(shape: ModelShape, w: int, kernels: Kernels) -> float:
    """Bytes per score the unfused core keeps after its softmax: the fp32 softmax output, then
    the probabilities the second matmul reads (a w-byte cast; none in fp32) or, with attention
    dropout (the flash kernel keeps only its RNG state), the dropped ones and the dropout's mask."""
    if shape.attention_dropout > 0:
        return 4 + (1 if kernels.fused_dropout else w) + w
    return 4 + (w if w < 4 else 0)


def _attention(shape: ModelShape, seq: int, t: int, recompute: str, kernels: Kernels, w: int) -> float:
    """Head-parallel attention bytes per token (already divided by t)."""
    a = shape.num_attention_heads / t
    if shape.mla is not None:
        m = shape.mla
        qk, v, g = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, a
        if kernels.attention == "flash":
            return w * a * (2 * qk + 2 * v) + 4 * a
        kept = w * a * (2 * qk + 2 * v)
        return kept if recompute == "selective" else kept + _probabilities(shape, w, kernels) * a * seq
    g, d = shape.num_query_groups / t, shape.head_dim
    if kernels.attention == "flash":
        return w * (2 * a * d + 2 * g * d) + 4 * a
    fused_qkv = (a + 2 * g) * d
    if recompute == "selective":
        return w * (a * d + g * d + fused_qkv + a * d)
    v = a * d if g < a else fused_qkv
    sink = 4 * a if shape.attention_sinks else 0  # the sink's column of the fp32 softmax (megatron's SoftmaxOne)
    return w * (3 * a * d + v) + _probabilities(shape, w, kernels) * a * seq + sink


def _mlp(shape: ModelShape, layer: int, layout: Layout, kernels: Kernels, w: int,
         share: float = 1.0, fp8: bool = False) -> tuple[float, float]:
    """(sequence-sharded bytes, head/ffn-parallel bytes) of the layer's MLP per token; ``share``:
    compute.routed_share, the slots per routed token the capacity settings leave or pad to."""
    clamped = shape.glu_clamp is not None
    if not shape.is_moe_layer(layer):
        return 0.0, _swiglu(shape.ffn_hidden_size / layout.tp, w, kernels, clamped, fp8)
    mo, h = shape.moe, shape.hidden_size
    f = mo.ffn_hidden_size / layout.etp
    # unfused, the expert multiplies its SwiGLU output by the routing probability (megatron-core
    # experts.py activation_func_with_probs) and keeps that output for the product's backward
    slot = (1 if fp8 else w) * h + _swiglu(f, w, kernels, clamped, fp8) + (0 if kernels.fused_swiglu else w * f)
    routed = mo.topk * share * slot + 8 * mo.num_experts
    if mo.shared_expert_gate:  # Qwen2-MoE: sigmoid(gate(x)) * shared(x) keeps both factors
        routed += w * (h + 1)
    return routed, _swiglu(mo.shared_ffn_hidden_size / layout.tp, w, kernels, fp8=fp8)


def mtp_module_bytes(shape: ModelShape, layout: Layout, kernels: Kernels, w: int) -> float:
    """Per token, what each multi-token prediction module keeps besides its decoder layer and
    its logits: its three norms (enorm, hnorm, final_layernorm), its eh_proj input (2h) and its
    output layer's input (h); sequence-sharded under sequence parallelism. Checked against
    autograd in megatron-core's MTP block (tests/toolkit/estimate/test_activations.py)."""
    return shape.mtp_layers * (3 * _norm(shape.hidden_size, w, kernels) + 3 * w * shape.hidden_size) / layout.seq_shards


def layer_activation_bytes(shape: ModelShape, layer: int, *, tokens: float, seq: int, layout: Layout,
                           recompute: str, kernels: Kernels, act_bytes: int, routed: float = 1.0,
                           fp8: bool = False) -> float:
    """Bytes one micro-batch leaves stored in one layer for the backward pass (per GPU).
    tokens = micro * seq_len / cp: the tokens this GPU's sequence shard holds. ``fp8``: the
    layer's linear layers run in FP8 (the module docstring's FP8 line)."""
    h, t, w = shape.hidden_size, layout.tp, act_bytes
    sp = layout.seq_shards
    if recompute == "full":
        return tokens * w * h / sp  # only the layer input is kept
    if recompute == "op":  # dense layers, tp = cp = 1 (rule op_recompute_model)
        a, g, d = shape.num_attention_heads / t, shape.num_query_groups / t, shape.head_dim
        return tokens * (w * (2 * h / sp + 2 * a * d + g * d + shape.ffn_hidden_size / t) + 4 * a)
    rep = (4 if shape.post_norms else 2) * _norm(h, w, kernels) + 2 * w * h  # Gemma: norms after attention, MLP
    if shape.mla is not None:  # latent projections' outputs (replicated over tp)
        m = shape.mla
        rep += w * (2 * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + 2 * (m.q_lora_rank or 0))
    seq_sharded, parallel = _mlp(shape, layer, layout, kernels, w, routed, fp8)
    if fp8:
        rep -= 2 * (w - 1) * h
        parallel += shape.num_attention_heads * (shape.mla.v_head_dim if shape.mla else shape.head_dim) / t
    return tokens * ((rep + seq_sharded) / sp + _attention(shape, seq, t, recompute, kernels, w) + parallel)
