"""Per-GPU memory estimate, stage by stage; the plan reports the worst stage.

Model states (bytes per parameter held by this GPU, N = the ZeRO sharding degree: dp for
dense weights, expert-dp for expert weights), mixed precision with Adam:

  stage | params | grads                 | optimizer (fp32 master + m + v)
  0     | 2      | 2 + 4 (fp32 copy)     | 12
  1     | 2      | 2 + 4/N               | 12/N
  2     | 2      | 2/N + 4/N             | 12/N
  3     | 2/N    | 4/N                   | 12/N      + 4 x largest module (gathered 16-bit param + grad)

DeepSpeed converts its gradient partition to fp32 for the optimizer step, hence the 4-byte
term: this is exactly DeepSpeed's own estimate (ZeRO-2: 2P + 18P/N; ZeRO-3: 4L + 18P/N;
with optimizer offload 2P and 4L + 2P/N; with parameter offload too 4L). The ZeRO paper's
(and the seeds') 16 bytes/parameter count params 2 + grads 2 + optimizer 12 and is reported
as ``classic_model_states``. fp32 training: params 4, grads 4, optimizer 8 (m + v).

Activations follow Korthikanti et al. 2022, re-derived for RMSNorm + SwiGLU + GQA with no
dropout (16-bit bytes per token per layer, h hidden, a heads, g groups, d head size,
f ffn): norms 4h + qkv input 2h + mlp input 2h (divided by t only with sequence parallel),
Q 2ad + K,V 4gd + projection input 2ad + SwiGLU 6f (divided by t), plus the 2as score
matrix unless flash attention or selective recompute removes it. Llama-70B: 33.5h, the
paper's 34h. Full recompute keeps each layer's 2h input plus one layer's working set.
Pipeline: stage k holds min(m, p - k + (p - 1)/v) micro-batches in flight (1F1B; v = 1:
p - k; interleaved adds (p - 1)/v, Korthikanti's L(1 + (p - 1)/(pv)) on stage 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models import ModelShape
from ..models.params import embedding_weights, head_weights, layer_weights
from ..spec import TrainingSpec
from .layout import BatchPlan, Layout, padded_vocab, stage_layers

GiB = 1024**3


@dataclass(frozen=True)
class StageMemory:
    stage: int
    params: float  # bytes
    grads: float
    optimizer: float
    activations: float
    buffers: float
    cpu_offloaded: float  # bytes of this GPU's model states kept in host memory / NVMe

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers

    def gib(self) -> dict[str, float]:
        return {k: round(v / GiB, 3) for k, v in
                dict(params=self.params, grads=self.grads, optimizer=self.optimizer,
                     activations=self.activations, buffers=self.buffers, total=self.total).items()}


@dataclass(frozen=True)
class MemoryEstimate:
    stages: tuple[StageMemory, ...]
    gpu_gib: float
    classic_model_states: float  # 16 bytes x all parameters (unsharded), bytes

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    def fits(self, headroom: float = 0.0) -> bool:
        return self.worst.total <= self.gpu_gib * GiB * (1 - headroom)


# ---------------------------------------------------------------------------- model states
def model_state_bytes(n: float, shard: int, *, stage: int, precision: str, offload_optimizer: bool,
                      offload_param: bool) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, offloaded) bytes on one GPU for n parameters held by it
    before ZeRO, sharded `shard` ways by ZeRO."""
    mixed = precision != "fp32"
    w, g, opt = (2, 2, 12) if mixed else (4, 4, 8)
    fp32_grad = 4 if mixed else 0
    shard_w = shard if stage >= 3 else 1
    shard_g = shard if stage >= 2 else 1
    shard_o = shard if stage >= 1 else 1
    params = w * n / shard_w
    grads = (g * n / shard_g if stage < 3 else 0) + fp32_grad * n / shard_o
    optimizer = opt * n / shard_o
    offloaded = 0.0
    if offload_optimizer:
        offloaded += optimizer + fp32_grad * n / shard_o
        optimizer, grads = 0.0, (g * n if stage < 2 else 0.0)
    if offload_param:
        offloaded += params
        params = 0.0
    return params, grads, optimizer, offloaded


def _rank_params(weights, layout: Layout) -> tuple[float, float, int]:
    """(dense, expert, largest module) parameters one GPU holds of these weights."""
    dense = expert = 0.0
    largest = 0
    for w in weights:
        if w.split == "expert":
            per_gpu = w.total / (layout.ep * layout.etp)
            expert += per_gpu
            largest = max(largest, int(w.numel / layout.etp))
        else:
            n = w.numel / (layout.tp if w.split in ("tp", "vocab") else 1)
            dense += n
            largest = max(largest, int(n))
    return dense, expert, largest


def stage_weights(shape: ModelShape, layout: Layout, stage: int) -> list:
    vocab = padded_vocab(shape.vocab_size, layout.tp)
    per = stage_layers(shape.num_layers, layout.pp)
    first = sum(per[:stage])
    ws = [w for i in range(first, first + per[stage]) for w in layer_weights(shape, i)]
    if stage == 0:
        ws += embedding_weights(shape, vocab)
    if stage == layout.pp - 1:
        ws += head_weights(shape, vocab)
        if shape.tie_embeddings and layout.pp > 1:  # last stage keeps its own copy for the output layer
            ws += embedding_weights(shape, vocab)
    return ws


