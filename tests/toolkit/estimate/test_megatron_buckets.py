"""data_time.megatron_buckets, the estimate's count of Megatron-LM's gradient buckets (and of the distributed
optimizer's parameter all-gathers, which use the same buckets), against megatron-core's own buffer: its
DistributedDataParallel built over the runtime's megatron-core model, wrapped in megatron-core's Float16Module
as Megatron-LM's get_model wraps it (every parameter in bf16, one buffer), on one CPU rank.

_ParamAndGradBuffer walks the parameters in reverse and closes a bucket once it holds bucket_size
elements, a whole tensor at a time; the shared embedding (pp > 1 with tied or MTP embeddings) is a bucket of
its own; routed experts are in the dense buffer unless expert parallelism sets their ``allreduce`` to False.
Those two attributes are what megatron-core sets on a GPU job of that layout
(LanguageModule.setup_embeddings_and_output_layer, experts.py / layers.py); one rank cannot build pp or ep
of 2, so the test sets them as megatron-core would.

What is approximate, and how much, is asserted here too: the estimate holds a layer's tensors in the order
the forward runs them, where megatron-core registers linear_proj before linear_qkv (and MLA's projections
before its norms), so the last bucket may differ by tensors of the first layer; it holds a layer's routed
experts as TEGroupedMLP registers them (every expert's fc1, then every fc2: ``moe.grouped_gemm``, which needs
TransformerEngine), where this CPU model's SequentialMLP registers each expert's fc1 and fc2 together, so the
expert buckets may differ by one per MoE layer; and it groups a stage's layers by kind, so Qwen3-Next's 3:1
interleave of linear and full attention is walked kind by kind."""
import dataclasses
import json
import math

import pytest
import torch

from toolkit.estimate.data_time import BOTH, buckets, megatron_buckets
from toolkit.estimate.memory import stage_params
from toolkit.models.params import layer_weights
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

SIZES = (1000, 30000, 200000)  # bucket_size: a few tensors a bucket, a layer or two, the whole model
MOE = {"mixtral-tiny", "qwen2-moe-tiny", "deepseek-v3-tiny", "gpt-oss-tiny", "qwen3-next-tiny"}


def _buffers(plan, size: int, shared: bool, expert_parallel: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from toolkit.runtime.model import build_model_chunks

    chunk = build_model_chunks(plan)[0]
    if shared:  # what megatron-core sets on the first stage at pp > 1 with tied or MTP embeddings
        chunk.embedding.word_embeddings.weight.shared_embedding = True
    if expert_parallel:  # what megatron-core sets on routed experts at ep > 1
        for name, p in chunk.named_parameters():
            if ".experts." in name and "shared_experts" not in name:
                p.allreduce = False
    model = Float16Module(chunk.config, chunk)
    ddp = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=size), model)
    return ddp.buffers, ddp.expert_parallel_buffers


def _first_layer(shape) -> int:
    return sum(w.total for w in layer_weights(shape, 0))


@pytest.mark.parametrize("model,shared,expert_parallel", [
    ("llama-tiny", False, False), ("llama-tiny", True, False), ("gemma3-tiny", False, False),
    ("mixtral-tiny", False, False), ("mixtral-tiny", False, True), ("qwen2-moe-tiny", False, True),
    ("deepseek-v3-tiny", False, False), ("deepseek-v3-tiny", True, True), ("gpt-oss-tiny", False, False),
    ("qwen3-next-tiny", False, False)])
def test_buckets_are_megatron_cores(megatron_one_rank, monkeypatch, model, shared, expert_parallel):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # the buffers' device: this CPU rank
    moe = {"moe": {"token_dispatcher": "allgather"}} if model in MOE else {}
    plan = make_plan(TrainingSpec.from_dict({
        "model": model, "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"}, "zero": {"stage": 1},
        "precision": "bf16", "batch": {"micro": 1, "global": 1, "seq_len": 64}, "train": {"steps": 2}, **moe}))
    p = stage_params(plan.shape, plan.layout, 0)
    assert p.shared == ()  # pp 1: no shared embedding
    p = dataclasses.replace(p, shared=(0,)) if shared else p
    groups = ((0, 1) if expert_parallel else (BOTH,)) if model in MOE else (0,)
    for size in SIZES:
        dense, experts = _buffers(plan, size, shared, expert_parallel)
        assert len(dense) == 1 and len(experts) == (1 if expert_parallel else 0)  # bf16: one buffer each
        for group, buf in zip(groups, dense + experts):
            calls, last = megatron_buckets(p.tensors, group, size, p.shared)
            runs = [(n, c * layers) for kinds, layers in p.tensors
                    for n, c in (kinds[0] + kinds[1] if group == BOTH else kinds[group])]
            # the same tensors; the buffer starts each at a multiple of 64 elements (its padding, not counted)
            padding = sum(b.numel_unpadded for b in buf.buckets) - sum(n * c for n, c in runs)
            assert 0 <= padding < 64 * sum(c for _, c in runs), padding
            real_last = buf.buckets[-1].numel_unpadded
            if model == "qwen3-next-tiny":  # walked kind by kind: 3 linear-attention layers, then the full one
                assert abs(calls - len(buf.buckets)) <= 1, (size, calls, len(buf.buckets))
            elif group != 0 and model in MOE:  # experts in TEGroupedMLP's order; this CPU model's SequentialMLP
                moe_layers = sum(plan.shape.is_moe_layer(i) for i in range(plan.shape.num_layers))
                assert abs(calls - len(buf.buckets)) <= moe_layers, (size, group, calls, len(buf.buckets))
            else:
                assert calls == len(buf.buckets), (size, group, calls, len(buf.buckets))
            if shared and group != 1:  # the embedding alone
                assert last == real_last == plan.shape.vocab_size * plan.shape.hidden_size
            # the last bucket: the embedding's (group 0 and BOTH) and the first layer's up to a boundary
            assert abs(last - real_last) <= _first_layer(plan.shape), (size, group, last, real_last)


