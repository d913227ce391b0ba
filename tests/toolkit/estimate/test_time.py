"""FLOPs and step-time model: arithmetic checked by hand."""
from dataclasses import replace

import pytest

from toolkit.hardware import get_gpu
from toolkit.models import load_model, named_models, total_params
from toolkit.plan import make_plan
from toolkit.estimate.comm import (LATENCY_S, NCCL_EFFICIENCY, collective, link_bandwidth, nccl_latency,
                                   ring_bandwidth)
from toolkit.estimate import compute as C
from toolkit.estimate.time import KINDS, forward_flops_per_token, pipeline_seconds
from toolkit.estimate.data_time import buckets, dp_engine, dp_seconds, stage_comms
from toolkit.parallel.layout import Layout
from toolkit.estimate.memory import StageParams
from toolkit.estimate.stage_time import COMM_KINDS, StageTime
from toolkit.spec import Zero
from toolkit.spec import TrainingSpec

from tests.conftest import ROOT, spec_dict


def seed_plan(**over):
    spec = TrainingSpec.from_yaml(ROOT / "examples/llama70b_1024gpu.yaml")
    return make_plan(spec.with_overrides(over) if over else spec)


def test_flops_close_to_6PT_plus_attention():
    p = seed_plan()
    P, T = total_params(p.shape), p.batch.tokens
    s = p.shape
    attention = 6 * s.num_layers * s.num_attention_heads * s.head_dim * p.batch.seq_len * T  # causal
    embedding_lookup = 6 * s.vocab_size * s.hidden_size * T  # no FLOPs
    norms = 6 * (2 * s.num_layers + 1) * s.hidden_size * T  # elementwise, not counted
    assert p.time.model_flops == pytest.approx(6 * P * T + attention - embedding_lookup - norms, rel=1e-9)


def test_moe_flops_use_active_experts():
    s = load_model("mixtral-8x7b")
    fwd, core = forward_flops_per_token(s, 4096)
    expert = 3 * s.hidden_size * s.moe.ffn_hidden_size
    dense_like = fwd - core - s.num_layers * 2 * s.moe.topk * expert
    assert dense_like < fwd / 3  # most forward FLOPs are in the two active experts


def test_seed_time_to_train_24_days():
    """REFERENCE: 70B on 2T tokens, 1024 H100 at 40% MFU is ~24 days (8.4e23 / 4.05e17 s)."""
    p = seed_plan(**{"estimate.tokens": 2e12})
    gpu = get_gpu("h100-80gb")
    flops_per_token = p.time.model_flops / p.batch.tokens
    days_at_40 = flops_per_token * 2e12 / (1024 * gpu.bf16_tflops * 1e12 * 0.40) / 86400
    assert days_at_40 == pytest.approx(24.3, rel=0.03)
    # our estimate at its own MFU is the same arithmetic
    assert p.time.time_to_train_s / 86400 == pytest.approx(days_at_40 * 0.40 / p.time.mfu, rel=1e-6)
    assert 0.3 < p.time.mfu < 0.55


def test_pipeline_fill_and_drain():
    """m x the slowest stage plus the others' times / vpp: the (p-1)/(m v + p-1) bubble when the
    stages are equal; the plan's bubble is that minus m x the slowest stage."""
    assert pipeline_seconds([2.0] * 8, 16, 1) == pytest.approx((16 + 7) * 2.0)
    assert pipeline_seconds([2.0] * 8, 16, 5) == pytest.approx((16 + 7 / 5) * 2.0)
    assert pipeline_seconds([1.0, 3.0, 2.0], 10, 1) == pytest.approx(10 * 3.0 + 3.0)
    p = seed_plan()
    t, m = p.time, p.batch.grad_accum
    assert t.seconds["bubble"] == pytest.approx(pipeline_seconds(list(t.stage_s), m, 1) - m * max(t.stage_s))
    assert seed_plan(**{"parallel.pp": 1, "parallel.tp": 8, "cluster.nodes": 128}).time.seconds["bubble"] == 0


