"""FLOPs per step and a step-time model whose assumptions are stated.

FLOPs: each matmul parameter a token passes through costs 2 FLOPs forward (MoE: router +
top-k experts + shared expert), the output layer 2hV, causal attention 2 x a x s x
(d_qk + d_v) / 2 per layer; training is 3 x forward (model FLOPs, used for MFU). Hardware
FLOPs add the recomputed forward (full: every layer; selective: the attention core).

Step time (one GPU's critical path, seconds):
  compute   hardware FLOPs / (world x dense peak x estimate.compute_efficiency)
  bubble    1F1B: (p-1)/(m+p-1) of the pipeline; interleaved: (p-1)/v in place of p-1
  tp        per layer and micro-batch 4 ring all-reduce equivalents (2 fwd + 2 bwd; with
            sequence parallel the same bytes as all-gather + reduce-scatter) of the
            micro-batch's activations, over NVLink when tp fits a node, else InfiniBand;
            not overlapped
  cp        ring exchange of K and V (x3 with backward), (1 - comm_overlap) exposed
  pp        one activation send per micro-batch and chunk each way, not overlapped
  ep        4 all-to-alls per MoE layer and micro-batch (dispatch, combine; fwd, bwd)
  dp        ZeRO-0/1: one all-reduce of the gradients per step; ZeRO-2: reduce-scatter
            every micro-batch + one all-gather; ZeRO-3: all-gather fwd + bwd and
            reduce-scatter every micro-batch; (1 - comm_overlap) exposed
  offload   optimizer offload: gradients to host and parameters back over PCIe
            (PCIE_GBPS) and the CPU Adam step (CPU_ADAM_PARAMS_PER_S per GPU);
            parameter offload: parameters over PCIe twice per micro-batch
Ring collectives move 2(n-1)/n (all-reduce) or (n-1)/n (all-gather, reduce-scatter,
all-to-all) of the buffer over the slowest link of the group.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..hardware import GPU
from ..models import ModelShape
from ..models.params import layer_weights
from ..spec import TrainingSpec
from .layout import BatchPlan, Layout, stage_layers
from .memory import _rank_params, stage_weights

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
    linear = sum(2 * _layer_matmul_params(shape, i) for i in range(shape.num_layers))
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
    comm_s: dict[str, float]  # exposed seconds per kind: tp, cp, pp, ep, dp, offload
    step_time_s: float
    tokens_per_s: float
    mfu: float
    train_tokens: float
    time_to_train_s: float

    @property
    def dominant(self) -> str:
        terms = {"compute": self.compute_s, "bubble": self.step_time_s * self.bubble_fraction, **self.comm_s}
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


def comm_times(spec: TrainingSpec, shape: ModelShape, lay: Layout, batch: BatchPlan, gpu: GPU) -> dict[str, float]:
    w = 4 if spec.precision == "fp32" else 2
    g = lay.gpus_per_node
    m, L = batch.grad_accum, stage_layers(shape.num_layers, lay.pp)[0]
    tokens = batch.micro * batch.seq_len / lay.cp
    act = tokens * shape.hidden_size * w
    hidden = 1 - spec.estimate.comm_overlap
    full = spec.recompute == "full"
    tp = L * m * (4 + (2 if full else 0)) * _ring(lay.tp, act, _bw(lay.tp, gpu, g), allreduce=True)
    kv = tokens * 2 * shape.num_query_groups * shape.head_dim * w / lay.tp
    cp = hidden * L * m * 3 * (lay.cp - 1) * kv / _bw(lay.tp * lay.cp, gpu, g)
    pp_bytes = act / (lay.tp if lay.sequence_parallel else 1)
    pp = 0.0 if lay.pp == 1 else 2 * m * lay.vpp * pp_bytes / _bw(lay.world // lay.pp + 1, gpu, g)
    ep = 0.0
    if shape.moe is not None and lay.ep > 1:
        moe_layers = shape.moe.num_moe_layers / lay.pp
        a2a = tokens / (lay.tp if lay.sequence_parallel else 1) * shape.moe.topk * shape.hidden_size * w
        ep = moe_layers * m * 4 * _ring(lay.ep, a2a, _bw(lay.etp * lay.ep, gpu, g))
    dense, expert, _ = _rank_params(stage_weights(shape, lay, 0), lay)
    dp = hidden * (_dp_time(spec.zero.stage, m, lay.dp, dense * w, _bw(lay.tp * lay.cp * lay.dp, gpu, g))
                   + _dp_time(spec.zero.stage, m, lay.edp, expert * w, _bw(lay.world // lay.pp, gpu, g)))
    return {"tp": tp, "cp": cp, "pp": pp, "ep": ep, "dp": dp, "offload": _offload_time(spec, lay, m, dense + expert)}


def _dp_time(stage: int, m: int, n: int, nbytes: float, bw: float) -> float:
    if stage <= 1:
        return _ring(n, nbytes, bw, allreduce=True)
    if stage == 2:
        return m * _ring(n, nbytes, bw) + _ring(n, nbytes, bw)
    return m * 3 * _ring(n, nbytes, bw)


def _offload_time(spec: TrainingSpec, lay: Layout, m: int, params: float) -> float:
    t = 0.0
    if spec.zero.offload_optimizer != "none":
        shard = params / (lay.dp if spec.zero.stage >= 1 else 1)
        t += shard * 4 / (PCIE_GBPS * 1e9) + shard / CPU_ADAM_PARAMS_PER_S
    if spec.zero.offload_param != "none":
        t += m * 2 * params / lay.dp * 2 / (PCIE_GBPS * 1e9)
    return t


def estimate_time(spec: TrainingSpec, shape: ModelShape, lay: Layout, batch: BatchPlan, gpu: GPU) -> TimeEstimate:
    model, hardware = step_flops(shape, batch, spec.recompute)
    peak = gpu.peak_tflops(spec.precision) * 1e12
    compute = hardware / lay.world / (peak * spec.estimate.compute_efficiency)
    comm = comm_times(spec, shape, lay, batch, gpu)
    m, p, v = batch.grad_accum, lay.pp, lay.vpp
    warm = (p - 1) / v
    bubble = warm / (m + warm) if p > 1 else 0.0
    per_microbatch_path = compute + comm["tp"] + comm["cp"] + comm["ep"]
    step = per_microbatch_path / (1 - bubble) + comm["pp"] + comm["dp"] + comm["offload"]
    tokens_per_s = batch.tokens / step
    train_tokens = spec.estimate.tokens or float(spec.train.steps * batch.tokens)
    return TimeEstimate(model, hardware, compute, bubble, comm, step, tokens_per_s,
                        model / (step * lay.world * peak), train_tokens, train_tokens / tokens_per_s)