# ---------------------------------------------------------------------------- activations
def layer_activation_bytes(shape: ModelShape, layer: int, *, tokens: float, seq: int, layout: Layout,
                           recompute: str, flash: bool, act_bytes: int) -> float:
    """Bytes one micro-batch leaves stored in one layer for the backward pass (per GPU).
    tokens = micro * seq_len / cp: the tokens this GPU's sequence shard holds."""
    h, t = shape.hidden_size, layout.tp
    sp = t if layout.sequence_parallel else 1
    u = act_bytes / 2  # scale of the 16-bit terms
    rep = 8 * h  # two norm inputs, qkv input, mlp input
    if shape.mla is None:
        a, g, d = shape.num_attention_heads, shape.num_query_groups, shape.head_dim
        heads = 4 * a * d + 4 * g * d
    else:
        m, a = shape.mla, shape.num_attention_heads
        rep += 2 * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * m.kv_lora_rank + 4 * (m.q_lora_rank or 0)
        heads = 4 * a * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 4 * a * m.v_head_dim
    core = 4 * a / t / u if flash else 2 * a * seq / t  # fp32 log-sum-exp, or the 16-bit score matrix
    if recompute == "selective" and not flash:
        core = 0.0
    if shape.is_moe_layer(layer):
        mo = shape.moe
        # balanced routing: each GPU computes top-k expert slots for as many tokens as it holds
        routed = mo.topk * (2 * h + 6 * mo.ffn_hidden_size / layout.etp) + 4 * mo.num_experts / u
        mlp = routed / sp + 6 * mo.shared_ffn_hidden_size / t
    else:
        mlp = 6 * shape.ffn_hidden_size / t
    if recompute == "full":
        return tokens * 2 * h / sp * u  # only the layer input is kept
    return tokens * (rep / sp + heads / t + mlp + core) * u


def stage_activation_bytes(shape: ModelShape, layout: Layout, batch: BatchPlan, stage: int, *,
                           recompute: str, flash: bool, act_bytes: int) -> float:
    tokens = batch.micro * batch.seq_len / layout.cp
    per = stage_layers(shape.num_layers, layout.pp)
    first = sum(per[:stage])
    layers = range(first, first + per[stage])
    kw = dict(tokens=tokens, seq=batch.seq_len, layout=layout, flash=flash, act_bytes=act_bytes)
    stored = sum(layer_activation_bytes(shape, i, recompute=recompute, **kw) for i in layers)
    p, v, m = layout.pp, layout.vpp, batch.grad_accum
    in_flight = min(m, (p - stage) + ((p - 1) / v if v > 1 else 0))
    total = stored * in_flight
    if recompute == "full":  # one layer is rebuilt at a time during backward
        total += max(layer_activation_bytes(shape, i, recompute="none", **kw) for i in layers)
    if stage == p - 1:  # logits (16-bit) and the fp32 softmax of the vocab-parallel cross entropy
        total += tokens * padded_vocab(shape.vocab_size, layout.tp) / layout.tp * (act_bytes + 4)
    return total


# ---------------------------------------------------------------------------- the estimate
def bucket_bytes(spec: TrainingSpec, shape: ModelShape) -> float:
    """DeepSpeed communication buckets (sizes as emitted in ds_config.json)."""
    from ..emit.deepspeed import bucket_sizes

    b = bucket_sizes(spec, shape)
    w = 4 if spec.precision == "fp32" else 2
    if spec.zero.stage == 3:
        return w * (b["stage3_prefetch_bucket_size"] + b["reduce_bucket_size"])
    if spec.zero.stage in (1, 2):
        return w * 2 * b["reduce_bucket_size"]  # overlap_comm: two gradient buckets in flight
    return 0.0


def estimate_memory(spec: TrainingSpec, shape: ModelShape, layout: Layout, batch: BatchPlan,
                    gpu_gib: float) -> MemoryEstimate:
    z = spec.zero
    act_bytes = 4 if spec.precision == "fp32" else 2
    buffers = spec.estimate.buffer_gib * GiB + bucket_bytes(spec, shape)
    stages = []
    for k in range(layout.pp):
        dense, expert, largest = _rank_params(stage_weights(shape, layout, k), layout)
        kw = dict(stage=z.stage, precision=spec.precision, offload_optimizer=z.offload_optimizer != "none",
                  offload_param=z.offload_param != "none")
        d = model_state_bytes(dense, layout.dp, **kw)
        e = model_state_bytes(expert, layout.edp, **kw)
        params, grads, opt, off = (x + y for x, y in zip(d, e))
        if z.stage == 3:  # DeepSpeed's 4 x largest layer: gathered 16-bit params and grads
            params, grads = params + 2 * largest, grads + 2 * largest
        acts = stage_activation_bytes(shape, layout, batch, k, recompute=spec.recompute,
                                      flash=spec.attention.backend == "flash", act_bytes=act_bytes)
        stages.append(StageMemory(k, params, grads, opt, acts, buffers, off))
    from ..models import total_params

    return MemoryEstimate(tuple(stages), gpu_gib, 16.0 * total_params(shape))