def test_seconds_add_up_to_the_step():
    for over in ({}, {"parallel.vpp": 5}, {"recompute": "full"}, {"parallel.pp": 1, "zero.stage": 3}):
        t = seed_plan(**over).time
        assert set(t.seconds) == set(KINDS) and min(t.seconds.values()) >= 0
        assert sum(t.seconds.values()) == pytest.approx(t.step_time_s, rel=1e-12)
        assert t.compute_s + sum(t.comm_s.values()) + t.seconds["bubble"] + t.seconds["optimizer"] == \
            pytest.approx(t.step_time_s, rel=1e-12)


def test_embedding_and_output_layer_on_their_own_stages():
    """Issue 18 item 6: the output layer's FLOPs sit on the last stage only, the embedding on the
    first; the middle stages (the same layers) take the same time."""
    p = seed_plan()
    st = p.time.stage_s
    assert st[1] == pytest.approx(st[6], rel=1e-12)
    assert st[-1] > st[1] and st[0] > st[1]
    assert st[-1] - st[1] > 10 * (st[0] - st[1])  # a 128k-vocab GEMM against a lookup
    assert p.time.slowest_stage == 7


def test_collectives_bus_factor_and_links():
    gpu = get_gpu("h100-80gb")
    nvlink, ib = link_bandwidth(8, gpu, 8), link_bandwidth(16, gpu, 8)
    assert (nvlink, ib) == (450e9 * NCCL_EFFICIENCY, 50e9 * NCCL_EFFICIENCY)
    assert collective("allreduce", 8, 1e9, nvlink) == pytest.approx(LATENCY_S + 2 * 7 / 8 * 1e9 / nvlink)
    for kind in ("allgather", "reducescatter", "alltoall"):
        assert collective(kind, 4, 1e9, ib) == pytest.approx(LATENCY_S + 3 / 4 * 1e9 / ib)
    assert collective("send", 2, 1e9, ib) == pytest.approx(LATENCY_S + 1e9 / ib)
    assert collective("allreduce", 1, 1e9, ib) == 0.0


@pytest.mark.parametrize("gpu_name, n, stride, gbps", [
    ("h100-80gb", 8, 1, 450),  # one node: NVLink
    ("h100-80gb", 2, 4, 450),  # tp4's dp2 in one node
    ("h100-80gb", 48, 1, 400),  # 8 members a node: 8 NICs' rings (8 x 50), under NVLink's 450
    ("h100-80gb", 48, 2, 200),  # 4 a node
    ("h100-80gb", 48, 4, 100),  # 2 a node
    ("h100-80gb", 48, 8, 50),  # tp8: one member a node, its own NIC
    ("h100-80gb", 4, 16, 50),  # members further apart than a node
    ("a100-80gb", 64, 1, 200),  # 8 x 25
])
def test_ring_collectives_use_every_nic_of_the_group_in_a_node(gpu_name, n, stride, gbps):
    """A ring collective's bandwidth: NCCL runs one ring per NIC of the group's members in a node, each
    leaving the node once, up to NVLink's; an all-to-all or a send stays on one NIC per GPU."""
    gpu = get_gpu(gpu_name)
    assert ring_bandwidth(n, stride, gpu, 8) == pytest.approx(gbps * 1e9 * NCCL_EFFICIENCY)
    assert link_bandwidth(n * stride, gpu, 8) <= ring_bandwidth(n, stride, gpu, 8)


def _dp_case(pp: int = 1):
    lay = Layout(world=16 * pp, tp=1, pp=pp, vpp=1, ep=1, etp=1, cp=1, sequence_parallel=False, gpus_per_node=8)
    st = StageTime(gemm=0.3, attention=0.0, memory=0.0, recompute=0.0, comm=dict.fromkeys(COMM_KINDS, 0.0), forward=0.1)
    return lay, get_gpu("h100-80gb"), st, 1e9


def _dp(stage: int, target: str, precision: str = "bf16", grad_bytes: int = 4, pp: int = 1, offload: str = "none",
        modules: float = 0.0):
    lay, gpu, st, n = _dp_case(pp)
    z = Zero(stage=stage, offload_optimizer=offload)
    bucket = buckets(target, precision, z, lay, 4096)
    comms = stage_comms(lay, gpu, [StageParams(n, 0.0, 0, modules)] * pp, z, precision, grad_bytes, bucket)
    return dp_seconds(lay, [st] * pp, comms, stage, grad_accum=4, bucket=bucket)


