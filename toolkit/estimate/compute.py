"""Seconds one GPU spends computing one micro-batch in one layer: the work each GPU does, at
the efficiency its shapes allow.

GEMMs (per GPU, M tokens x K inputs -> N outputs; tp splits N or K, the routed experts see
the tokens the dispatcher brings them): time = 2 M N K / (peak x e_gemm(M, N, K)) with

    e_gemm(M, N, K) = GEMM_EFFICIENCY x f(M) f(N) f(K),   f(x) = x / (x + TILE)

a large GEMM's fraction of the dense peak (one constant per GPU generation: an A100 runs its
large GEMMs closer to its 312 TFLOP/s than an H100 to its 989) times one saturating factor per
dimension: a
dimension of a few hundred leaves tiles and waves partly empty (1,024 tokens of a context-
parallel shard: f = 0.89; 8,192: 0.98 at TILE = 128). The backward pass runs the two GEMMs
(data gradient and weight gradient) of the same shape, 2x the forward.

Attention core (flash attention, causal): 2 (d_qk + d_v) x heads x queries x keys/2 FLOPs
forward (a sliding window of W < keys: W - W^2 / (2 keys) keys a query), 2.5x that backward
(flash recomputes the scores), at

    e_attn(c, d) = ATTENTION_EFFICIENCY x c / (c + ATTENTION_CHUNK) x f(d)

with c the query length of one attention call on this GPU (the sequence, its cp shard for the
ring and all-gather, the whole sequence for all-to-all) and d the head size. The unfused kernel
(attention.backend unfused) runs its two batched GEMMs un-masked (s x s x d per head) at
e_gemm and its softmax at memory bandwidth, sliding window or not (megatron's local attention
masks the full score matrix).

Memory-bound work at the GPU's memory bandwidth (hardware.GPU.memory_gbps): per layer and
token the two norms (four with post-norms; read + write h each), two residual adds (2 reads, 1 write of h), rotary
embedding of q and k, the SwiGLU (read 2f, write f), the MoE permutation (h read + written
twice per routed slot); 2x that backward. Not counted: biases, attention dropout (off in
these models' HF configs unless a config sets ``attention_dropout``; the flash kernel fuses it,
the unfused one adds one elementwise pass over the probabilities), the router's softmax and
top-k.

The constants are fitted once to published measurements (benchmarks/plan_compare_published.py
--fit; docs/planner.md lists them with the references): nothing here is set per case.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ..hardware import GPU
from ..models import ModelShape
from ..spec import MoE, TrainingSpec


@dataclass(frozen=True)
class Calibration:
    gemm_efficiency: float  # a large GEMM's fraction of the dense peak (Hopper)
    tile: float  # f(x) = x / (x + tile) per GEMM dimension and for the head size
    attention_efficiency: float  # flash attention's fraction of the dense peak on long sequences
    attention_chunk: float  # c / (c + attention_chunk) for a query length c per attention call
    ampere_gemm_efficiency: float  # the same on an A100: closer to its (3.2x lower) peak

    def for_gpu(self, gpu: GPU) -> Calibration:
        """The constants on ``gpu``: a large GEMM's fraction of the peak is per GPU generation."""
        return replace(self, gemm_efficiency=self.ampere_gemm_efficiency) if gpu.arch == "ampere" else self


CALIBRATION = Calibration(gemm_efficiency=0.65, tile=128.0, attention_efficiency=0.90, attention_chunk=512.0,
                          ampere_gemm_efficiency=0.70)


@dataclass(frozen=True)
class Dims:
    """The sizes the step-time model reads from a ModelShape (hashable, for caching)."""

    h: int
    heads: int
    groups: int
    d_qk: int
    d_v: int
    ffn: int
    vocab: int
    mla: tuple[int, int, int, int, int] | None  # q_lora (0: none), kv_lora, nope, rope, v
    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int
    norms: int = 2  # per layer: 4 with post-norms (Gemma 3)
    gate: bool = False  # the attention output gate: q projected twice as wide (Qwen3-Next)
    gdn: tuple[int, int, int, int, int] | None = None  # gated delta net: key heads, value heads, dk, dv, conv kernel