def test_buckets_where_megatron_core_marks_them_itself():
    """2 ranks (tests/support/megatron_buckets.py): Gemma 3 at pp 2, whose tied embedding megatron-core marks
    shared on both stages and whose second stage it does not bucket (DistributedDataParallel: bucket_size
    None at pp rank > 0; StageParams.bucketed); Mixtral at ep 2, whose routed experts it moves to a buffer of
    their own. Every rank's buffers against megatron_buckets over its stage's StageParams."""
    from tests.recipes.test_recipes import launch, tail
    from tests.support.megatron_buckets import CASES, SIZES, spec

    r = launch("-m tests.support.megatron_buckets", launcher="torchrun", timeout=600)
    assert r.returncode == 0, tail(r)
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    _gathers_on_demand([x for x in lines if "gathers" in x])
    lines = [x for x in lines if "gathers" not in x]
    assert sorted((x["case"], x["rank"], x["size"]) for x in lines) == sorted(
        (case, rank, size) for case in CASES for rank in (0, 1) for size in SIZES)
    for x in lines:
        model, parallel = CASES[x["case"]]
        plan = make_plan(TrainingSpec.from_dict(spec(model, parallel)))
        p = stage_params(plan.shape, plan.layout, x["stage"])
        bucket = dataclasses.replace(buckets("megatron-lm", "bf16", plan.spec.zero, plan.layout,
                                             plan.shape.hidden_size), reduce=x["size"])
        assert p.bucketed == (x["stage"] == 0) and len(x["dense"]) == 1
        size = x["size"] if p.bucketed else math.inf
        if parallel.get("pp"):  # tied: the embedding on the first stage, its copy on the last, a bucket alone
            assert p.shared == ((0,) if x["stage"] == 0 else (len(p.tensors) - 1,))
            calls, last = megatron_buckets(p.tensors, 0, size, p.shared)
            assert calls == x["dense"][0][0] == bucket.calls(p.dense, False, p), x
            # the first stage's last bucket: the embedding alone; the second's: all but the copy (its padding)
            assert (last == x["dense"][0][1]) if x["stage"] == 0 else (0 <= x["dense"][0][1] - last < 64 * 20), x
        else:  # ep 2: the experts' own buffer; the dense one without them
            assert len(x["expert"]) == 1
            assert megatron_buckets(p.tensors, 0, size, p.shared)[0] == x["dense"][0][0], x
            moe_layers = sum(plan.shape.is_moe_layer(i) for i in range(plan.shape.num_layers))
            assert abs(megatron_buckets(p.tensors, 1, size, p.shared)[0] - x["expert"][0][0]) <= moe_layers, x


def _gathers_on_demand(gathers: list[dict]) -> None:
    """megatron-core's parameter all-gathers as Megatron-LM runs them without interleaving (align_param_gather
    False), in the same launch's pp 2 case: nothing is dispatched when the step starts (after
    zero_grad_buffer); each stage's first gather is dispatched by its first module's forward pre-hook, which
    waits for it. The second stage's (not bucketed) is its layers' one bucket, dispatched with the shared
    embedding's before its first module runs: the whole stage's gather, which data_time then counts as
    exposed and adds along the pipeline (Buckets.aligned false). The first stage's later buckets are
    dispatched as the forward goes (each when the one before is waited for): behind its compute."""
    from tests.support.megatron_buckets import CASES, spec

    assert sorted(x["stage"] for x in gathers) == [0, 1]
    for x in gathers:
        plan = make_plan(TrainingSpec.from_dict(spec(*CASES[x["case"]])))
        assert not buckets("megatron-lm", "bf16", plan.spec.zero, plan.layout, plan.shape.hidden_size).aligned
        g, log = x["gathers"], x["gathers"]["log"]
        assert g["before"] == [], x
        assert log[0].startswith("forward ") and log[1].startswith("dispatch "), log[:3]
        assert sorted(int(e.split()[1]) for e in log if e.startswith("dispatch ")) == list(range(g["groups"]))
        second = [i for i, e in enumerate(log) if e.startswith("forward ")][1]
        late = [e for e in log[second:] if e.startswith("dispatch ")]
        if x["stage"] == 1:
            assert not stage_params(plan.shape, plan.layout, 1).bucketed
            assert g["groups"] == 2 and late == [], log[:4]  # the layers' bucket and the shared embedding's
        else:
            assert g["groups"] > 2 and len(late) >= g["groups"] - 2, log  # at most two before its second module