def _ring(kind: str, nbytes: float, calls: int) -> float:
    """A collective over _dp_case's 16 ranks (two nodes, 8 a node), split in ``calls`` NCCL calls."""
    gpu = get_gpu("h100-80gb")
    return collective(kind, 16, nbytes, ring_bandwidth(16, 1, gpu, 8), calls * nccl_latency(kind, 16, 8))


@pytest.mark.parametrize("kind, n, per_node, us", [
    ("allgather", 512, 8, 8.4 + 448 * 3.4 + 63 * 14),  # 511 ring steps, 63 of them between nodes
    ("reducescatter", 48, 1, 8.4 + 47 * 14),  # tp8: every step between nodes
    ("allgather", 8, 8, 8.4 + 7 * 3.4),  # one node
    ("allreduce", 8, 8, 8.4 + 14 * 3.4),  # ring (56.0) under tree (64.4)
    ("allreduce", 128, 8, 8.4 + 2 * (7 * 4.0 + 4 * 14)),  # tree (176.4) under ring (1,190.0)
    ("allgather", 1, 1, 0.0),
])
def test_nccl_latency_is_nccls_own_model(kind, n, per_node, us):
    """The latency of a data-parallel collective, by NCCL's tuning model (src/graph/tuning.cc,
    Simple protocol): a base of 8.4 us, 3.4 us per ring step inside a node (3 us at least once the
    ring spans nodes), 14 us per step between nodes; all-reduce as a tree when that is less."""
    assert nccl_latency(kind, n, per_node) == pytest.approx(us * 1e-6)


def test_dp_exposure_megatron():
    """Megatron-LM: the reduce-scatter behind the last backward, the gather behind the first
    forward (--overlap-grad-reduce, --overlap-param-gather), at least one 40M-element bucket each."""
    _, gpu, _, n = _dp_case()
    rs, ag = _ring("reducescatter", 4 * n, 25), _ring("allgather", 2 * n, 25)  # 25 buckets of 40M
    frac = 40e6 / n
    assert _dp(1, "megatron-lm") == pytest.approx(max(frac * rs, rs - 0.2) + max(frac * ag, ag - 0.1))


def test_megatron_gathers_on_demand_add_along_the_pipeline():
    """Megatron-LM without interleaving (megatron-core >= 0.9 turns align_param_gather off there) dispatches a
    stage's parameter all-gather at its first forward's pre-hook and waits for it: a later stage's whole
    gather (here 6 ms, 25 calls of 40M elements) is exposed, and the stages after it wait for that forward,
    so the three later stages' gathers add to the first stage's exposure. With the interleaved schedule, or
    megatron-core 0.8's dispatch in zero_grad (estimate.param_gather_at_start), every stage starts its gather
    with the step: hidden behind the fill (0.1 s a stage's forward here)."""
    lay, gpu, st, n = _dp_case(pp=4)
    z = Zero(stage=1)

    def dp(lay: Layout, at_start: bool) -> float:
        bucket = buckets("megatron-lm", "bf16", z, lay, 4096, gather_at_start=at_start)
        comms = stage_comms(lay, gpu, [StageParams(n, 0.0, 0)] * lay.pp, z, "bf16", 4, bucket)
        return dp_seconds(lay, [st] * lay.pp, comms, 1, grad_accum=4, bucket=bucket)

    ag = _ring("allgather", 2 * n, 25)
    assert 0.005 < ag < 0.01
    assert dp(lay, False) == pytest.approx(dp(lay, True) + 3 * ag)
    interleaved = replace(lay, vpp=2)
    assert dp(interleaved, False) == pytest.approx(dp(interleaved, True))
    one_stage = replace(lay, pp=1, world=16)
    assert dp(one_stage, False) == pytest.approx(dp(one_stage, True))