def model_dims(shape: ModelShape) -> Dims:
    m, a = shape.moe, shape.mla
    mla = None if a is None else (a.q_lora_rank or 0, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
                                  a.v_head_dim)
    d_qk = shape.head_dim if a is None else a.qk_nope_head_dim + a.qk_rope_head_dim
    la = shape.linear_attention
    gdn = None if la is None else (la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel)
    return Dims(shape.hidden_size, shape.num_attention_heads, shape.num_query_groups, d_qk,
                shape.head_dim if a is None else a.v_head_dim, shape.ffn_hidden_size, shape.vocab_size, mla,
                m.num_experts if m else 0, m.topk if m else 0, m.ffn_hidden_size if m else 0,
                m.shared_ffn_hidden_size if m else 0, 4 if shape.post_norms else 2, shape.attention_output_gate, gdn)


@dataclass(frozen=True)
class Gemm:
    m: float
    n: float
    k: float
    count: float = 1.0  # identical GEMMs (local experts)

    @property
    def flops(self) -> float:
        return 2 * self.m * self.n * self.k * self.count


def _f(x: float, x0: float) -> float:
    return x / (x + x0)


def gemm_seconds(g: Gemm, peak: float, cal: Calibration) -> float:
    """Forward seconds of a GEMM (backward: twice this)."""
    if g.m <= 0 or g.count == 0:
        return 0.0
    eff = cal.gemm_efficiency * _f(g.m, cal.tile) * _f(g.n, cal.tile) * _f(g.k, cal.tile)
    return g.flops / (peak * eff)


@dataclass(frozen=True)
class LayerWork:
    """What one layer of a kind does for one micro-batch on one GPU, before efficiencies."""

    attn_gemms: tuple[Gemm, ...]  # qkv (or MLA projections), proj
    mlp_gemms: tuple[Gemm, ...]  # dense fc1/fc2, or shared expert fc1/fc2
    expert_gemms: tuple[Gemm, ...]  # routed experts fc1/fc2 (count = local experts)
    elementwise_bytes: float  # forward memory traffic


def attention_gemms(dm: Dims, t: float, tp: int, linear: bool = False) -> tuple[Gemm, ...]:
    """The token mixer's projections: linear_qkv (with the output gate: q twice) and linear_proj;
    MLA's; a gated delta net layer's (``linear``) in_proj (q, k, v, z, b, a) and out_proj."""
    if linear:
        nk, nv, dk, dv, _ = dm.gdn
        return (Gemm(t, (2 * nk * dk + 2 * nv * dv + 2 * nv) / tp, dm.h), Gemm(t, dm.h, nv * dv / tp))
    if dm.mla is None:
        q = dm.heads * (2 if dm.gate else 1)
        return (Gemm(t, (q + 2 * dm.groups) * dm.d_qk / tp, dm.h), Gemm(t, dm.h, dm.heads * dm.d_v / tp))
    q_lora, kv_lora, nope, rope, v = dm.mla
    a = dm.heads / tp
    q = (Gemm(t, q_lora, dm.h), Gemm(t, a * (nope + rope), q_lora)) if q_lora else (Gemm(t, a * (nope + rope), dm.h),)
    return q + (Gemm(t, kv_lora + rope, dm.h), Gemm(t, a * (nope + v), kv_lora), Gemm(t, dm.h, a * v))


def mlp_gemms(ffn: int, h: int, t: float, tp: int) -> tuple[Gemm, ...]:
    return (Gemm(t, 2 * ffn / tp, h), Gemm(t, h, ffn / tp)) if ffn else ()


LoRASetting = tuple  # (rank, targets, shared_a): spec.finetune.lora, peft's own A per part where not shared_a


def lora_gemms(dm: Dims, t: float, tp: int, moe: bool, lora: LoRASetting, linear: bool = False) -> tuple[Gemm, ...]:
    """Forward GEMMs of LoRA's adapters on one layer's targeted projections (params.lora_weights'
    targets and splits): each adds x A^T (A: rank x in; a column-parallel projection's over its whole
    input, one per part, q, k and v, where the A is not shared) and then B (out x rank; a column-parallel
    projection's split over tp, a row-parallel one's whole, its A over the input shard). A MoE layer's
    MLP and MLA's projections other than linear_proj take none."""
    rank, targets, shared_a = lora
    attn = attention_gemms(dm, t, tp, linear)
    parts = {"in_proj": (attn[0], 2), "out_proj": (attn[-1], 1)} if linear else {"linear_proj": (attn[-1], 1)}
    if not linear and dm.mla is None:
        parts["linear_qkv"] = (attn[0], 3)
    if not moe and dm.ffn:
        fc1, fc2 = mlp_gemms(dm.ffn, dm.h, t, tp)
        parts.update(linear_fc1=(fc1, 2), linear_fc2=(fc2, 1))
    out: list[Gemm] = []
    for name in targets:
        if name in parts:
            g, n = parts[name]
            out += [Gemm(g.m, rank * (1 if shared_a else n), g.k), Gemm(g.m, g.n, rank)]
    return tuple(out)


