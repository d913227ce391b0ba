"""The cost/memory refinements made for the planner, checked by hand: ZeRO sharding and
gradient reduction over dp x cp, and MoE traffic (attention-only tp, expert tp, all-to-all)."""
import math

import pytest

from toolkit.models import total_params
from toolkit.plan import make_plan
from toolkit.estimate.comm import NCCL_EFFICIENCY, collective, nccl_latency
from toolkit.estimate.data_time import BOTH, _stage_comm, buckets, megatron_buckets
from toolkit.estimate.memory import stage_params
from toolkit.spec import TrainingSpec

from tests.conftest import spec_dict

NVLINK, IB = 450e9 * NCCL_EFFICIENCY, 50e9 * NCCL_EFFICIENCY


def test_zero_shards_and_reduces_over_dp_times_cp():
    """Context-parallel ranks hold the same weights: cp=2 with dp=2 shards like dp=4."""
    base = {"model": "llama3-8b", "parallel.tp": 2, "zero.stage": 1, "batch.global": 64}
    cp2 = make_plan(TrainingSpec.from_dict(spec_dict(**base, **{"parallel.cp": 2})))
    cp1 = make_plan(TrainingSpec.from_dict(spec_dict(**base)))
    assert (cp2.layout.dp, cp1.layout.dp) == (2, 4)
    assert cp2.memory.worst.optimizer == pytest.approx(cp1.memory.worst.optimizer, rel=1e-12)
    params = cp1.memory.worst.params / 2  # bf16 weights of one GPU, unsharded at ZeRO-1
    assert cp2.memory.worst.optimizer == pytest.approx(12 * params / 4, rel=1e-12)
    p = stage_params(cp2.shape, cp2.layout, 0)
    bucket = buckets("megatron-lm", "bf16", cp2.spec.zero, cp2.layout, cp2.shape.hidden_size)
    grads, gather, _, _, host, _ = _stage_comm(cp2.layout, cp2.gpu, p, cp2.spec.zero, 2, 4, bucket)
    assert host == 0.0  # ZeRO-1: no hooks
    # Megatron's buckets, max(40M, 1M x dp x cp) elements over whole tensors, in reverse: Llama-3-8B at tp 2
    # is 65 of them (the output layer's 263M alone; the last layer's fc2 and fc1; then in each layer below,
    # fc2 with the attention of the layer above, and fc1 alone; the embedding with the first layer's
    # attention), not 101 = its elements / 40M
    calls = megatron_buckets(p.tensors, BOTH, 40e6, p.shared)[0]
    assert calls == 1 + 1 + 2 * 31 + 1 and math.ceil((p.dense + p.expert) / 40e6) == 101
    assert grads == pytest.approx(collective("reducescatter", 4, 4 * params, NVLINK,
                                             calls * nccl_latency("reducescatter", 4, 4)), rel=1e-12)
    assert gather == pytest.approx(collective("allgather", 4, 2 * params, NVLINK,
                                              calls * nccl_latency("allgather", 4, 4)), rel=1e-12)
    assert total_params(cp1.shape) > 8e9


def test_moe_traffic_terms_by_hand():
    """Mixtral (no shared expert), tp=2 etp=2 ep=4 on 16 GPUs: tp only around attention, expert tp
    all-gathers/reduce-scatters the routed tokens, all-to-all over ep, all inside a node, every
    collective exposed but the column-parallel backward ones (hidden behind the GEMMs here)."""
    p = make_plan(TrainingSpec.from_dict(spec_dict(**{
        "model": "mixtral-8x7b", "cluster.nodes": 2, "parallel.tp": 2, "parallel.ep": 4, "parallel.etp": 2,
        "parallel.pp": 1, "batch.global": 64})))
    m, tokens, h, L = p.batch.grad_accum, p.batch.micro * p.batch.seq_len, p.shape.hidden_size, 32
    routed = tokens / 2 * 2 * h * 2  # tokens this GPU routes (sequence parallel) x top-2 x h x bf16
    c = collective("allgather", 2, tokens * h * 2, NVLINK)
    sec = p.time.seconds
    edge = c + c  # the embedding's reduce-scatter and the output layer's all-gather (forward)
    assert sec["tp"] == pytest.approx(m * (L * (2 * c + c) + edge), rel=1e-12)  # fwd AG + RS, bwd AG of grad output
    assert sec["etp"] == pytest.approx(m * L * 2 * 2 * collective("allgather", 2, 2 * routed, NVLINK), rel=1e-12)
    assert sec["ep"] == pytest.approx(m * L * 2 * 2 * collective("alltoall", 4, routed, NVLINK), rel=1e-12)
    across = make_plan(p.spec.with_overrides({"parallel.etp": 16, "parallel.ep": 1}))
    assert across.time.seconds["etp"] / sec["etp"] == pytest.approx(
        collective("allgather", 16, 16 * routed, IB) / collective("allgather", 2, 2 * routed, NVLINK), rel=1e-12)