def test_dp_exposure_follows_deepspeeds_paths():
    """DeepSpeed (targets recipes and hf), from its own code paths (data_time's docstring): bf16
    ZeRO-1 is its BF16_Optimizer (all-reduce after the backward, gather in the step, both
    exposed); ZeRO-2 reduce-scatters behind every backward in h^2 buckets, its gather in the step;
    ZeRO-3 gathers behind each forward (one 0.9 h^2 prefetch bucket exposed) and again behind each
    backward (less the 1e9 / 2 elements kept for reuse) beside the reduce-scatter (its last h^2
    bucket exposed); the recipes runtime with pp > 1 turns overlap_comm off."""
    _, gpu, _, n = _dp_case()
    # one NCCL call per bucket: 60 of h^2 (reduce, ZeRO-1/2's allgather_bucket_size), 67 of ZeRO-3's 0.9 h^2
    # prefetch, 2 of the all-reduce path's 5e8 (DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE)
    rs, ag = _ring("reducescatter", 2 * n, 60), _ring("allgather", 2 * n, 60)
    ar, ag3 = _ring("allreduce", 2 * n, 2), _ring("allgather", 2 * n, 67)
    reduce, prefetch = 4096 * 4096 / n, 0.9 * 4096 * 4096 // 1 / n
    for target in ("recipes", "hf"):
        assert dp_engine(target, "bf16", Zero(stage=1), 1) == "allreduce"
        assert _dp(1, target, grad_bytes=2) == pytest.approx(ar + ag)
        assert _dp(1, target, "fp16", grad_bytes=2) == pytest.approx(max(reduce * rs, rs - 0.2) + ag)
        assert _dp(1, target, grad_bytes=2, offload="cpu") == pytest.approx(max(reduce * rs, rs - 0.2) + ag)
        assert _dp(2, target, grad_bytes=2) == pytest.approx(4 * max(reduce * rs, rs - 0.2) + ag)
        regathered = ag3 * (1 - 0.5e9 / n)
        assert _dp(3, target, grad_bytes=2) == pytest.approx(
            4 * (max(prefetch * ag3, ag3 - 0.1) + max(reduce * rs, regathered + rs - 0.2)))
    assert _dp(2, "recipes", grad_bytes=2, pp=2) == pytest.approx(4 * rs + ag)
    assert _dp(2, "hf", grad_bytes=2, pp=2) == pytest.approx(4 * max(reduce * rs, rs - 0.2) + ag)
    fp32 = _ring("allreduce", 4 * n, 2)  # ZeRO-0 (fp32): all-reduce after the backward, nothing to gather
    assert _dp(0, "recipes", "fp32") == pytest.approx(fp32)


def test_zero3_host_work_bounds_a_micro_batch():
    """DeepSpeed ZeRO-3's hooks take ZERO3_HOST_S of host time per parameter-holding module and
    micro-batch (benchmarks/zero3_host_overhead.py, on this project's CPU): the GPU waits for the host
    where that outlasts its own work, the stage's compute (0.3 s here) and the exposed communication.
    ZeRO-2 and Megatron-LM's distributed optimizer run no such hooks."""
    from toolkit.estimate.data_time import ZERO3_HOST_S

    base = _dp(3, "recipes", grad_bytes=2)
    assert _dp(3, "recipes", grad_bytes=2, modules=100) == pytest.approx(base)  # 22 ms: hidden
    comm = base / 4  # per micro-batch (4 of them)
    many = 5000  # 1.1 s of host work a micro-batch
    assert _dp(3, "recipes", grad_bytes=2, modules=many) == pytest.approx(4 * (many * ZERO3_HOST_S - 0.3))
    assert many * ZERO3_HOST_S - 0.3 > comm
    for stage, target in ((2, "recipes"), (2, "hf"), (1, "megatron-lm"), (3, "megatron-lm")):
        assert _dp(stage, target, grad_bytes=2, modules=many) == _dp(stage, target, grad_bytes=2)


