"""FLOPs per step and a step-time model whose assumptions are stated.

FLOPs: each matmul parameter a token passes through costs 2 FLOPs forward (MoE: router +
top-k experts + shared expert), the output layer 2hV, causal attention 2 x a x s x
(d_qk + d_v) / 2 per layer; training is 3 x forward (model FLOPs, used for MFU). Hardware
FLOPs add the recomputed forward (full: every layer; selective: the attention core).

Step time (one GPU's critical path, seconds):
  compute   hardware FLOPs / (world x dense peak x estimate.compute_efficiency): one
            per-GPU efficiency for every layout (no dependence on GEMM shapes)
  bubble    1F1B: (p-1)/(m+p-1) of the pipeline; interleaved: (p-1)/v in place of p-1
  tp        per layer and micro-batch 2 ring all-reduce equivalents for attention and 2
            for a dense MLP or shared expert (1 fwd + 1 bwd each; with sequence parallel
            the same bytes as all-gather + reduce-scatter) of the micro-batch's
            activations, over NVLink when tp fits a node, else InfiniBand; not overlapped;
            full recompute adds the forward's again (dense model: 4, or 6, per layer)
  etp       expert tensor parallelism: per MoE layer and micro-batch the routed tokens
            (top-k x the tokens this GPU routes x h) are all-gathered and reduce-scattered
            over the etp group, 1 all-reduce equivalent fwd + 1 bwd (+1 full recompute)
  cp        ring exchange of K and V (x3 with backward), (1 - comm_overlap) exposed
  pp        one activation send per micro-batch and chunk each way (interleaving sends v
            times as often), not overlapped
  ep        4 all-to-alls per MoE layer and micro-batch (dispatch, combine; fwd, bwd)
  dp        over the dp x cp GPUs that hold the same dense weights (context-parallel
            ranks reduce their gradients together) and the expert data-parallel GPUs:
            ZeRO-0/1: one all-reduce of the gradients per step; ZeRO-2: reduce-scatter
            every micro-batch + one all-gather; ZeRO-3: all-gather fwd + bwd and
            reduce-scatter every micro-batch; (1 - comm_overlap) exposed
  offload   optimizer offload: gradients to host and parameters back over PCIe
            (PCIE_GBPS) and the CPU Adam step (CPU_ADAM_PARAMS_PER_S per GPU);
            parameter offload: parameters over PCIe twice per micro-batch
Ring collectives move 2(n-1)/n (all-reduce) or (n-1)/n (all-gather, reduce-scatter,
all-to-all) of the buffer over the slowest link of the group; a group of consecutive
ranks (Megatron order tp-cp-ep-dp-pp) is intra-node while it spans at most one node.
tp, etp, cp, pp and ep traffic depends on the layout, micro batch and recompute only
(``parallel_comm``); dp and offload traffic also on ZeRO (``data_comm``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..hardware import GPU
from ..models import ModelShape
from ..models.params import layer_weights
from ..spec import TrainingSpec, Zero
from .layout import BatchPlan, Layout
from .memory import StageParams, micro_batch_tokens, stage_params, zero_shards

PCIE_GBPS = 25.0
CPU_ADAM_PARAMS_PER_S = 2.5e8


# ---------------------------------------------------------------------------- FLOPs
def _layer_matmul_params(shape: ModelShape, layer: int) -> float:
    n = 0.0
    for w in layer_weights(shape, layer):
        if "layernorm" in w.module:
            continue
        n += w.numel * (shape.moe.topk if w.split == "expert" else 1)
    return n


def _attention_dims(shape: ModelShape) -> tuple[int, int]:
    if shape.mla is not None:
        m = shape.mla
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return shape.head_dim, shape.head_dim


def forward_flops_per_token(shape: ModelShape, seq_len: int) -> tuple[float, float]:
    """(all forward FLOPs, attention-core part) per token."""
    dqk, dv = _attention_dims(shape)
    core = shape.num_layers * 2 * shape.num_attention_heads * seq_len * (dqk + dv) / 2
    kinds: dict[bool, list[int]] = {}  # a layer's weights depend on its index only through is_moe_layer
    for i in range(shape.num_layers):
        kinds.setdefault(shape.is_moe_layer(i), []).append(i)
    linear = sum(2 * _layer_matmul_params(shape, idx[0]) * len(idx) for idx in kinds.values())
    return linear + core + 2 * shape.hidden_size * shape.vocab_size, core


def step_flops(shape: ModelShape, batch: BatchPlan, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one optimizer step."""
    fwd, core = forward_flops_per_token(shape, batch.seq_len)
    model = 3 * fwd * batch.tokens
    extra = {"none": 0.0, "selective": core,
             "full": fwd - 2 * shape.hidden_size * shape.vocab_size}[recompute]
    return model, model + extra * batch.tokens