def op_recompute_gemms(dm: Dims, t: float, tp: int) -> tuple[Gemm, ...]:
    """The GEMMs torchtitan's per-op checkpointing (recompute op) runs again in a dense layer's
    backward: its policy saves the output of every odd ``mm`` of a block's forward and recomputes
    every even one; in the order wq wk wv wo w1 w3 w2 those are wk, wo and w3 (the up projection).
    Checked with torch's own selective checkpointing and FLOP counter on transformers'
    LlamaDecoderLayer (tests/toolkit/estimate/test_op_recompute.py)."""
    return (Gemm(t, dm.groups * dm.d_qk / tp, dm.h), Gemm(t, dm.h, dm.heads * dm.d_v / tp),
            Gemm(t, dm.ffn / tp, dm.h))


def routed_tokens(dm: Dims, t: float, tp: int) -> float:
    """Tokens this GPU routes per micro-batch (sequence parallel splits them over tp)."""
    return t / tp


def routed_share(moe: MoE) -> float:
    """The (token, expert) slots the experts compute and the all-to-alls carry, per top-k
    routed token, under balanced routing (each expert receives tokens x top-k / experts):
    1 dropless; min(1, c) with a capacity factor c (megatron-core's get_capacity: an expert
    keeps at most ceil(c x its balanced share) of a rank's tokens, so only c < 1 drops any);
    c when padded to capacity (moe_pad_expert_input_to_capacity: every expert gets exactly
    its capacity from every rank, the NeMo/Megatron-Bridge "token drop" of capacity 1.0), with
    c = moe.capacity_factor and padding = moe.pad_to_capacity."""
    c = moe.capacity_factor
    if c is None:
        return 1.0
    return c if moe.pad_to_capacity else min(1.0, c)


def mixer_bytes(dm: Dims, tp: int, linear: bool) -> float:
    """Elements the token mixer's memory-bound work moves per token: rope of q and k; a gated
    delta net's conv1d (read and write q, k, v) and gated norm (read the output and z, write
    the output)."""
    if not linear:
        return 2 * (dm.heads + dm.groups) * dm.d_qk / tp
    nk, nv, dk, dv, _ = dm.gdn
    return (2 * (2 * nk * dk + nv * dv) + 3 * nv * dv) / tp


# Eager PyTorch (transformers' LlamaDecoderLayer, no torch.compile): bytes per token that its
# non-GEMM, non-attention aten ops read and write, one kernel each (RMSNorm in fp32 steps, rotary
# as mul/neg/cat/add, SiLU then mul, the residual adds), per unit of h, (heads + groups) x d, ffn
# and d (the rotary tables), forward and backward, in bf16. Counted with the installed
# transformers by benchmarks/eager_traffic.py on six shapes (within 0.3% of these sums);
# tests/toolkit/estimate/test_compute.py counts again.
EAGER_FORWARD = {"h": 84, "qk": 20, "ffn": 10, "d": 8}
EAGER_BACKWARD = {"h": 226, "qk": 32, "ffn": 18, "d": 8}


def eager_bytes(dm: Dims, t: float, tp: int, w: int) -> tuple[float, float]:
    """(forward, backward) elementwise bytes of a dense attention layer run eagerly, t tokens; in
    fp32 (w = 4) the 16-bit counts doubled (their fp32 steps are fp32 already: an upper bound)."""
    sizes = {"h": dm.h, "qk": (dm.heads + dm.groups) * dm.d_qk / tp, "ffn": dm.ffn / tp, "d": dm.d_qk}
    scale = t * w / 2
    return (scale * sum(EAGER_FORWARD[k] * v for k, v in sizes.items()),
            scale * sum(EAGER_BACKWARD[k] * v for k, v in sizes.items()))


