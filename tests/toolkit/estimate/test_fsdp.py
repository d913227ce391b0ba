"""PyTorch FSDP as a planning input (zero.engine fsdp): one all-gather and one reduce-scatter per
decoder layer instead of DeepSpeed's buckets, no per-module hooks; refused for every target, and the
search proposes DeepSpeed's layouts (what the targets run)."""
import pytest

from tests.conftest import spec_dict
from toolkit.errors import SpecError
from toolkit.estimate.comm import collective, nccl_latency, ring_bandwidth
from toolkit.estimate.data_time import buckets, fsdp_unit, stage_comms
from toolkit.estimate.memory import stage_params
from toolkit.plan import make_plan
from toolkit.search.published import FSDP_FREE
from toolkit.search.search import search
from toolkit.spec import TrainingSpec


def _spec(nodes: int, engine: str, stage: int = 3, **over):
    """Llama-3.1-8B, tp 1, 1,024 tokens per GPU over ``nodes`` nodes (target hf: the HF Trainer's ZeRO-3)."""
    return TrainingSpec.from_dict(spec_dict(**{
        "model": "llama3.1-8b", "target": "hf", "recompute": "none", "cluster.nodes": nodes, "parallel.tp": 1,
        "zero.stage": stage, "zero.engine": engine, "batch.micro": 1, "batch.seq_len": 1024,
        "batch.global": 8 * nodes, **over}))


def _estimated(spec):
    """The plan without the refusal FSDP always gets (as toolkit.search.published estimates FSDP's runs)."""
    plan = make_plan(spec)
    return [e for e in plan.findings if e.level == "error" and e.rule not in FSDP_FREE], plan


def test_one_gather_and_one_reduce_scatter_per_layer():
    """64 nodes: FSDP's 32 calls per collective (a decoder layer's parameters each) against DeepSpeed's
    0.9 h^2 prefetch buckets (~540 calls), each paying NCCL's ring latency over 512 GPUs; the bytes are the
    same. No host work per module (DeepSpeed ZeRO-3's hooks), and a smaller exposed dp."""
    errors, fsdp = _estimated(_spec(64, "fsdp"))
    assert not errors, errors
    ds = make_plan(_spec(64, "deepspeed"))
    p = stage_params(fsdp.shape, fsdp.layout, 0)
    unit = fsdp_unit([p], fsdp.shape.num_layers)
    b = buckets("hf", "bf16", fsdp.spec.zero, fsdp.layout, fsdp.shape.hidden_size, unit)
    n = p.dense + p.expert
    assert b.calls(n) == b.calls(n, gather=True) == fsdp.shape.num_layers == 32
    (grads, gather, _, again, host, _), = stage_comms(fsdp.layout, fsdp.gpu, [p], fsdp.spec.zero, "bf16", 2, b)
    bw = ring_bandwidth(512, 1, fsdp.gpu, 8)
    for kind, seconds in (("allgather", gather), ("allgather", again), ("reducescatter", grads)):
        assert seconds == pytest.approx(collective(kind, 512, 2 * n, bw, 32 * nccl_latency(kind, 512, 8)))
    assert host == 0.0
    ds_b = buckets("hf", "bf16", ds.spec.zero, ds.layout, ds.shape.hidden_size)
    (_, _, _, _, ds_host, _), = stage_comms(ds.layout, ds.gpu, [p], ds.spec.zero, "bf16", 2, ds_b)
    assert ds_b.calls(n, gather=True) > 500 and ds_host > 0
    assert fsdp.time.seconds["dp"] < ds.time.seconds["dp"]
    assert {k: v for k, v in fsdp.time.seconds.items() if k != "dp"} == \
        pytest.approx({k: v for k, v in ds.time.seconds.items() if k != "dp"}, rel=1e-12)


@pytest.mark.parametrize("target", ["recipes", "hf"])
def test_no_target_runs_fsdp(target):
    plan = make_plan(_spec(1, "fsdp").with_overrides({"target": target}))
    assert [e for e in plan.errors if e.startswith(f"zero.engine=fsdp with target {target}: a planning input")]
    assert make_plan(_spec(1, "deepspeed").with_overrides({"target": target})).valid


@pytest.mark.parametrize("over, says", [
    ({"zero.stage": 1}, "FSDP shards parameters, gradients and optimizer states (FULL_SHARD: stage 3)"),
    ({"zero.offload_optimizer": "cpu"}, "the estimate's offload is DeepSpeed's"),
    ({"zero.hpz_partition_size": 8}, "ZeRO++'s hierarchical partitioning is DeepSpeed's"),
])
def test_what_fsdp_does_not_have(over, says):
    errors, _ = _estimated(_spec(2, "fsdp").with_overrides(over))
    assert [e for e in errors if says in e.message], errors
    errors, _ = _estimated(_spec(2, "fsdp"))
    assert not errors


def test_the_search_proposes_what_the_targets_run():
    result = search(_spec(2, "fsdp"), top=3)
    assert result.candidates and all(c.plan.spec.zero.engine == "deepspeed" and c.plan.valid
                                     for c in result.candidates)


def test_a_misspelt_engine_is_refused():
    with pytest.raises(SpecError, match="engine"):
        _spec(1, "fsdp2")