# ---------------------------------------------------------------------------- time
@dataclass(frozen=True)
class TimeEstimate:
    model_flops: float
    hardware_flops: float
    compute_s: float
    bubble_fraction: float
    comm_s: dict[str, float]  # exposed seconds per kind: tp, etp, cp, pp, ep, dp, offload
    step_time_s: float
    tokens_per_s: float
    mfu: float
    train_tokens: float
    time_to_train_s: float

    @property
    def terms(self) -> dict[str, float]:
        """Seconds per step by cause: compute, the pipeline bubble, exposed communication by kind."""
        return {"compute": self.compute_s, "bubble": self.step_time_s * self.bubble_fraction, **self.comm_s}

    @property
    def dominant(self) -> str:
        terms = self.terms
        return max(terms, key=terms.get)

    def as_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "model_tflops_per_step": self.model_flops / 1e12, "compute_s": self.compute_s,
                "bubble_fraction": self.bubble_fraction, "comm_s": dict(self.comm_s),
                "dominant": self.dominant, "train_tokens": self.train_tokens,
                "time_to_train_days": self.time_to_train_s / 86400}


def _bw(group_span: int, gpu: GPU, gpus_per_node: int) -> float:
    """Bytes/s of the slowest link of a group spanning `group_span` consecutive ranks."""
    return (gpu.intra_node_gbps if group_span <= gpus_per_node else gpu.inter_node_gbps) * 1e9


def _ring(n: int, nbytes: float, bw: float, allreduce: bool = False) -> float:
    return 0.0 if n <= 1 else (2 if allreduce else 1) * (n - 1) / n * nbytes / bw