# The loss over the logits, bytes per logit element (t x vocab / tp), forward and backward, by
# implementation (``loss_kind``; w: the logits' bytes, 4 in fp32, where .float() is the tensor itself):
#   none     megatron-core's vocab_parallel_cross_entropy (cross_entropy_loss_fusion off: megatron-core's
#            and Megatron-LM's default, Megatron-LM's code since 2019), one kernel per op: the fp32 copy
#            (read w, write 4), max (read 4), sub_ (4 + 4), exp into itself (4 + 4), sum (read 4), div_
#            (4 + 4); backward mul_ (4 + 4), the fp32 gradient cast back to the logits' dtype by autograd
#            (read 4, write w). benchmarks/eager_traffic.py --megatron-loss counts megatron-core's own
#            function op by op (tests/toolkit/estimate/test_eager.py).
#   native   megatron-core's fused_vocab_parallel_cross_entropy (cross_entropy_loss_fusion, impl native):
#            the same steps in four torch.compile'd functions (megatron.core.jit.jit_fuser), split by the
#            tp all-reduces, taken as one pass each over what they read and write: cast + max (read w,
#            write 4), sub + exp + sum (4 + 4), div (4 + 4); backward read the softmax, write it back (the
#            compiled function mutates its input) and its bf16 cast (w: megatron casts to bf16, bf16 only).
#   te       TransformerEngine's Triton cross entropy (impl te; transformer_engine/pytorch/triton/
#            cross_entropy.py at NVIDIA/TransformerEngine 02965d2): forward one online-softmax pass reading
#            the logits (w; the loss kernel reads only its per-row max and sum), backward one pass reading
#            them and writing the gradient into them (w + w). Read from the source, not counted.
#   eager    transformers' ForCausalLMLoss, and torchtitan's loss_fn at 9dec370 (train.py:
#            cross_entropy(pred.float(), ...)): the cast to fp32 (read w, write 4), log_softmax (4 + 4),
#            nll_loss reading one entry per token; backward nll_loss_backward writing the fp32 gradient
#            (4), log_softmax's backward reading it and its saved output and writing the input's gradient
#            (12), the cast back (4 + w). benchmarks/eager_traffic.py --loss counts the aten ops.
#   compiled the HF Trainer's torch.compile'd model (its loss inside the model's forward): the logits
#            read and an fp32 softmax written, backward twice that. Not counted.
LOSS_KINDS = ("none", "native", "te", "eager", "compiled")


def loss_kind(spec: TrainingSpec) -> str:
    """The loss's implementation (LOSS_KINDS): transformers' own with target hf (fp32, eager unless
    ``compile``), else megatron-core's as ``cross_entropy_fusion`` says."""
    if spec.target == "hf":
        return "compiled" if spec.compile else "eager"
    return spec.cross_entropy_fusion


def loss_bytes(kind: str, w: int) -> tuple[float, float]:
    """(forward, backward) bytes per logit element of the loss, by implementation (LOSS_KINDS)."""
    cast = 0 if w == 4 else w + 4
    if kind == "none":
        return 32 + cast, 8 + cast
    if kind == "native":
        return w + 20, 8 + w
    if kind == "te":
        return w, 2 * w
    if kind == "eager":
        return 8 + cast, 16 + cast
    if kind == "compiled":
        return w + 4, 2 * (w + 4)
    raise ValueError(f"loss kind {kind!r}: one of {LOSS_KINDS}")


def delta_rule_seconds(dm: Dims, t: float, tp: int, peak: float, cal: Calibration) -> float:
    """Forward seconds of the chunked gated delta rule (fla's kernel): its FLOPs (estimate.time.
    delta_rule_flops: 4 products with each value head's dk x dv state per token) at the
    efficiency of GEMMs of its 64-token chunks, e_gemm(64, dk, dv). Not fitted to a measurement."""
    _, nv, dk, dv, _ = dm.gdn
    return gemm_seconds(Gemm(64, dk, dv, 4 * nv / tp * t / 64), peak, cal)


@lru_cache(maxsize=65536)
def layer_work(dm: Dims, moe: bool, t: float, tp: int, etp: int, ep: int, sp: bool, w: int,
               routed: float = 1.0, linear: bool = False) -> LayerWork:
    """t: tokens of this GPU's sequence shard in one micro-batch (micro x seq / cp); routed:
    routed_share of the spec's capacity settings; linear: a gated delta net layer."""
    attn = attention_gemms(dm, t, tp, linear)
    seq_div = tp if sp else 1
    elem = (2 * dm.norms + 6) * dm.h / seq_div + mixer_bytes(dm, tp, linear)
    if not moe:
        mlp, experts = mlp_gemms(dm.ffn, dm.h, t, tp), ()
        elem += 3 * dm.ffn / tp
    else:
        slots = routed_tokens(dm, t, tp) * dm.topk * routed  # routed (token, expert) pairs this GPU sends
        per_expert = slots * ep * etp / dm.experts  # tokens one local expert receives (balanced routing)
        local = dm.experts / ep
        experts = (Gemm(per_expert, 2 * dm.expert_ffn / etp, dm.h, local),
                   Gemm(per_expert, dm.h, dm.expert_ffn / etp, local))
        mlp = mlp_gemms(dm.shared_ffn, dm.h, t, tp)
        elem += 3 * dm.shared_ffn / tp + slots / t * (4 * dm.h + 3 * dm.expert_ffn)
    return LayerWork(attn, mlp, experts, elem * t * w)