def test_modules_are_counted_as_megatron_core_builds_them():
    """The modules ZeRO-3's hooks visit on one GPU: a Llama layer's two norms, linear_qkv, linear_proj,
    fc1 and fc2, plus the embedding, the final norm and the output layer; a Mixtral layer's router and
    each local expert's fc1 and fc2 (megatron-core's SequentialMLP) in place of the MLP's two."""
    from toolkit.estimate.memory import stage_params

    llama = make_plan(TrainingSpec.from_dict(spec_dict(**{"model": "llama3.1-8b", "parallel.tp": 1})))
    assert stage_params(llama.shape, llama.layout, 0).modules == 32 * 6 + 3
    mixtral = make_plan(TrainingSpec.from_dict(spec_dict(**{"model": "mixtral-8x7b", "parallel.tp": 1,
                                                             "parallel.ep": 4})))
    assert stage_params(mixtral.shape, mixtral.layout, 0).modules == 32 * (5 + 2 * 8 / 4) + 3


def test_the_all_reduce_path_splits_as_deepspeeds_engine_does():
    """The all-reduce path (no ZeRO, or bf16 ZeRO-1's BF16_Optimizer) reduces in the engine's own
    buffers: engine.allreduce_gradients' default bucket_size, which no config key sets."""
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

    lay = _dp_case()[0]
    bucket = buckets("recipes", "bf16", Zero(stage=1), lay, 4096)
    assert bucket.engine == "allreduce" and bucket.reduce == MEMORY_OPT_ALLREDUCE_SIZE
    assert bucket.calls(1e9) == 2 and bucket.calls(1e9, gather=True) == -(-10**9 // 4096**2)
    zero3 = buckets("recipes", "bf16", Zero(stage=3), lay, 4096)
    assert zero3.calls(1e9, gather=True) == -(-10**9 // int(0.9 * 4096**2))


def test_deepspeed_reduces_in_its_communication_dtype(ds_dist):
    """DeepSpeed's engine reduces in its communication_data_type: its own property, run on the
    config the toolkit generates, gives the 16-bit dtype (what memory.grad_reduce_bytes says);
    Megatron-LM reduces in its fp32 buffer unless --grad-reduce-in-bf16."""
    import json
    from functools import partial
    from types import SimpleNamespace

    import torch
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    from tests.conftest import PlanMPU
    from toolkit.emit.deepspeed import deepspeed_config
    from toolkit.estimate.memory import grad_reduce_bytes
    from toolkit.parallel.precision import element_bytes

    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        plan = make_plan(TrainingSpec.from_dict(spec_dict(target="recipes", precision=precision)))
        cfg = DeepSpeedConfig(json.loads(json.dumps(deepspeed_config(plan))), mpu=PlanMPU(plan.layout.dp))
        engine = SimpleNamespace(_config=cfg)  # the engine's own methods, on the config it would read
        engine.fp16_enabled = partial(DeepSpeedEngine.fp16_enabled, engine)
        engine.bfloat16_enabled = partial(DeepSpeedEngine.bfloat16_enabled, engine)
        assert DeepSpeedEngine.communication_data_type.fget(engine) == dtype
        assert grad_reduce_bytes(plan.spec) == element_bytes(precision) == dtype.itemsize
    spec = TrainingSpec.from_dict(spec_dict(target="megatron-lm"))
    assert grad_reduce_bytes(spec) == 4


def test_plan_json_keys():
    d = seed_plan().as_dict()
    assert {"valid", "errors", "layout", "batch", "memory_gib", "fits"} <= set(d)
    assert set(d["layout"]) >= {"tp", "pp", "vpp", "ep", "etp", "cp", "dp", "sequence_parallel"}
    assert set(d["batch"]) == {"micro", "global", "grad_accum", "seq_len"}
    assert set(d["memory_gib"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert d["batch"] == {"micro": 1, "global": 2048, "grad_accum": 128, "seq_len": 4096}


def test_capacity_settings_scale_the_routed_work():
    """Balanced routing gives each expert tokens x top-k / experts slots; megatron-core's
    get_capacity caps it at ceil(c x that) per rank, and drop-and-pad fills it: per local expert
    capacity x etp x ep slots (token_dispatcher.py), which is what the model computes with."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    from toolkit.estimate import compute as C
    from toolkit.spec import MoE

    dm = C.model_dims(load_model("deepseek-v3"))
    t, tp, etp, ep = 4096.0, 2, 1, 64  # the DGXC layout: seq 4096, mbs 1, sequence parallel over tp 2
    for c, pad, share in [(None, False, 1.0), (1.0, True, 1.0), (1.25, True, 1.25), (1.25, False, 1.0),
                          (0.5, False, 0.5), (0.5, True, 0.5)]:
        assert C.routed_share(MoE(capacity_factor=c, pad_to_capacity=pad)) == share
        experts = C.layer_work(dm, True, t, tp, etp, ep, True, 2, share).expert_gemms
        if pad:
            assert experts[0].m == get_capacity(int(t / tp) * dm.topk, dm.experts, c) * etp * ep
        assert experts[0].m == t / tp * dm.topk * share * ep * etp / dm.experts
        assert experts[0].count == dm.experts / ep
    base = make_plan(TrainingSpec.from_dict(spec_dict(model="mixtral-8x7b", **{"cluster.nodes": 8, "parallel.tp": 1,
                                                                               "parallel.ep": 8})))
    padded = make_plan(base.spec.with_overrides({"moe.capacity_factor": 2.0, "moe.pad_to_capacity": True}))
    dropped = make_plan(base.spec.with_overrides({"moe.capacity_factor": 2.0}))
    assert dropped.time.step_time_s == base.time.step_time_s  # balanced: nothing over capacity 2
    # twice the bytes per all-to-all; each one's latency (comm.LATENCY_S) stays
    assert 1.9 * base.time.seconds["ep"] < padded.time.seconds["ep"] < 2 * base.time.seconds["ep"]
    assert padded.time.step_time_s > base.time.step_time_s
    assert padded.memory.stages[0].activations > base.memory.stages[0].activations


# Megatron-LM's own count, num_floating_point_operations(args, 1) / seq_length at seq 4096, printed by
# `python tools/megatron_lm_flops.py --megatron-lm PATH` with PATH at NVIDIA/Megatron-LM d98e8a6 (2026-08-22)
MEGATRON_LM_FLOPS = {"llama3-70b": 433_116_413_952, "llama3.1-405b": 2_473_221_685_248, "qwen2.5-7b": 44_887_965_696,
                     "mixtral-8x7b": 79_706_456_064, "qwen2-57b-a14b": 84_653_506_560,
                     "qwen3-30b-a3b": 23_006_281_728, "deepseek-v2-lite": 16_386_180_096,
                     "deepseek-v3": 259_992_950_784, "qwen3-next-80b-a3b": 22_739_681_280,
                     "qwen3-next-80b-a3b mtp": 25_128_898_560,
                     "gpt-oss-120b": 27_164_491_776, "gpt-oss-20b": 19_267_928_064}


@pytest.mark.parametrize("name,mtp", [("llama3-70b", 0), ("llama3.1-405b", 0), ("qwen2.5-7b", 0), ("mixtral-8x7b", 0),
                                      ("qwen2-57b-a14b", 0), ("qwen3-30b-a3b", 0), ("deepseek-v2-lite", 0),
                                      ("deepseek-v3", 1), ("qwen3-next-80b-a3b", 0), ("qwen3-next-80b-a3b", 1),
                                      ("gpt-oss-120b", 0),
                                      ("gpt-oss-20b", 0)])
def test_flops_are_megatron_lms(name, mtp):
    """Model FLOPs (what MFU divides) equal Megatron-LM's count to the FLOP, once the terms only
    one side counts are taken out: the router GEMM, the Qwen2-MoE shared expert gate and the
    q/k/v bias adds (ours), the MLA and MTP norms (Megatron-LM's). DeepSeek-V3 with its MTP
    module: Megatron-LM counts it as a decoder layer, a projection and an output layer.
    Qwen3-Next: 36 gated delta net layers (in_proj, conv1d, the recurrence, out_proj; no softmax
    core) and 12 gated attention layers (q and its output gate projected together); its router
    over 512 experts is the 1.3% Megatron-LM leaves out; with its MTP module (a gated attention MoE
    layer, the last decoder layer's kind, as megatron builds it: the pattern megatron_lm_flops gives
    Megatron-LM covers decoder and MTP layers). GPT-OSS with its own flags
    (--quick-geglu, --window-size, --window-attn-skip-freq): Megatron-LM counts fc1's gate half only
    for --swiglu and every layer's attention as full causal, and leaves out the bias adds; ours
    counts the 128-token window layers' keys and all three expert GEMMs, 20% more."""
    from dataclasses import replace

    from tools.megatron_lm_flops import SEQ, differences

    shape = replace(load_model(name), mtp_layers=mtp)
    ours = 3 * forward_flops_per_token(shape, SEQ)[0]
    theirs = MEGATRON_LM_FLOPS[{("qwen3-next-80b-a3b", 1): "qwen3-next-80b-a3b mtp"}.get((name, mtp), name)]
    assert ours - sum(differences(shape).values()) == theirs
    small = {"qwen3-next-80b-a3b": 1.4e-2,  # the router: h x 512 per token and layer
             "gpt-oss-120b": 0.21, "gpt-oss-20b": 0.21}.get(name, 4e-3)  # GPT-OSS: the GLU and the windows
    assert ours == pytest.approx(theirs, rel=small)  # the differences are small


def test_mtp_module_work_on_the_last_stage():
    """Each MTP module adds to the last stage an output layer and its eh_proj (a column-parallel
    2h -> h GEMM whose 2h input is all-gathered over the sequence and whose output is gathered
    over tp; backward reduce-scatters the input's gradient), besides its decoder layer."""
    from toolkit.estimate import compute as C
    from toolkit.estimate.comm import collective, link_bandwidth
    from toolkit.estimate.stage_time import edge_piece, setting

    dm = C.model_dims(load_model("deepseek-v3"))
    gpu = get_gpu("h100-80gb")
    lay = Layout(world=1024, tp=2, pp=16, vpp=1, cp=1, ep=64, etp=1, gpus_per_node=8,
                 sequence_parallel=True)
    s = setting(lay, gpu, "bf16", True, C.CALIBRATION)
    t, vocab = 4096.0, 129280
    one, two = edge_piece(dm, False, True, t, vocab, s, 1), edge_piece(dm, False, True, t, vocab, s, 2)
    head = C.gemm_seconds(C.head_gemm(dm, t, 2, vocab), s.peak, s.cal)
    proj = C.gemm_seconds(C.Gemm(t, dm.h / 2, 2 * dm.h), s.peak, s.cal)
    assert two.gemm_f - one.gemm_f == pytest.approx(head + proj)
    bw, a = link_bandwidth(2, gpu, 8), t * dm.h * 2
    assert two.comm_f["tp"] - one.comm_f["tp"] == pytest.approx(collective("allgather", 2, a, bw)
                                                                 + collective("allgather", 2, 2 * a, bw))
    assert two.comm_b["tp"] - one.comm_b["tp"] == pytest.approx(collective("reducescatter", 2, 2 * a, bw))


def test_sliding_window_attention_counts_its_window_only(tmp_path):
    """A sliding window of W keys (megatron's window_size (W - 1, 0)): a query sees W - W^2 / (2 s)
    keys on average, half the diagonal left out as for the causal s / 2, which megatron-core's own
    sliding-window mask gives. Gemma-3-27B at 8192 tokens: 52 layers of 1024-token windows and 10
    global ones; flash attention (TransformerEngine skips the blocks outside the window) takes
    that share of the causal time, megatron's local attention (it masks full scores) the same."""
    from dataclasses import replace

    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    from toolkit.estimate.compute import attended_keys
    from toolkit.mcore.cpu_compat import on_cpu_device

    mask = on_cpu_device(get_sliding_window_causal_mask)  # megatron allocates it on "cuda"
    for s, w in [(64, 16), (64, 64), (100, 7), (8, 1)]:
        seen = int((~mask(s, s, (w - 1, 0))).sum())  # True = masked
        assert attended_keys(s, w) * s == seen - min(w, s) / 2
    assert attended_keys(64, None) == attended_keys(64, 64) == 32 and attended_keys(64, 128) == 32

    g = load_model("gemma3-27b")
    full = replace(g, sliding_window=None)
    _, core = forward_flops_per_token(g, 8192)
    _, full_core = forward_flops_per_token(full, 8192)
    assert core / full_core == pytest.approx((52 * (1024 - 1024 ** 2 / (2 * 8192)) + 10 * 4096) / (62 * 4096))
    from toolkit.estimate.compute import flash_seconds, model_dims, unfused_seconds

    dm, peak = model_dims(g), 1e15
    window = flash_seconds(dm, 8192, 8192, 8, 8192, peak, C.CALIBRATION, 1024)
    assert window / flash_seconds(dm, 8192, 8192, 8, 8192, peak, C.CALIBRATION) == pytest.approx(
        (1024 - 1024 ** 2 / (2 * 8192)) / 4096)
    assert unfused_seconds(dm, 8192, 8192, 8, peak, 3e12, C.CALIBRATION, 2) == unfused_seconds(
        model_dims(full), 8192, 8192, 8, peak, 3e12, C.CALIBRATION, 2)
    cfg = tmp_path / "config.json"  # the same model without windows (one wider than the sequence)
    cfg.write_text(__import__("json").dumps({**named_models()["gemma3-27b"]["config"], "sliding_window": 1 << 20}))
    over = {"batch.seq_len": 8192, "parallel.tp": 8, "batch.global": 64}
    planned = [make_plan(TrainingSpec.from_dict(spec_dict(model=m, **over))).time for m in ("gemma3-27b", str(cfg))]
    assert planned[0].seconds["attention"] < 0.5 * planned[1].seconds["attention"]
    assert planned[0].model_flops < planned[1].model_flops



def test_gated_delta_net_layers_have_no_softmax_core():
    """Qwen3-Next: only its 12 gated attention layers grow with the sequence (the 36 delta net
    layers' recurrence is linear in it); a delta net layer's work is its in_proj / out_proj GEMMs
    and the chunked recurrence (at the efficiency of its 64-token chunk GEMMs), which selective
    recompute (megatron's core_attn) does not run again; the gated attention's q is projected
    with its output gate, twice as wide."""
    from dataclasses import replace

    from toolkit.estimate import compute as C
    from toolkit.estimate.stage_time import layer_piece, setting
    from toolkit.estimate.time import delta_rule_flops

    shape = load_model("qwen3-next-80b-a3b")
    a, d = shape.num_attention_heads, shape.head_dim
    f4, core4 = forward_flops_per_token(shape, 4096)
    f8, core8 = forward_flops_per_token(shape, 8192)
    assert core8 - core4 == f8 - f4 == 12 * 2 * a * 2 * d * (4096 - 2048)
    assert delta_rule_flops(shape) == 8 * 32 * 128 * 128
    no_gdn = replace(shape, linear_attention=None)
    assert forward_flops_per_token(no_gdn, 4096)[1] == 4 * core4
    dm = C.model_dims(shape)
    lay = Layout(world=64, tp=2, pp=1, vpp=1, cp=1, ep=16, etp=1, gpus_per_node=8, sequence_parallel=True)
    s = setting(lay, get_gpu("h100-80gb"), "bf16", True, C.CALIBRATION)
    t = 4096.0
    gdn, attn = layer_piece(dm, True, t, 4096, s, linear=True), layer_piece(dm, True, t, 4096, s)
    assert gdn.attn_f == C.delta_rule_seconds(dm, t, 2, s.peak, s.cal) and gdn.attn_b == 2 * gdn.attn_f
    assert not gdn.selective and attn.selective
    in_proj, out_proj = C.attention_gemms(dm, t, 2, linear=True)
    assert (in_proj.n, in_proj.k, out_proj.n, out_proj.k) == ((2 * 2048 + 2 * 4096 + 64) / 2, 2048, 2048, 2048)
    assert C.attention_gemms(dm, t, 2)[0].n == (2 * 16 + 2 * 2) * 256 / 2  # q and gate, k, v
    plan = make_plan(TrainingSpec.from_dict(spec_dict(**{
        "model": "qwen3-next-80b-a3b", "target": "megatron-lm", "cluster.nodes": 4, "parallel.tp": 2,
        "parallel.ep": 16, "parallel.sequence_parallel": True})))
    assert plan.valid and plan.time.seconds["attention"] > 0, plan.errors