def parallel_comm(shape: ModelShape, lay: Layout, batch: BatchPlan, gpu: GPU, *, precision: str,
                  overlap: float, recompute: str) -> dict[str, float]:
    """Exposed tp, etp, cp, pp and ep seconds per step (one GPU of the first stage)."""
    w = 4 if precision == "fp32" else 2
    g = lay.gpus_per_node
    split = lay.pipeline(shape.num_layers)
    m, L = batch.grad_accum, max(split.stage_count(k) for k in range(lay.pp))  # the slowest stage sets the pace
    moe = shape.moe
    moe_layers = moe.num_moe_layers / lay.pp if moe is not None else 0.0
    tp_mlp_layers = L - moe_layers + (moe_layers if moe is not None and moe.shared_ffn_hidden_size else 0.0)
    passes = 2 + (1 if recompute == "full" else 0)  # fwd + bwd (+ recomputed fwd)
    tokens = micro_batch_tokens(lay, batch)
    act = tokens * shape.hidden_size * w
    tp = (L + tp_mlp_layers) * m * passes * _ring(lay.tp, act, _bw(lay.tp, gpu, g), allreduce=True)
    kv = tokens * 2 * shape.num_query_groups * shape.head_dim * w / lay.tp
    cp = (1 - overlap) * L * m * 3 * (lay.cp - 1) * kv / _bw(lay.tp * lay.cp, gpu, g)
    pp_bytes = act / (lay.tp if lay.sequence_parallel else 1)
    pp = 0.0 if lay.pp == 1 else 2 * m * lay.vpp * pp_bytes / _bw(lay.world // lay.pp + 1, gpu, g)
    ep = etp = 0.0
    if moe is not None:
        routed = tokens / (lay.tp if lay.sequence_parallel else 1) * moe.topk * shape.hidden_size * w
        ep = moe_layers * m * 4 * _ring(lay.ep, routed, _bw(lay.etp * lay.ep, gpu, g))
        etp = moe_layers * m * passes * _ring(lay.etp, lay.etp * routed, _bw(lay.etp, gpu, g), allreduce=True)
    return {"tp": tp, "etp": etp, "cp": cp, "pp": pp, "ep": ep}


def data_comm(lay: Layout, batch: BatchPlan, gpu: GPU, stage0: StageParams, *, precision: str, overlap: float,
              zero: Zero) -> dict[str, float]:
    """Exposed dp (gradient reduction, ZeRO gathers) and offload seconds per step."""
    w = 4 if precision == "fp32" else 2
    g, m = lay.gpus_per_node, batch.grad_accum
    dense_shard, expert_shard = zero_shards(lay)
    dp = (1 - overlap) * (
        _dp_time(zero.stage, m, dense_shard, stage0.dense * w, _bw(lay.tp * lay.cp * lay.dp, gpu, g))
        + _dp_time(zero.stage, m, expert_shard, stage0.expert * w, _bw(lay.world // lay.pp, gpu, g)))
    return {"dp": dp, "offload": _offload_time(zero, dense_shard, m, stage0.dense + stage0.expert)}


def _dp_time(stage: int, m: int, n: int, nbytes: float, bw: float) -> float:
    if stage <= 1:
        return _ring(n, nbytes, bw, allreduce=True)
    if stage == 2:
        return m * _ring(n, nbytes, bw) + _ring(n, nbytes, bw)
    return m * 3 * _ring(n, nbytes, bw)


def _offload_time(zero: Zero, shard: int, m: int, params: float) -> float:
    t = 0.0
    if zero.offload_optimizer != "none":
        part = params / (shard if zero.stage >= 1 else 1)
        t += part * 4 / (PCIE_GBPS * 1e9) + part / CPU_ADAM_PARAMS_PER_S
    if zero.offload_param != "none":
        t += m * 2 * params / shard * 2 / (PCIE_GBPS * 1e9)
    return t


def comm_times(spec: TrainingSpec, shape: ModelShape, lay: Layout, batch: BatchPlan, gpu: GPU) -> dict[str, float]:
    overlap = spec.estimate.comm_overlap
    return {**parallel_comm(shape, lay, batch, gpu, precision=spec.precision, overlap=overlap,
                            recompute=spec.recompute),
            **data_comm(lay, batch, gpu, stage_params(shape, lay, 0), precision=spec.precision, overlap=overlap,
                        zero=spec.zero)}


def compute_seconds(hardware_flops: float, world: int, gpu: GPU, precision: str, efficiency: float) -> float:
    return hardware_flops / world / (gpu.peak_tflops(precision) * 1e12 * efficiency)


def bubble_fraction(lay: Layout, grad_accum: int) -> float:
    if lay.pp == 1:
        return 0.0
    warm = (lay.pp - 1) / lay.vpp
    return warm / (grad_accum + warm)


def step_seconds(compute: float, bubble: float, comm: dict[str, float]) -> float:
    """The per-micro-batch path (compute, tp, etp, cp, ep) stretched by the bubble, plus pp, dp, offload."""
    per_microbatch_path = compute + comm["tp"] + comm["etp"] + comm["cp"] + comm["ep"]
    return per_microbatch_path / (1 - bubble) + comm["pp"] + comm["dp"] + comm["offload"]


def estimate_time(spec: TrainingSpec, shape: ModelShape, lay: Layout, batch: BatchPlan, gpu: GPU) -> TimeEstimate:
    model, hardware = step_flops(shape, batch, spec.recompute)
    compute = compute_seconds(hardware, lay.world, gpu, spec.precision, spec.estimate.compute_efficiency)
    comm = comm_times(spec, shape, lay, batch, gpu)
    bubble = bubble_fraction(lay, batch.grad_accum)
    step = step_seconds(compute, bubble, comm)
    tokens_per_s = batch.tokens / step
    train_tokens = spec.estimate.tokens or float(spec.train.steps * batch.tokens)
    peak = gpu.peak_tflops(spec.precision) * 1e12
    return TimeEstimate(model, hardware, compute, bubble, comm, step, tokens_per_s,
                        model / (step * lay.world * peak), train_tokens, train_tokens / tokens_per_s)