def attended_keys(seq: int, window: int | None = None) -> float:
    """Keys a query sees on average: seq/2 causal; with a sliding window of W < seq tokens,
    W - W^2 / (2 seq) (the first W queries see a triangle, the others W each)."""
    return seq / 2 if window is None or window >= seq else window - window * window / (2 * seq)


def attention_flops(dm: Dims, t: float, seq: int, tp: int, window: int | None = None) -> float:
    """Forward FLOPs of the causal attention core for t queries (a sliding window: only its keys)."""
    return 2 * (dm.d_qk + dm.d_v) * dm.heads / tp * t * attended_keys(seq, window)


def flash_seconds(dm: Dims, t: float, seq: int, tp: int, chunk: float, peak: float, cal: Calibration,
                  window: int | None = None) -> float:
    """Forward seconds of flash attention; ``chunk`` is the query length of one call; with a
    sliding window the kernel skips the blocks outside it (TransformerEngine's window_size)."""
    eff = cal.attention_efficiency * _f(chunk, cal.attention_chunk) * _f(dm.d_qk, cal.tile)
    return attention_flops(dm, t, seq, tp, window) / (peak * eff)


def unfused_seconds(dm: Dims, t: float, seq: int, tp: int, peak: float, mem_bw: float, cal: Calibration,
                    w: int) -> tuple[float, float]:
    """(forward, backward) seconds of megatron's local attention: two batched GEMMs over the whole
    s x s score matrix per head (no causal skip, nor a sliding window's: it masks the scores) and a
    fused softmax at memory bandwidth
    (forward reads the scores and writes the probabilities; backward reads two, writes one)."""
    micro = t / seq
    heads = micro * dm.heads / tp
    qk, pv = Gemm(seq, seq, dm.d_qk, heads), Gemm(seq, dm.d_v, seq, heads)
    gemm = gemm_seconds(qk, peak, cal) + gemm_seconds(pv, peak, cal)
    scores = heads * seq * seq * w
    return gemm + 2 * scores / mem_bw, 2 * gemm + 3 * scores / mem_bw


# TransformerEngine's FP8 casts (fp8 section): bytes moved per element of a linear layer's input
# (forward) and of its output gradient (backward), w = bytes of the 16-bit tensor. Each is read once
# and written twice in FP8, row-wise and, for the transposed GEMMs on Hopper, column-wise (TE's
# docs, "Performance considerations": Hopper cannot read FP8 column-wise); current per-tensor
# scaling (tensorwise) reads it once more for its amax first, delayed scaling takes the scale
# from the amax history and records the amax during the cast. Not counted: the weights' casts
# (once per step: TE caches them across the micro-batches) and the amax history's reduction.
def fp8_cast_bytes(recipe: str, w: int) -> float:
    return (2 * w if recipe == "tensorwise" else w) + 2


def fp8_cast_elements(gemms: tuple[Gemm, ...]) -> tuple[float, float]:
    """(forward, backward) elements TE quantizes for these GEMMs: their inputs (m x k) and their
    output gradients (m x n)."""
    return sum(g.m * g.k * g.count for g in gemms), sum(g.m * g.n * g.count for g in gemms)


def head_gemm(dm: Dims, t: float, tp: int, padded_vocab: int) -> Gemm:
    return Gemm(t, padded_vocab / tp, dm.h)


def peak_flops(gpu: GPU, precision: str) -> float:
    """FLOP/s of the GPU's tensor cores in ``precision`` (bf16, fp16, fp32; fp8: 0 without FP8 cores)."""
    return gpu.peak_tflops(precision) * 1e12


def memory_bandwidth(gpu: GPU) -> float:
    return gpu.memory_gbps * 1e9
