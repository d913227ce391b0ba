"""Data-parallel and optimizer seconds of a step: gradient reduction and ZeRO gathers per bucket,
overlapped with the compute that runs meanwhile, the optimizer step and offload traffic.

Gradients are reduced in fp32 (Megatron-LM's default under --bf16; DeepSpeed's fp32
accumulation) and parameters gathered in 16-bit, over the GPUs holding the same weights
(dp x cp for dense weights, the expert data-parallel group for experts). Communication runs
in buckets (Megatron's max(40M, 1M x dp) elements with --overlap-grad-reduce, which the
generated Megatron-LM flags set; DeepSpeed's reduce_bucket_size h^2 otherwise); a bucket's
collective overlaps the compute that runs after its gradients are ready, so at least the last
bucket is exposed (``_overlapped``):
  ZeRO-0/1  the reduce-scatter (ZeRO-0: all-reduce) runs during the last micro-batch's backward
            of the stage and the pipeline drain behind it; the parameter all-gather of ZeRO-1
            during the next step's first forward (Megatron's --overlap-param-gather)
  ZeRO-2    a reduce-scatter behind every micro-batch's backward, one all-gather per step
  ZeRO-3    all-gathers of the parameters behind every forward and backward, the gradients'
            reduce-scatter behind every backward
The step waits for the slowest stage's reduction (the gradient norm spans the stages).
The optimizer step reads and writes OPTIMIZER_BYTES per parameter of this GPU's shard at
memory bandwidth (Adam in fp32: parameter, gradient, two moments read; parameter and moments
written; the 16-bit copy written). Offload: the gradients to host and parameters back over
PCIe (PCIE_GBPS) and the CPU Adam step (CPU_ADAM_PARAMS_PER_S per GPU) replace it; parameter
offload moves the parameters over PCIe twice per micro-batch.
"""
from __future__ import annotations

from itertools import accumulate

from ..hardware import GPU
from ..parallel.layout import Layout
from ..parallel.precision import element_bytes
from ..parallel.zero import sharded, shards
from ..spec import Zero
from .comm import collective, link_bandwidth
from .memory import StageParams
from .stage_time import StageTime

PCIE_GBPS = 25.0
CPU_ADAM_PARAMS_PER_S = 2.5e8
OPTIMIZER_BYTES = 30


def bucket_elements(target: str, hidden: int, shard: int) -> float:
    return max(40e6, 1e6 * shard) if target == "megatron-lm" else float(hidden * hidden)


def _overlapped(comm: float, work: float, bucket_fraction: float) -> float:
    """Exposed seconds of a bucketed collective overlapped with ``work``: at least one bucket."""
    return max(comm * bucket_fraction, comm - work)


def _stage_comm(lay: Layout, gpu: GPU, p: StageParams, zero: Zero, w_param: int,
                grad_bytes: int) -> tuple[float, float, float]:
    """(gradient reduction, parameter gather, parameters) of one GPU of a stage, per occurrence."""
    dense_n, expert_n = lay.dp_cp, lay.edp  # the GPUs holding the same weights
    dense_bw = link_bandwidth(lay.tp * lay.dp_cp, gpu, lay.gpus_per_node)
    expert_bw = link_bandwidth(lay.stage_ranks, gpu, lay.gpus_per_node)
    partitioned = sharded(zero.stage, "optimizer")  # each rank steps its shard: reduce-scatter, then gather it
    reduce = "reducescatter" if partitioned else "allreduce"
    grads = (collective(reduce, dense_n, grad_bytes * p.dense, dense_bw)
             + collective(reduce, expert_n, grad_bytes * p.expert, expert_bw))
    gather = 0.0 if not partitioned else (collective("allgather", dense_n, w_param * p.dense, dense_bw)
                                          + collective("allgather", expert_n, w_param * p.expert, expert_bw))
    return grads, gather, p.dense + p.expert


def stage_comms(lay: Layout, gpu: GPU, params: list[StageParams], zero: Zero, precision: str,
                grad_bytes: int = 4) -> list[tuple]:
    """(gradient reduction, parameter gather, parameters) seconds/count of one GPU of each stage;
    ``grad_bytes``: memory.grad_reduce_bytes."""
    w_param = element_bytes(precision)
    seen: dict = {}
    for p in params:  # one per distinct stage (not setdefault: that would compute it for every stage)
        if (p.dense, p.expert) not in seen:
            seen[(p.dense, p.expert)] = _stage_comm(lay, gpu, p, zero, w_param, grad_bytes)
    return [seen[(p.dense, p.expert)] for p in params]


def dp_seconds(lay: Layout, stages: list[StageTime], comms: list[tuple], zero_stage: int, *, grad_accum: int,
               bucket: float) -> float:
    """Exposed data-parallel seconds of a step; ``comms`` from stage_comms, ``bucket`` elements."""
    m, v = grad_accum, lay.vpp
    reduce_exposed = gather_exposed = 0.0
    first: dict = {}  # a repeated (stage, comm) exposes no more: its windows only grow along the pipeline
    for k, (st, comm) in enumerate(zip(stages, comms)):
        first.setdefault((id(st), id(comm)), k)
    # the backward / forward of the stages before each (the drain behind it, the fill before it)
    drains = [0.0, *accumulate(st.backward for st in stages)]
    fills = [0.0, *accumulate(st.forward for st in stages)]
    for k in first.values():
        st, (grads, gather, n) = stages[k], comms[k]
        backward, forward, drain_b, fill_f = st.backward, st.forward, drains[k], fills[k]
        if n and grads + gather:
            frac = min(1.0, bucket / n)
            if zero_stage <= 1:  # drain: earlier stages still run their last backward; fill: before the first forward
                r, g = _overlapped(grads, backward + drain_b / v, frac), _overlapped(gather, forward + fill_f / v, frac)
            elif zero_stage == 2:
                r, g = m * _overlapped(grads, backward, frac), _overlapped(gather, forward + fill_f / v, frac)
            else:
                r, g = m * _overlapped(grads + gather, backward, frac), m * _overlapped(gather, forward, frac)
            reduce_exposed, gather_exposed = max(reduce_exposed, r), max(gather_exposed, g)
    return reduce_exposed + gather_exposed


def optimizer_seconds(lay: Layout, gpu: GPU, params: list[StageParams], zero: Zero) -> float:
    """The optimizer step on this GPU's shard at memory bandwidth (0 when offloaded to the CPU)."""
    if zero.offload_optimizer != "none":
        return 0.0
    dense_n, expert_n = (shards(zero.stage, "optimizer", n) for n in (lay.dp_cp, lay.edp))
    shard = lambda p: p.dense / dense_n + p.expert / expert_n  # noqa: E731
    return max(shard(p) for p in params) * OPTIMIZER_BYTES / (gpu.memory_gbps * 1e9)


def offload_seconds(lay: Layout, params: list[StageParams], zero: Zero, grad_accum: int) -> float:
    p = max(params, key=lambda x: x.dense + x.expert)
    dense_shard = lay.dp_cp
    n = p.dense + p.expert
    t = 0.0
    if zero.offload_optimizer != "none":
        part = n / shards(zero.stage, "optimizer", dense_shard)
        t += part * 4 / (PCIE_GBPS * 1e9) + part / CPU_ADAM_PARAMS_PER_S
    if zero.offload_param != "none":
        t += grad_accum * 2 * n / dense_shard * 2 / (PCIE_GBPS * 1e9)
    return t
