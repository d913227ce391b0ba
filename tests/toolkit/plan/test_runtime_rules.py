"""The runtime's own limits (toolkit.plan.runtime_rules): each refused for target=recipes with
its reason, and not for target=megatron-lm (or with the fix the message names)."""
import pytest

from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

from tests.conftest import spec_dict

MOE = {"model": "mixtral-8x7b", "cluster.nodes": 8, "parallel.tp": 1, "parallel.ep": 8, "parallel.pp": 1,
       "batch.global": 512}
MEGATRON_LM = {"target": "megatron-lm"}
CPU = {"model": "llama-tiny", "cluster.gpus_per_node": 2, "cluster.gpu": "cpu", "parallel.tp": 1,
       "batch.seq_len": 64, "batch.global": 16}

# rule -> (overrides that break it, message fragment, overrides that satisfy it)
CASES = {
    "runtime_zero3_experts": ({**MOE, "zero.stage": 3}, "zero.stage=3 with ep=8", {"zero.stage": 2}),
    "runtime_16bit_needs_zero": ({"zero.stage": 0}, "precision=bf16 with zero.stage=0: without ZeRO DeepSpeed "
                                                    "accumulates bf16 gradients in bf16", {"zero.stage": 1}),
    "runtime_fp16_pipeline": ({"precision": "fp16", "parallel.pp": 2}, "precision=fp16 with pp=2",
                              {"precision": "bf16"}),
    "runtime_fp32_zero0_norm": ({"precision": "fp32", "zero.stage": 0, "parallel.pp": 2},
                                "counts the replicated weights of the first stage only", {"zero.stage": 1}),
    # pp 2: at pp 1 the BF16_Optimizer's unsharded fp32 gradients (memory.bf16_states) do not fit 80 GB
    "runtime_bf16_expert_norm": ({**MOE, "parallel.pp": 2, "parallel.etp": 2}, "etp=2 with tp=1, ep=8, bf16 and zero.stage=1: "
                                 "DeepSpeed's bf16 optimizer sums", {"parallel.etp": 1}),
    "runtime_mtp": (None, None, None),  # test_mtp_layers_train_except_at_context_parallel
    "runtime_cp_sinks": ({**CPU, "model": "gpt-oss-tiny", "moe.token_dispatcher": "allgather", "parallel.cp": 2},
                         "cp=2 with attention sinks (GptOssForCausalLM", {"parallel.cp": 1}),
    "runtime_ring_attention_dropout": (None, None, None),  # test_ring_refuses_attention_dropout
    "runtime_schedule": ({"optimizer.warmup_steps": 200, "train.steps": 100}, "warmup_steps=200 must be below",
                         {"optimizer.warmup_steps": 10}),
    "runtime_kernels": ({**CPU, "attention.backend": "flash"}, "attention.backend=flash on cluster.gpu=cpu",
                        {"attention.backend": "unfused"}),
    "runtime_packing": ({**CPU, "data.packing": True, "parallel.cp": 2, "batch.global": 8},
                        "data.packing with cp=2: this runtime splits a packed sequence", {"parallel.cp": 1}),
    "runtime_lora": ({**CPU, "finetune.method": "lora", "zero.stage": 3}, "finetune.method=lora with zero.stage=3",
                     {"zero.stage": 2}),
    "compile_runs": ({"compile": True}, "compile=true with target recipes: this toolkit's runtime builds "
                     "megatron-core's layers and never calls torch.compile", {"compile": False}),
    # every target's reason: tests/toolkit/estimate/test_eager.py
    "zero_hpz": ({"zero.stage": 3, "zero.hpz_partition_size": 8}, "zero.hpz_partition_size=8 with tp*cp = 2*1 = 2: "
                 "DeepSpeed groups consecutive global ranks", {"parallel.tp": 1}),
    "fp8_runs": ({"fp8.format": "hybrid"}, "fp8.format=hybrid with target recipes: this toolkit's runtime has "
                 "never run TransformerEngine's FP8 layers", {"target": "megatron-lm"}),
}


def plan_of(**over):
    return make_plan(TrainingSpec.from_dict(spec_dict(**over)))


@pytest.mark.parametrize("rule", sorted(r for r, case in CASES.items() if case[0] is not None))
def test_runtime_rule_fails_and_passes(rule):
    bad, fragment, fix = CASES[rule]
    errors = plan_of(**bad).errors
    assert any(fragment in e for e in errors), errors
    good = plan_of(**{**bad, **fix})
    assert good.valid, good.errors


