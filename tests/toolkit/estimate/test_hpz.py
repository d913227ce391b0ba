"""ZeRO++ hierarchical partitioning (zero.hpz_partition_size, DeepSpeed's zero_hpz_partition_size) in
the estimates: the secondary partition's memory and the backward's all-gather within a node."""
import pytest

from tests.conftest import spec_dict
from toolkit.errors import SpecError
from toolkit.estimate.comm import collective, link_bandwidth, nccl_latency, ring_bandwidth
from toolkit.estimate.data_time import buckets, stage_comms, tensor_calls
from toolkit.estimate.memory import stage_params
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec


def _plan(nodes: int, hpz: int):
    """Llama-3.1-8B under ZeRO-3 (FSDP-like, tp 1), 1,024 tokens per GPU: little compute to hide behind."""
    return make_plan(TrainingSpec.from_dict(spec_dict(**{
        "model": "llama3.1-8b", "cluster.nodes": nodes, "parallel.tp": 1, "zero.stage": 3, "batch.micro": 1,
        "batch.seq_len": 1024, "batch.global": 8 * nodes, "zero.hpz_partition_size": hpz})))


def test_the_secondary_partition_is_one_hpz_th_of_the_16_bit_parameters():
    off, on = _plan(16, 1), _plan(16, 8)
    assert off.valid and on.valid, (off.errors, on.errors)
    n = stage_params(on.shape, on.layout, 0)
    assert on.memory.stages[0].params - off.memory.stages[0].params == pytest.approx(2 * (n.dense + n.expert) / 8)


def test_the_backward_gathers_within_the_node():
    """16 nodes: the backward's all-gather over the 8 GPUs of a node (NVLink) instead of the 128 of the
    data-parallel group (rings across the nodes' 8 NICs: comm.ring_bandwidth); the forward's is
    unchanged; on one node hpZ changes nothing."""
    off, on = _plan(16, 1), _plan(16, 8)
    bucket = buckets("recipes", "bf16", on.spec.zero, on.layout, on.shape.hidden_size)
    p = stage_params(on.shape, on.layout, 0)
    (grads, gather, n, again, host, _), = stage_comms(on.layout, on.gpu, [p], on.spec.zero, "bf16", 2, bucket)
    # one NCCL call per 0.9 h^2 prefetch bucket of whole tensors (4 a layer), fewer than n / (0.9 h^2)
    calls = bucket.calls(n, gather=True, p=p)
    assert calls == tensor_calls(p.tensors, False, int(0.9 * 4096**2)) == 4 * 32 + 2 < -(-n // int(0.9 * 4096**2))
    assert again == pytest.approx(collective("allgather", 8, 2 * n, link_bandwidth(8, on.gpu, 8),
                                             calls * nccl_latency("allgather", 8, 8)))
    assert gather == pytest.approx(collective("allgather", 128, 2 * n, ring_bandwidth(128, 1, on.gpu, 8),
                                              calls * nccl_latency("allgather", 128, 8)))
    assert again < gather / 2
    assert on.time.seconds["dp"] < off.time.seconds["dp"]
    assert all(on.time.seconds[k] == off.time.seconds[k] for k in on.time.seconds if k != "dp")
    assert _plan(1, 8).time.step_time_s == _plan(1, 1).time.step_time_s


@pytest.mark.parametrize("over, says", [
    ({"zero.stage": 2}, "zero.hpz_partition_size=8 needs zero.stage=3"),
    ({"zero.hpz_partition_size": 3}, "zero.hpz_partition_size=3 does not divide dp=128"),
])
def test_hpz_rules(over, says):
    plan = make_plan(_plan(16, 8).spec.with_overrides(over))
    assert any(says in e for e in plan.errors), plan.errors


def test_hpz_beyond_a_node_is_a_warning():
    plan = make_plan(_plan(16, 8).spec.with_overrides({"zero.hpz_partition_size": 16}))
    assert plan.valid and any("leaves the node" in w for w in plan.warnings)


def test_a_misspelt_hpz_key_names_the_closest():
    with pytest.raises(SpecError, match="unknown key 'zero.hpz_partition' \\(did you mean 'hpz_partition_size'\\?\\)"):
        TrainingSpec.from_dict(spec_dict(**{"zero.hpz_partition": 8}))
