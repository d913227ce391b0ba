"""Every layout rule with a failing and a passing case; all violations reported at once."""
import pytest

from toolkit.errors import PlanError
from toolkit.plan import make_plan
from toolkit.plan.rules import RULES
from toolkit.spec import TrainingSpec

from tests.conftest import spec_dict

MOE = {"model": "mixtral-8x7b", "cluster.nodes": 8, "parallel.tp": 1, "parallel.ep": 8, "parallel.pp": 1,
       "batch.global": 512, "batch.seq_len": 2048}

NEXT = {"model": "qwen3-next-80b-a3b", "cluster.nodes": 4, "parallel.tp": 2, "parallel.ep": 16, "parallel.pp": 1,
        "parallel.sequence_parallel": True, "batch.global": 64, "batch.seq_len": 4096}

# rule -> (overrides that break it, message fragment, overrides that satisfy it)
CASES = {
    "sizes_within_world": ({"parallel.pp": 2**40}, "pp=1099511627776 is larger than the world size 8 (1 nodes x 8 GPUs)",
                           {"parallel.pp": 2, "batch.global": 64}),
    "world_divisible": ({"parallel.tp": 3}, "world size 8 (1 nodes x 8 GPUs) is not divisible by tp*pp*cp = 3*1*1 = 3",
                        {"parallel.tp": 4}),
    "expert_grid": ({**MOE, "cluster.nodes": 1, "cluster.gpus_per_node": 6, "parallel.ep": 4, "batch.global": 60},
                    "world size 6 is not divisible by etp*ep*pp = 1*4*1 = 4", MOE),
    "heads_divisible": ({"model": "qwen2-0.5b", "parallel.tp": 4}, "tp=4 does not divide num_query_groups=2",
                        {"model": "qwen2-0.5b", "parallel.tp": 2}),
    "ffn_divisible": ({"model": "qwen2-0.5b", "parallel.tp": 1, "parallel.etp": None, "cluster.gpus_per_node": 8,
                       "batch.global": 64, "parallel.cp": 1, "model_override": None}, None, None),
    "layers_divisible": ({"parallel.tp": 1, "parallel.pp": 3, "cluster.gpus_per_node": 3, "batch.global": 3},
                         "pp=3 does not divide num_layers=32", {"parallel.tp": 1, "parallel.pp": 4,
                                                                 "cluster.gpus_per_node": 4, "batch.global": 4}),
    "vpp_needs_pp": ({"parallel.vpp": 2}, "vpp=2 needs pp > 1 (pp=1)",
                     {"parallel.vpp": 2, "parallel.pp": 2, "batch.global": 64}),
    "interleaved_microbatches": ({"parallel.pp": 2, "parallel.vpp": 2, "batch.global": 6},
                                "number of micro-batches (global/(micro*dp) = 3) to be a multiple of pp=2",
                                {"parallel.pp": 2, "parallel.vpp": 2, "batch.global": 8}),
    "experts": ({"parallel.ep": 2}, "ep=2 needs a MoE model", {**MOE}),
    "sequence_parallel": ({"parallel.tp": 1, "parallel.sequence_parallel": True}, "sequence_parallel=true needs tp > 1",
                          {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "context_parallel": ({"parallel.cp": 2, "batch.seq_len": 4098}, "seq_len=4098 is not divisible by 2*cp = 4",
                         {"parallel.cp": 2, "batch.seq_len": 4096}),
    "mtp_within_sequence": ({"mtp.layers": 2, "batch.seq_len": 2},
                            "mtp.layers=2 at seq_len=2: MTP module k predicts the token k+1 ahead",
                            {"mtp.layers": 1, "batch.seq_len": 2}),
    "batch_invariant": ({"batch.global": 63}, "global batch 63 is not divisible by micro*dp = 1*4 = 4",
                        {"batch.global": 68}),
    "zero_with_pipeline": ({"parallel.pp": 2, "zero.stage": 2},
                           "zero.stage=2 with pp=2: DeepSpeed's pipeline engine supports ZeRO 0 or 1 only",
                           {"parallel.pp": 2, "zero.stage": 1}),
    "offload": ({"zero.offload_optimizer": "cpu", "optimizer.impl": "torch"}, "needs DeepSpeed's optimizer",
                {"zero.offload_optimizer": "cpu", "target": "hf"}),  # DeepSpeed offloads; Megatron-LM's flags do not
    "precision_overrides": ({"deepspeed": {"fp16": {"enabled": True}}}, "fp16 and bf16 are both enabled",
                            {"deepspeed": {"fp16": {"enabled": False}}}),
    "deepspeed_override_keys": ({"deepspeed": {"gradient_clipin": 2.0}},
                                "unknown key 'gradient_clipin' (did you mean 'gradient_clipping'?)",
                                {"deepspeed": {"gradient_clipping": 2.0}}),
    "deepspeed_zero_overrides": ({"deepspeed": {"zero_optimization": {"reduce_bucket_size": "5e8"}}},
                                "deepspeed.zero_optimization.reduce_bucket_size='5e8' is not a number (DeepSpeed "
                                "refuses it at launch; YAML reads 5e8 without a dot as a string: write 5.0e8 or "
                                "500000000)",
                                {"deepspeed": {"zero_optimization": {"reduce_bucket_size": 5.0e8}}}),
    "tp_comm_overlap": ({"parallel.tp_comm_overlap": True, "target": "recipes"},
                        "only Megatron-LM creates TransformerEngine's userbuffers",
                        {"parallel.tp_comm_overlap": True}),
    "grad_reduce_dtype": ({"optimizer.grad_reduce_dtype": "bf16", "target": "recipes"},
                          "only Megatron-LM's flags choose it", {"optimizer.grad_reduce_dtype": "bf16"}),
    "moe_a2a_overlap": ({**MOE, "moe.a2a_overlap": True, "recompute": "full"},
                        "megatron-core forbids full recomputation with overlap_moe_expert_parallel_comm",
                        {**MOE, "moe.a2a_overlap": True, "batch.seq_len": 1024}),
    "moe_capacity": ({**MOE, "moe.pad_to_capacity": True}, "moe.pad_to_capacity needs moe.capacity_factor",
                     {**MOE, "moe.pad_to_capacity": True, "moe.capacity_factor": 1.0}),
    "megatron_lm_zero": ({"zero.stage": 3}, "zero.stage=3 with target megatron-lm: the generated Megatron-LM flags "
                         "run its distributed optimizer (ZeRO-1)", {"zero.stage": 1}),
    "hf_packing": ({"target": "hf", "data.packing": True}, "the Trainer trains on the dataset and data collator "
                   "the script gives it", {"target": "hf", "data.packing": False}),
    "cross_entropy_fusion": ({"cross_entropy_fusion": "native", "precision": "fp16"},
                             "casts the logits' gradient to bf16", {"cross_entropy_fusion": "native"}),
    "hf_selective_recompute": ({"target": "hf", "recompute": "selective"}, "the HF Trainer's gradient checkpointing "
                               "recomputes whole layers", {"target": "hf", "recompute": "full"}),
    "hf_data_parallel": ({"target": "hf", "parallel.tp": 2, "parallel.pp": 2, "batch.global": 64},
                         "target hf: the HF Trainer has no Megatron model parallelism: parallel.tp=2, parallel.pp=2 "
                         "must be 1 (it trains data-parallel with DeepSpeed ZeRO over all 8 ranks",
                         {"target": "hf", "parallel.tp": 1, "parallel.pp": 1, "batch.global": 64}),
    "megatron_rope": (None, None, None),  # model-level: covered in test_rope_rule below
    "megatron_lm_flags": (None, None, None),  # model-level: test_megatron_lm_yarn_rule below
    "mla_tensor_parallel_local_spec": ({"model": "deepseek-v2-lite", "parallel.tp": 2, "parallel.ep": 4,
                                        "attention.backend": "unfused"},
                                       "multi-latent attention on megatron-core's local layer spec",
                                       {"model": "deepseek-v2-lite", "parallel.tp": 1, "parallel.ep": 8,
                                        "attention.backend": "unfused"}),
    "linear_attention_heads": ({**NEXT, "model": "qwen3-next-tiny", "cluster.nodes": 1, "parallel.tp": 4,
                                "parallel.ep": 1, "batch.seq_len": 256},
                               "tp=4 does not divide linear_num_key_heads=2",
                               {**NEXT, "model": "qwen3-next-tiny", "cluster.nodes": 1, "parallel.tp": 2,
                                "parallel.ep": 4, "batch.seq_len": 256}),
    "linear_attention_context_parallel": ({**NEXT, "parallel.cp": 2},
                                          "cp=2 with gated delta net layers: megatron-core 0.16.1 has no context "
                                          "parallelism for them", NEXT),
    "linear_attention_packing": ({**NEXT, "data.packing": True}, "does not support packed sequences", NEXT),
    "fp8_hardware": ({"fp8.format": "hybrid", "cluster.gpu": "a100-80gb"},
                     "fp8.format=hybrid on a100-80gb: it has no FP8 tensor cores (FP8 peak 0 TFLOP/s against 312 "
                     "in bf16)", {"cluster.gpu": "h100-80gb"}),
    "fp8_settings": ({"fp8": {"format": "hybrid", "recipe": "tensorwise", "bf16_layers": 17}, "parallel.pp": 2},
                     "fp8.bf16_layers=17 exceeds num_layers // pp = 32 // 2 = 16",
                     {"fp8": {"format": "hybrid", "recipe": "tensorwise", "bf16_layers": 16}}),
}
CASES.pop("ffn_divisible")
CASES.pop("megatron_rope")
CASES.pop("megatron_lm_flags")


def plan_of(**over):
    """Megatron's and DeepSpeed's rules alone (this runtime's own limits: tests/toolkit/plan/test_runtime_rules.py).
    With target hf the base spec's selective recompute becomes full and its tp 2 with ZeRO-1 becomes tp 1 with
    ZeRO-3 (the HF Trainer has no selective recompute and no model parallelism: it shards the model with ZeRO)."""
    hf = {"recompute": "full", "parallel.tp": 1, "zero.stage": 3} if over.get("target") == "hf" else {}
    return make_plan(TrainingSpec.from_dict(spec_dict(**{"target": "megatron-lm", **hf, **over})))


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_fails_and_passes(rule):
    bad, fragment, good = CASES[rule]
    errors = plan_of(**bad).errors
    assert any(fragment in e for e in errors), errors
    assert plan_of(**good).valid, plan_of(**good).errors


def test_every_rule_is_covered():
    from tests.toolkit.plan.test_runtime_rules import CASES as RUNTIME

    covered = set(CASES) | set(RUNTIME) | {"ffn_divisible", "megatron_rope", "megatron_lm_flags", "tp_within_node",
                                           "megatron_features",
                                           "sequence_length", "mla_norm_eps", "mla_context_parallel_te",
                                           "more_offload", "deepspeed_warmup",
                                           "fsdp_runs", "fsdp_settings",  # tests/toolkit/estimate/test_fsdp.py
                                           # tests/toolkit/estimate/test_op_recompute.py
                                           "op_recompute", "op_recompute_model"}
    assert {r.__name__ for r in RULES} <= covered


def test_ffn_rule(monkeypatch):
    # qwen2-0.5b: ffn 4864 = 2^8 * 19 and 14 heads, 2 groups: no tp > 2 divides everything; use a model file
    import json
    import tempfile

    from toolkit.models import named_models

    cfg = dict(named_models()["llama-tiny"]["config"], intermediate_size=129)
    with tempfile.TemporaryDirectory() as d:
        open(f"{d}/config.json", "w").write(json.dumps(cfg))
        p = plan_of(model=d, **{"batch.seq_len": 256, "batch.global": 8})
        assert "tp=2 does not divide ffn_hidden_size=129" in p.errors
        p = plan_of(model="llama-tiny", **{"batch.seq_len": 256, "batch.global": 8})
        assert p.valid, p.errors


def test_rope_rule(tmp_path):
    import json

    from toolkit.models import named_models

    cfg = dict(named_models()["llama3.1-8b"]["config"])
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], low_freq_factor=2.0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert any("cannot be expressed in megatron-core" in e for e in plan_of(model=str(tmp_path)).errors)
    assert plan_of(model="llama3.1-8b").valid


def test_megatron_lm_yarn_rule(tmp_path):
    """Megatron-LM 0.16 has no flags for yarn's beta_fast/beta_slow/original length: another value
    is refused for target megatron-lm (the flags are the run), not for the recipes' runtime."""
    import json

    from toolkit.models import named_models

    cfg = dict(named_models()["deepseek-v2-lite"]["config"])
    assert any(k in cfg for k in ("rope_scaling", "rope_parameters"))
    key = "rope_scaling" if "rope_scaling" in cfg else "rope_parameters"
    cfg[key] = dict(cfg[key], beta_fast=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    over = {"model": str(tmp_path), "cluster.nodes": 2}
    assert any("no flags for these yarn settings" in e and "'beta_fast': 16.0" in e for e in plan_of(**over).errors)
    recipes = make_plan(TrainingSpec.from_dict(spec_dict(**{**over, "target": "recipes"})))
    assert not any("yarn" in e for e in recipes.errors)


def test_megatron_lm_cannot_run_gpt_oss_or_gemma3():
    """Megatron-LM core_v0.16.1's flags have no yarn rope outside multi-latent attention (GPT-OSS) and no
    post-norms, per-layer rope base or embedding scale (Gemma 3): refused for target megatron-lm, named."""
    base = {"target": "megatron-lm", "cluster.nodes": 1}
    oss = plan_of(**base, model="gpt-oss-20b", **{"parallel.ep": 8, "parallel.tp": 1})
    assert any("yarn rope outside multi-latent attention: Megatron-LM core_v0.16.1 cannot run it" in e
               for e in oss.errors), oss.errors
    gemma = plan_of(**base, model="gemma3-1b", **{"parallel.tp": 1})
    assert any("post_norms" in e and "Megatron-LM's GPT model has no flags for these" in e for e in gemma.errors), \
        gemma.errors


def test_more_offload_rules():
    assert any("needs zero.stage=3" in e for e in plan_of(**{"zero.offload_param": "cpu"}).errors)
    assert any("needs zero.stage >= 1" in e for e in plan_of(**{"zero.stage": 0, "zero.offload_optimizer": "cpu"}).errors)
    assert any("nvme_path" in e for e in plan_of(**{"zero.offload_optimizer": "nvme"}).errors)
    assert plan_of(**{"zero.stage": 3, "zero.offload_param": "nvme", "zero.offload_optimizer": "nvme",
                      "zero.nvme_path": "/local_nvme", "target": "hf"}).valid


def test_expert_tensor_parallel_other_than_tp_needs_expert_parallel():
    """At ep=1 megatron-core reduces expert weights with the dense ones; at etp != tp those
    ranks hold different expert shards."""
    moe = {**MOE, "parallel.tp": 2, "parallel.sequence_parallel": True, "cluster.nodes": 16}
    assert any("etp=1 != tp=2 with ep=1" in e for e in plan_of(**{**moe, "parallel.ep": 1, "parallel.etp": 1}).errors)
    assert plan_of(**{**moe, "parallel.ep": 8, "parallel.etp": 1}).valid


def test_moe_with_tp_needs_sequence_parallel():
    p = plan_of(**{**MOE, "parallel.tp": 2, "parallel.sequence_parallel": False, "cluster.nodes": 16})
    assert "MoE with tp=2 needs sequence_parallel=true" in p.errors


def test_cp_needs_flash():
    p = plan_of(**{"parallel.cp": 2, "attention.backend": "unfused"})
    assert any("cp > 1 needs attention.backend=flash" in e for e in p.errors)


def test_warnings():
    p = plan_of(**{"cluster.nodes": 4, "parallel.tp": 16, "batch.global": 64})
    assert any("tp=16 is larger than a node (8 GPUs)" in w for w in p.warnings)
    assert plan_of().warnings == ()
    p = plan_of(**{"optimizer.decay": "linear"})
    assert any("WarmupDecayLR in ds_config.json warms up for 2 steps" in w for w in p.warnings)
    assert plan_of(**{"optimizer.decay": "linear", "optimizer.warmup_steps": 2}).warnings == ()
    p = plan_of(**{"batch.seq_len": 16384, "batch.global": 64})
    assert any("exceeds the model's max_position_embeddings=8192" in w for w in p.warnings)


def test_memory_rule_shows_breakdown():
    p = plan_of(**{"model": "llama3-70b", "parallel.tp": 1, "zero.stage": 0, "batch.global": 8})
    (msg,) = [e for e in p.errors if e.startswith("needs ")]
    assert "GiB per GPU" in msg and "> 79.6 GiB usable on h100-80gb" in msg and "params 131.4" in msg
    assert not p.as_dict()["fits"]


def test_all_errors_at_once():
    p = plan_of(**{"parallel.tp": 3, "parallel.vpp": 2, "zero.offload_optimizer": "nvme", "batch.global": 7})
    assert len(p.errors) >= 5
    with pytest.raises(PlanError) as e:
        p.require_valid()
    assert e.value.errors == list(p.errors)


def test_seed_layout_zero2_explained_zero1_accepted():
    from toolkit.spec import TrainingSpec as S

    from tests.conftest import ROOT

    spec = S.from_yaml(ROOT / "examples/llama70b_1024gpu.yaml")
    assert make_plan(spec).valid
    p = make_plan(spec.with_overrides({"zero.stage": 2}))
    assert p.errors == ("zero.stage=2 with pp=8: DeepSpeed's pipeline engine supports ZeRO 0 or 1 only "
                        "(ZeRO-2 would partition the gradients that every pipeline micro-batch uses); "
                        "use zero.stage=1",)


def test_cp_comm_rules():
    """a2a splits heads (and query groups) over cp ranks; a2a+p2p over cp_a2a; cp_a2a only for a2a+p2p."""
    base = {"parallel.cp": 4, "parallel.tp": 2, "batch.global": 128}  # llama3-8b: 32 heads, 8 groups
    assert plan_of(**base, **{"parallel.cp_comm": "a2a"}).valid
    bad = plan_of(**{**base, "parallel.tp": 4, "parallel.cp": 4, "batch.global": 64, "parallel.cp_comm": "a2a"})
    assert "query groups per tp rank 8/tp=2 must both be divisible by 4" in " ".join(bad.errors)
    assert any("needs parallel.cp_a2a" in e for e in plan_of(**base, **{"parallel.cp_comm": "a2a+p2p"}).errors)
    assert plan_of(**base, **{"parallel.cp_comm": "a2a+p2p", "parallel.cp_a2a": 2}).valid
    assert any("for cp_comm=a2a+p2p only" in e for e in plan_of(**base, **{"parallel.cp_a2a": 2}).errors)


def test_uneven_pipeline_rules():
    """megatron's uneven split: Llama-3.1-405B's 126 layers at pp=16 need the embedding and loss
    counted as layers (7 + 8 x 14 + 7); the rule names the numbers otherwise."""
    over = {"model": "llama3.1-405b", "cluster.nodes": 128, "parallel.tp": 8, "parallel.pp": 16,
            "batch.global": 2048, "zero.stage": 1}
    assert any("pp=16 does not divide num_layers=126" in e for e in plan_of(**over).errors)
    ok = plan_of(**over, **{"parallel.embedding_in_split": True, "parallel.loss_in_split": True})
    assert not any("divide" in e for e in ok.errors), ok.errors
    assert ok.layout.as_dict()["pipeline_split"] == "7+8x14+7"
    uneven = plan_of(**over, **{"parallel.first_stage_layers": 6})
    assert not any("divide" in e for e in uneven.errors), uneven.errors  # 6 + 8 x 15


def test_sizes_beyond_the_model_are_rule_errors_and_nothing_is_estimated_from_them():
    """Issue 13: pp = 2**40 once allocated a list of 2**40 stages; issue 19: an invalid layout
    printed `global 2048 = micro 1 x accumulation 48 x dp 42` and a step time."""
    for over, message in [({"parallel.pp": 64, "cluster.nodes": 8, "batch.global": 64},
                           "pp=64 is larger than num_layers=32 (a pipeline stage needs a layer)"),
                          ({"parallel.tp": 64, "cluster.nodes": 8, "batch.global": 64},
                           "tp=64 is larger than num_attention_heads=32"),
                          ({"parallel.tp": 3}, "is not divisible by tp*pp*cp = 3*1*1 = 3")]:
        p = plan_of(**over)
        assert any(message in e for e in p.errors), p.errors
        assert p.memory is None and p.time is None and not p.estimated
        d = p.as_dict()
        assert (d["memory_gib"], d["time"], d["fits"], d["layout"]["dp"], d["batch"]["grad_accum"]) == \
            (None, None, None, None, None)
    assert not any("does not divide" in e for e in plan_of(**{"parallel.tp": 64, "cluster.nodes": 8}).errors)


def test_mtp_modules_are_counted_not_listed():
    """A fuzzed spec with mtp.layers = 631,011 listed that many layers (and 2**31 at seq_len 2**40 filled 22 GB
    in CI before the worker was killed): the MTP modules are counted per kind, so the estimate takes no
    longer and holds no more for more of them, and is linear in their number."""
    big = {"model": "deepseek-v3", "parallel.tp": 8, "parallel.ep": 8, "cluster.nodes": 8, "batch.global": 64}
    p = plan_of(**big, **{"mtp.layers": 2**31, "batch.seq_len": 2**40})
    assert p.estimated and not any("MTP module" in e for e in p.errors)
    one, two, three = (plan_of(**big, **{"mtp.layers": n}) for n in (1, 2, 3))
    flops = [p.time.model_flops for p in (one, two, three)]
    assert 0 < flops[1] - flops[0] == pytest.approx(flops[2] - flops[1], rel=1e-12)
    params = [p.memory.stages[-1].params for p in (one, two, three)]
    assert 0 < params[1] - params[0] == pytest.approx(params[2] - params[1], rel=1e-12)


def test_errors_whose_sizes_come_out_keep_the_estimate():
    p = plan_of(**{"parallel.pp": 2, "zero.stage": 3, "target": "recipes"})  # megatron-lm: megatron_lm_zero too
    assert p.errors == ("zero.stage=3 with pp=2: DeepSpeed's pipeline engine supports ZeRO 0 or 1 only (ZeRO-3 would "
                        "partition the gradients and parameters that every pipeline micro-batch uses); "
                        "use zero.stage=1",)
    assert p.estimated and p.time.step_time_s > 0


def test_dense_model_has_no_expert_grid_error():
    errors = plan_of(**{"parallel.tp": 3}).errors
    assert not any("expert" in e for e in errors), errors


def test_mla_norm_eps_warning(tmp_path):
    import json

    from toolkit.models import named_models

    cfg = dict(named_models()["deepseek-v2-lite"]["config"], rms_norm_eps=1e-5)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    over = {"parallel.ep": 8, "cluster.nodes": 2}
    assert any("will not export to Hugging Face exactly" in w for w in plan_of(model=str(tmp_path), **over).warnings)
    assert not plan_of(model="deepseek-v2-lite", **over).warnings


def test_mla_context_parallel_needs_te_2_5():
    """TransformerEngine before 2.5 has no attention backend for MLA at cp > 1 (TE's own filter);
    the warning names the head sizes and the version, and only MLA at cp > 1 on TE gets it."""
    over = {"parallel.ep": 8, "cluster.nodes": 2, "batch.seq_len": 4096}
    warned = plan_of(model="deepseek-v2-lite", **over, **{"parallel.cp": 2}).warnings
    assert any("cp=2 with multi-latent attention (q/k head size 192, v 128) needs TransformerEngine >= 2.5" in w
               for w in warned), warned
    assert not any("TransformerEngine >= 2.5" in w for w in plan_of(model="deepseek-v2-lite", **over).warnings)
    assert not any("TransformerEngine >= 2.5" in w for w in plan_of(**{"parallel.cp": 2}).warnings)


A2A = {**MOE, "moe.a2a_overlap": True, "batch.seq_len": 1024}  # two micro-batches in flight without pp


@pytest.mark.parametrize("over, fragment", [
    ({"target": "recipes"}, "only Megatron-LM's pipeline schedules overlap"),
    ({"recompute": "full"}, "forbids full recomputation"),
    ({"precision": "fp32"}, "of bf16 or fp16 models only"),
    ({"moe.token_dispatcher": "allgather"}, "the alltoall (or flex) dispatcher only"),
    ({"model": "llama3-8b", "parallel.ep": 1}, "has no expert layers"),
])
def test_a2a_overlap_errors(over, fragment):
    assert any(fragment in e for e in plan_of(**{**A2A, **over}).errors), plan_of(**{**A2A, **over}).errors


@pytest.mark.parametrize("over", [
    {"parallel.ep": 1, "parallel.pp": 4, "parallel.vpp": 2, "parallel.tp": 2},  # no expert parallelism
    {"parallel.pp": 2, "batch.global": 512},  # pipelining without interleaving
])
def test_a2a_overlap_applies_only_where_megatron_runs_it(over):
    """Elsewhere the setting is left out of the generated settings (megatron-core would assert)
    and the all-to-alls are counted exposed; full recompute is then allowed."""
    from toolkit.emit.megatron import transformer_config_kwargs

    plan = plan_of(**{**A2A, **over, "recompute": "full"})
    assert plan.valid, plan.errors
    assert not plan.layout.ep_a2a_overlap
    assert "overlap_moe_expert_parallel_comm" not in transformer_config_kwargs(plan)


@pytest.mark.parametrize("over, accepted", [
    ({}, True), ({"parallel.pp": 2, "parallel.vpp": 4, "batch.global": 512}, True),
    ({"recompute": "full"}, False), ({"precision": "fp32"}, False), ({"moe.token_dispatcher": "allgather"}, False),
])
def test_a2a_overlap_rules_are_megatron_cores(over, accepted):
    """megatron-core 0.16's own TransformerConfig, built from the generated settings with
    overlap_moe_expert_parallel_comm, refuses exactly where our rule reports an error."""
    from toolkit.backends.megatron import load_transformer_config
    from toolkit.emit.megatron import transformer_config_kwargs

    plan = plan_of(**{**A2A, **over})
    kw = transformer_config_kwargs(plan)
    assert kw.get("overlap_moe_expert_parallel_comm") is True
    try:
        cfg = load_transformer_config(kw, use_cpu_initialization=True)
    except (AssertionError, ValueError) as e:
        assert not accepted, f"megatron-core refuses: {e}"
        assert any("moe.a2a_overlap" in err for err in plan.errors), plan.errors
    else:
        assert accepted and cfg.overlap_moe_expert_parallel_comm
        assert plan.valid, plan.errors


def test_capacity_needs_experts_and_a_megatron_target():
    dense = plan_of(**{"moe.capacity_factor": 1.0}).errors
    assert any("has no expert layers" in e for e in dense), dense
    hf = plan_of(**{**MOE, "target": "hf", "moe.capacity_factor": 1.0}).errors
    assert any("Hugging Face's MoE models route every token" in e for e in hf), hf
    assert plan_of(**{**MOE, "target": "recipes", "moe.capacity_factor": 1.0}).valid


def test_every_finding_names_its_rule_and_scope():
    """Rules have ids (their function names, unique) and scopes; what other parts do with a
    finding follows its scope, never its text (the converters keep the layout and model ones)."""
    from toolkit.plan.rules import SCOPES

    assert len({r.__name__ for r in RULES}) == len(RULES) and all(r.scope in SCOPES for r in RULES)
    odd = make_plan(TrainingSpec.from_dict(spec_dict(**{"parallel.tp": 3})))
    assert {(f.rule, f.scope) for f in odd.findings if f.message.startswith("tp=3 does not divide")} >= \
        {("heads_divisible", "layout")}
    big = make_plan(TrainingSpec.from_dict(spec_dict(model="llama3-70b", **{"parallel.tp": 1, "batch.micro": 8})))
    assert [(f.rule, f.scope) for f in big.findings if f.level == "error"] == [("memory", "training")]


def test_features_megatron_does_not_build_are_refused():
    """A model shape's features are read by every part; a value the toolkit's megatron settings do
    not build (no family produces one today) is a model-scope error naming it, not a silent SwiGLU.
    (Linear biases are built since GPT-OSS: add_bias_linear.)"""
    from dataclasses import replace

    from toolkit.models import load_model

    spec = TrainingSpec.from_dict(spec_dict())
    assert make_plan(spec).valid
    for over, says in (({"activation": "geglu"}, "activation='geglu' is not one megatron-core builds here"),
                       ({"norm": "layernorm"}, "norm='layernorm' is not one megatron-core builds here"),
                       ({"rotary_fraction": 0.0}, "rotary_fraction=0.0")):
        plan = make_plan(spec, shape=replace(load_model("llama3-8b"), **over))
        found = [(f.rule, f.scope) for f in plan.findings if says in f.message]
        assert found == [("megatron_features", "model")], (over, plan.errors)


@pytest.mark.parametrize("over, fragment", [
    ({"target": "hf", "cross_entropy_fusion": "native"}, "the HF Trainer runs transformers' own loss"),
    ({"cross_entropy_fusion": "te", "attention.backend": "unfused"}, "cross_entropy_fusion=te needs TransformerEngine"),
    ({"cross_entropy_fusion": "te", "cluster.gpu": "cpu", "cluster.gpus_per_node": 4},
     "here auto on cpu builds megatron's local layers"),
])
def test_cross_entropy_fusion_where_it_cannot_run(over, fragment):
    errors = plan_of(**over).errors
    assert [e for e in errors if fragment in e], errors
    assert not [e for e in plan_of(**{**over, "cross_entropy_fusion": "none"}).errors if "cross_entropy" in e]


def test_zero3_overlap_warning_only_on_deepspeeds_overlapped_zero3():
    """make_plan's zero3_overlap warning (after the estimate): DeepSpeed ZeRO-3 on its overlapped path
    (targets hf and recipes without pipeline) with much of its traffic hidden; not Megatron-LM's
    ZeRO-1, FSDP, or the recipes' pipeline (overlap_comm off: nothing hidden)."""
    z3 = {"model": "llama3-70b", "cluster.nodes": 4, "zero.stage": 3, "recompute": "full", "batch.seq_len": 1024,
          "batch.global": 32, "parallel.tp": 1}
    warn = [f for f in plan_of(**z3, target="hf").findings if f.rule == "zero3_overlap"]
    assert len(warn) == 1 and warn[0].level == "warning"
    assert "are estimated hidden behind compute" in warn[0].message
    assert "% of the estimated throughput" in warn[0].message
    for over in ({"target": "recipes", "parallel.pp": 2, "zero.stage": 1}, {"zero.stage": 1},
                 {"target": "hf", "zero.engine": "fsdp"}):
        assert not [f for f in plan_of(**{**z3, **over}).findings if f.rule == "zero3_overlap"], over