def test_mtp_layers_train_except_at_context_parallel():
    """MTP modules (spec mtp.layers, or a converted checkpoint's count in the shape) train in the
    runtime at dp, ep and pp; cp > 1, vpp > 1 and models other than DeepSeek-V3 are refused for the
    recipes, with the reason; Megatron-LM trains them."""
    from dataclasses import replace

    from toolkit.models import load_model

    over = {"model": "deepseek-v3-tiny", "cluster.gpu": "cpu", "cluster.gpus_per_node": 2, "batch.seq_len": 64,
            "batch.global": 16, "moe.token_dispatcher": "allgather", "parallel.tp": 1, "mtp.layers": 1}
    for layout in ({}, {"parallel.ep": 2}, {"parallel.pp": 2}):
        plan = make_plan(TrainingSpec.from_dict(spec_dict(**over, **layout)))
        assert plan.valid and plan.shape.mtp_layers == 1, plan.errors
    cp = make_plan(TrainingSpec.from_dict(spec_dict(**over, **{"parallel.cp": 2})))
    assert any("mtp.layers=1 with cp=2: megatron-core normalises the MTP loss" in e for e in cp.errors), cp.errors
    vpp = make_plan(TrainingSpec.from_dict(spec_dict(**{**over, "parallel.pp": 2, "parallel.vpp": 2,
                                                        "batch.global": 32})))
    assert any("mtp.layers=1 with vpp=2: this runtime has not trained" in e for e in vpp.errors), vpp.errors
    mlm = make_plan(TrainingSpec.from_dict(spec_dict(**over, **{"parallel.cp": 2}, target="megatron-lm")))
    assert not any("MTP" in e for e in mlm.errors), mlm.errors
    shape = replace(load_model("deepseek-v3-tiny"), mtp_layers=2)  # a checkpoint's count, no spec key
    del over["mtp.layers"]
    assert make_plan(TrainingSpec.from_dict(spec_dict(**over)), shape=shape).shape.mtp_layers == 2
    next_ = make_plan(TrainingSpec.from_dict(spec_dict(**{**over, "model": "qwen3-next-tiny", "mtp.layers": 1})))
    assert next_.valid and next_.shape.mtp_layers == 1, next_.errors
    llama = make_plan(TrainingSpec.from_dict(spec_dict(**{"mtp.layers": 1})))
    assert any("mtp.layers=1 on LlamaForCausalLM: its family has no multi-token prediction" in e
               for e in llama.errors), llama.errors


def test_fp32_zero0_norm_with_experts():
    bad = plan_of(**{**MOE, "precision": "fp32", "zero.stage": 0, "cluster.nodes": 32})
    assert any("averages the norm over the data-parallel ranks" in e for e in bad.errors), bad.errors
    assert not any("averages the norm" in e for e in plan_of(**{**MOE, "precision": "fp32", "zero.stage": 1,
                                                                "cluster.nodes": 32}).errors)


def test_bf16_expert_norm_only_on_deepspeeds_bf16_optimizer():
    """etp other than 1 or tp is refused only where DeepSpeed's BF16_Optimizer computes the norm."""
    bad = {**MOE, "parallel.etp": 2}
    for fix in ({"zero.stage": 2}, {"zero.offload_optimizer": "cpu"}, {"precision": "fp32"}, MEGATRON_LM):
        errors = plan_of(**bad, **fix).errors
        assert not any("DeepSpeed's bf16 optimizer sums" in e for e in errors), (fix, errors)


def test_grouped_gemm_and_alltoall_need_gpu_kernels():
    moe_cpu = {**CPU, "model": "mixtral-tiny", "attention.backend": "unfused"}
    p = plan_of(**moe_cpu, **{"moe.grouped_gemm": True, "moe.token_dispatcher": "allgather"})
    assert any("legacy GroupedMLP needs the grouped_gemm package" in e for e in p.errors), p.errors
    p = plan_of(**moe_cpu, **{"moe.token_dispatcher": "alltoall"})
    assert any("alltoall on cluster.gpu=cpu" in e for e in p.errors), p.errors
    assert plan_of(**moe_cpu, **{"moe.token_dispatcher": "allgather"}).valid
    # TransformerEngine's spec has grouped experts (a GPU with flash attention)
    assert plan_of(**{**MOE, "moe.grouped_gemm": True, "zero.stage": 2}).valid  # ZeRO-1 bf16 does not fit


def test_ring_refuses_attention_dropout():
    """A model with attention dropout (the shape's, from its HF config) at cp > 1: the runtime's
    ring (local spec) refuses it, all_gather and a2a take it; TransformerEngine's attention and
    Megatron-LM are not refused for it."""
    from dataclasses import replace

    from toolkit.models import load_model

    shape = replace(load_model("llama-tiny"), attention_dropout=0.1)
    cpu = {**CPU, "parallel.cp": 2}

    def errors(**over):
        return make_plan(TrainingSpec.from_dict(spec_dict(**{**cpu, **over})), shape=shape).errors

    assert any("attention_dropout=0.1 with cp=2 cp_comm=p2p on megatron's local layer spec" in e for e in errors())
    assert not errors(**{"parallel.cp_comm": "all_gather"}) and not errors(**{"parallel.cp_comm": "a2a"})
    gpu = {"cluster.gpu": "h100-80gb", "attention.backend": "flash"}
    assert not any("attention_dropout" in e for e in errors(**gpu) + errors(target="megatron-lm"))
    assert make_plan(TrainingSpec.from_dict(spec_dict(**cpu))).valid  # llama-tiny itself has none



def test_lora_only_where_the_adapters_are_built():
    """LoRA is the recipes' runtime's, on megatron's local layers (toolkit.runtime.lora)."""
    lora = {**CPU, "finetune.method": "lora"}
    assert plan_of(**lora).valid
    assert any("finetune.method=lora with target=megatron-lm" in e for e in plan_of(**lora, **MEGATRON_LM).errors)
    moe = plan_of(**{**MOE, "finetune.method": "lora", "finetune.lora.targets": ["linear_fc1"]})
    assert any("give pipeline stage(s) 0 no adapter" in e for e in moe.errors), moe.errors
    ok = plan_of(**{**MOE, "finetune.method": "lora", "attention.backend": "unfused"})
    assert ok.valid, ok.errors  # attention adapters
    flash = plan_of(**{**lora, "cluster.gpu": "h100-80gb", "attention.backend": "flash"})
    assert any("finetune.method=lora with TransformerEngine's layers" in e for e in flash.errors), flash.errors


def test_lora_on_gated_delta_nets():
    """Qwen3-Next: its gated delta net layers' in_proj and out_proj take adapters, so a stage of
    delta net layers alone (qwen3-next-tiny at pp2: layers 0-1) trains; with the attention's targets
    alone it has none, and is refused saying which targets a delta net layer has."""
    next_ = {**CPU, "model": "qwen3-next-tiny", "moe.token_dispatcher": "allgather", "finetune.method": "lora"}
    for over in ({}, {"parallel.pp": 2}, {"parallel.pp": 2, "finetune.lora.targets": ["in_proj"]}):
        plan = plan_of(**next_, **over)
        assert plan.valid, (over, plan.errors)
    attention = plan_of(**next_, **{"parallel.pp": 2, "finetune.lora.targets": ["linear_qkv", "linear_proj"]})
    assert any("give pipeline stage(s) 0 no adapter" in e and "a gated delta net layer's are in_proj and out_proj" in e
               for e in attention.errors), attention.errors


@pytest.mark.parametrize("over, says", [
    ({"target": "hf"}, "fp8.format=e4m3 with target hf: toolkit.hf's Trainer runs transformers' modules"),
    ({"target": "megatron-lm", "attention.backend": "unfused"}, "fp8.format=e4m3 needs TransformerEngine's layers"),
    ({"target": "megatron-lm", "fp8.param": True, "zero.stage": 0}, "fp8.param with zero.stage=0: "
                                                                     "--fp8-param-gather needs"),
    ({"cluster.gpu": "cpu"}, "fp8.format=e4m3 on cpu: it has no FP8 tensor cores"),
])
def test_fp8_is_refused_where_it_cannot_run(over, says):
    assert any(says in e for e in plan_of(**{"fp8.format": "e4m3", **over}).errors)


def test_warmup_beyond_the_steps_is_refused_for_the_hf_trainer_too():
    """toolkit.hf.arguments.lr_schedule refuses it when TrainingArguments are built, at launch: the plan
    says so first (it once validated the spec, then the launch failed). A constant schedule never decays."""
    hf = {"target": "hf", "parallel.tp": 1, "zero.stage": 3, "recompute": "full"}
    bad = make_plan(TrainingSpec.from_dict(spec_dict(**hf, **{"optimizer.warmup_steps": 100, "train.steps": 100})))
    assert "optimizer.warmup_steps=100 must be below train.steps=100 (the HF Trainer's" in " ".join(bad.errors)
    for over in ({"optimizer.warmup_steps": 99, "train.steps": 100},
                 {"optimizer.warmup_steps": 100, "train.steps": 100, "optimizer.decay": "constant"}):
        assert not any("warmup_steps" in e for e in make_plan(TrainingSpec.from_dict(spec_dict(**hf, **over))).errors)
