"""toolkit.hf without a process group: TrainingArguments from a spec, checked by transformers'
own DeepSpeed glue and DeepSpeed's config class; the schedule against megatron-core's;
accelerate's config class on the generated YAML; the save checks on real safetensors files."""
from __future__ import annotations

import json

import pytest
import torch

from toolkit.hf import (SpecMismatchError, UnsupportedLayoutError, accelerate_config, check_training_arguments,
                        deepspeed_config, hf_plan, load_model, memory_report, plan_summary,
                        spec_arguments, training_arguments)
from toolkit.hf.callback import batch_conflicts
from toolkit.hf.model import SaveError, check_saved_shapes, expected_shapes
from toolkit.estimate.memory import GiB
from toolkit.spec import TrainingSpec

from tests.conftest import ROOT

TINY_EXAMPLE = ROOT / "examples" / "hf_llama_tiny.yaml"


def tiny(gpus: int = 1, **over) -> TrainingSpec:
    """llama-tiny on CPU ranks: global 8 = micro 2 x accumulation 8/(2*gpus) x dp gpus."""
    d = {"model": "llama-tiny", "cluster": {"nodes": 1, "gpus_per_node": gpus, "gpu": "cpu"},
         "zero": {"stage": 3}, "precision": "bf16", "batch": {"micro": 2, "global": 8, "seq_len": 64},
         "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "betas": [0.9, 0.95], "eps": 1e-8,
                       "weight_decay": 0.1, "clip_grad": 0.5},
         "train": {"steps": 20, "seed": 7}}
    return TrainingSpec.from_dict(d).with_overrides(over)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    """TrainingArguments start accelerate's process-wide state; start and end each test clean."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()


def test_training_arguments_take_every_value_from_the_spec(tmp_path):
    args = training_arguments(tiny(), tmp_path, report_to="none")
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_steps) == (2, 4, 20)
    assert (args.learning_rate, args.weight_decay, args.adam_beta1, args.adam_beta2) == (3e-3, 0.1, 0.9, 0.95)
    assert (args.adam_epsilon, args.max_grad_norm, args.warmup_steps, args.seed) == (1e-8, 0.5, 2, 7)
    assert args.bf16 and not args.fp16 and args.use_cpu and args.world_size == 1
    assert args.lr_scheduler_type.value == "cosine_with_min_lr" and args.lr_scheduler_kwargs == {"min_lr_rate": 3e-4 / 3e-3}
    # transformers filled DeepSpeed's "auto" values from these fields: they are the spec's
    cfg = args.hf_deepspeed_config.config
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (8, 2, 4)
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"] == {"enabled": True}
    assert cfg["optimizer"]["params"] == {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    # ... and DeepSpeed's own config class accepts them (its batch invariant included)
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(json.loads(json.dumps(cfg)))
    assert (ds.train_batch_size, ds.gradient_accumulation_steps, ds.zero_optimization_stage) == (8, 4, 3)


def test_deepspeed_config_has_auto_exactly_where_training_arguments_own_the_value():
    cfg = deepspeed_config(tiny())
    autos = {k for k, v in cfg.items() if v == "auto"}
    assert autos == {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "gradient_clipping"}
    assert set(cfg["optimizer"]["params"].values()) == {"auto"} and "scheduler" not in cfg
    assert "optimizer" not in deepspeed_config(tiny(**{"optimizer.impl": "torch"}))


@pytest.mark.parametrize("override, numbers", [
    ({"per_device_train_batch_size": 4}, "4 x 4 x 1 = 16, the spec's global batch is 8 = micro 2 x accumulation 4 x dp 1"),
    ({"gradient_accumulation_steps": 3}, "2 x 3 x 1 = 6, the spec's global batch is 8"),
])
def test_override_breaking_batch_math_fails_before_anything_is_built(tmp_path, monkeypatch, override, numbers):
    from transformers import TrainingArguments

    def built(*a, **k):
        raise AssertionError("TrainingArguments was built")

    monkeypatch.setattr(TrainingArguments, "__post_init__", built)
    with pytest.raises(SpecMismatchError) as e:
        training_arguments(tiny(), tmp_path, **override)
    assert numbers in str(e.value) and "batch." in str(e.value)


def test_other_spec_owned_overrides_are_errors_and_free_ones_pass(tmp_path):
    with pytest.raises(SpecMismatchError) as e:
        training_arguments(tiny(), tmp_path, learning_rate=1e-3, bf16=False, per_device_batch_size=2)
    msg = str(e.value)
    assert "learning_rate=0.001 but the spec gives 0.003 (optimizer.lr)" in msg
    assert "bf16=False but the spec gives True (precision)" in msg
    assert "unknown key 'TrainingArguments.per_device_batch_size' (did you mean 'per_device_eval_batch_size'?)" in msg \
        or "unknown key 'TrainingArguments.per_device_batch_size' (did you mean 'per_device_train_batch_size'?)" in msg
    ds = deepspeed_config(tiny(**{"zero.stage": 2}))
    with pytest.raises(SpecMismatchError, match=r"deepspeed differs from the config generated from the spec "
                                                r"\(.*zero_optimization.stage: spec 3, found 2"):
        training_arguments(tiny(), tmp_path, deepspeed=ds)
    args = training_arguments(tiny(), tmp_path, seed=3, logging_steps=5, report_to="none", learning_rate=3e-3)
    assert (args.seed, args.logging_steps) == (3, 5)


def test_world_size_other_than_the_spec_fails_with_the_numbers(tmp_path):
    with pytest.raises(SpecMismatchError) as e:
        training_arguments(tiny(gpus=2), tmp_path)
    assert ("this run has 1 processes but the spec's cluster is 1 x 2 = 2 ranks (dp 2): DeepSpeed's "
            "train_batch_size would be 2 x 2 x 1 = 4, the spec's global batch is 8") in str(e.value)


@pytest.mark.parametrize("over, named", [({"parallel.tp": 2}, "parallel.tp=2"),
                                         ({"parallel.pp": 2}, "parallel.pp=2"),
                                         ({"parallel.cp": 2}, "parallel.cp=2")])
def test_model_parallel_specs_are_rejected(over, named):
    with pytest.raises(UnsupportedLayoutError) as e:
        hf_plan(tiny(gpus=2, **over))
    assert named in str(e.value) and "no Megatron model parallelism" in str(e.value)


def test_auto_for_target_hf_proposes_only_layouts_the_trainer_runs():
    """toolkit plan --auto with target hf: every layout it may propose is one hf_plan accepts (pure data
    parallel: the rule hf_data_parallel), not the tp/pp layouts of the Megatron targets."""
    from toolkit.search.search import search

    spec = TrainingSpec.from_dict({"model": "llama3-8b", "target": "hf", "recompute": "full",
                                   "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-80gb"},
                                   "batch": {"micro": 1, "global": 64, "seq_len": 4096}})
    result = search(spec, top=10, workers=1)
    assert result.candidates and result.valid < result.space
    for c in result.candidates:
        assert hf_plan(c.plan).layout.model_parallel == 1, c.plan.layout
    megatron = search(spec.with_overrides({"target": "megatron-lm"}), top=10, workers=1)
    assert any(c.plan.layout.model_parallel > 1 for c in megatron.candidates)  # what target hf now leaves out


def test_hand_built_training_arguments_are_checked_against_the_spec(tmp_path):
    from transformers import TrainingArguments

    plan = hf_plan(tiny())
    values = {k: o.value for k, o in spec_arguments(plan).items()}
    check_training_arguments(plan, TrainingArguments(output_dir=str(tmp_path), **values))
    with pytest.raises(SpecMismatchError) as e:
        check_training_arguments(plan, TrainingArguments(output_dir=str(tmp_path), **{**values, "max_steps": 5}))
    assert "max_steps=5 but the spec gives 20 (train.steps)" in str(e.value)
    ds = {**values["deepspeed"], "zero_optimization": {**values["deepspeed"]["zero_optimization"], "stage": 2}}
    with pytest.raises(SpecMismatchError) as e:
        check_training_arguments(plan, TrainingArguments(output_dir=str(tmp_path), **{**values, "deepspeed": ds}))
    assert "deepspeed zero_optimization.stage: spec 3, found 2" in str(e.value)
    with pytest.raises(SpecMismatchError, match="no DeepSpeed config"):
        check_training_arguments(plan, TrainingArguments(output_dir=str(tmp_path), **{**values, "deepspeed": None}))


def test_resolved_deepspeed_batch_is_checked():
    plan = hf_plan(tiny())
    assert batch_conflicts(plan, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                  "gradient_accumulation_steps": 4}) == []
    bad = batch_conflicts(plan, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                 "gradient_accumulation_steps": 4})
    assert bad[0].startswith("DeepSpeed train_batch_size=16 but the spec gives 8") and len(bad) == 2


@pytest.mark.parametrize("decay, warmup", [("cosine", 3), ("linear", 3), ("constant", 3), ("cosine", 0)])
def test_schedule_is_megatron_cores(tmp_path, decay, warmup):
    """The Trainer's scheduler (built as Trainer.create_scheduler does) against megatron-core's
    OptimizerParamScheduler with the spec's lr, min_lr, warmup and train.steps."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from transformers import get_scheduler

    spec = tiny(**{"optimizer.decay": decay, "optimizer.warmup_steps": warmup})
    o, steps = spec.optimizer, spec.train.steps
    args = training_arguments(spec, tmp_path)
    w = torch.nn.Parameter(torch.zeros(1))
    hf_opt, mc_opt = torch.optim.SGD([w], lr=o.lr), torch.optim.SGD([w], lr=o.lr)
    hf = get_scheduler(args.lr_scheduler_type, optimizer=hf_opt, num_warmup_steps=args.get_warmup_steps(steps),
                       num_training_steps=steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    mc = OptimizerParamScheduler(mc_opt, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
                                 lr_decay_steps=steps, lr_decay_style=decay, start_wd=0.0, end_wd=0.0,
                                 wd_incr_steps=steps, wd_incr_style="constant")
    hf_lrs, mc_lrs = [], []
    for _ in range(steps + 1):
        hf_lrs.append(hf_opt.param_groups[0]["lr"])
        mc_lrs.append(mc_opt.param_groups[0]["lr"])
        hf_opt.step()
        hf.step()
        mc.step(1)
    assert hf_lrs == pytest.approx(mc_lrs, rel=1e-12, abs=1e-15)
    assert hf_lrs[-1] == pytest.approx(o.lr if decay == "constant" else o.min_lr)


def test_schedule_rejects_min_lr_above_lr():
    from toolkit.errors import SpecError

    with pytest.raises(SpecError, match="min_lr=0.1 is larger than lr=0.003"):
        tiny(**{"optimizer.min_lr": 0.1})


def test_accelerate_config_loads_in_accelerate(tmp_path):
    import yaml
    from accelerate.commands.config.config_args import ClusterConfig

    from toolkit.cli import main

    assert main(["config", str(TINY_EXAMPLE), "--out", str(tmp_path / "cfg")]) == 0
    written = ClusterConfig.from_yaml_file(str(tmp_path / "cfg" / "accelerate_config.yaml"))
    assert written.distributed_type.value == "DEEPSPEED" and written.num_processes == 2
    ds_path = written.deepspeed_config["deepspeed_config_file"]
    assert json.loads(open(ds_path).read()) == deepspeed_config(TrainingSpec.from_yaml(TINY_EXAMPLE))
    d = accelerate_config(tiny(gpus=2), tmp_path / "ds.json")
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(d))
    assert ClusterConfig.from_yaml_file(str(tmp_path / "acc.yaml")).deepspeed_config["zero3_init_flag"] is True


def test_accelerate_deepspeed_file_other_than_the_spec_is_rejected(tmp_path, monkeypatch):
    other = tmp_path / "ds_other.json"
    other.write_text(json.dumps(deepspeed_config(tiny(**{"zero.stage": 2}))))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(other))
    with pytest.raises(SpecMismatchError) as e:
        training_arguments(tiny(), tmp_path)
    assert f"DeepSpeed file {other} is not the spec's (" in str(e.value)
    assert "zero_optimization.stage: spec 3, found 2" in str(e.value) and "toolkit config SPEC" in str(e.value)


def test_plan_summary_and_memory_report_state_the_estimate():
    plan = hf_plan(tiny(gpus=2, **{"zero.offload_optimizer": "cpu"}))
    text = plan_summary(plan)
    assert "global batch 8 = micro 2 x accumulation 2 x dp 2" in text and "ZeRO-3 (offload optimizer=cpu" in text
    assert "offloaded to host" in text
    w = plan.memory.worst
    est = w.model_states + w.activations
    r = memory_report(plan, 2 * est, 3 * est)
    assert r["allocated_over_estimate"] == pytest.approx(2) and r["reserved_over_estimate"] == pytest.approx(3)
    assert r["estimated_with_buffers_gib"] == pytest.approx(w.total / GiB)


def test_saved_shapes_check_catches_empty_zero3_weights(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(0), "b": torch.zeros(2, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(SaveError, match=r"a: saved \(0,\), expected \(4, 4\)"):
        check_saved_shapes(tmp_path, {"a": (4, 4), "b": (2, 3)})
    check_saved_shapes(tmp_path, {"b": (2, 3)})


@pytest.mark.parametrize("name", ["llama-tiny", "mixtral-tiny", "qwen2-moe-tiny", "deepseek-v3-tiny", "gpt-oss-tiny"])
def test_checkpoint_shapes_are_what_save_pretrained_writes(tmp_path, name):
    """transformers 5 writes a MoE layer's fused experts one tensor per expert weight (the hub's names):
    what save_model checks for is what save_pretrained wrote, tensor by tensor (saved buffers, DeepSeek's
    e_score_correction_bias, are not parameters and need no check)."""
    from transformers import AutoModelForCausalLM

    from toolkit.hf.model import checkpoint_shapes, saved_shapes
    from toolkit.models import named_models
    from toolkit.models.registry import hf_config_object

    model = AutoModelForCausalLM.from_config(hf_config_object(named_models()[name]["config"]))
    model.save_pretrained(tmp_path, state_dict=model.state_dict())
    want, got = checkpoint_shapes(model, expected_shapes(model)), saved_shapes(tmp_path)
    assert want and {k: got[k] for k in want if k in got} == want
    check_saved_shapes(tmp_path, want)
    if name != "llama-tiny" and name != "gpt-oss-tiny":  # the fused experts are not under their own names
        with pytest.raises(SaveError, match="not saved in full"):
            check_saved_shapes(tmp_path, expected_shapes(model))


def test_load_model_builds_the_specs_model_seeded():
    """Outside ZeRO-3 (no process group needed): architecture, dtype, attention, seed."""
    from toolkit.models import total_params

    spec = tiny(**{"zero.stage": 2})
    a, b = load_model(spec), load_model(spec)
    assert type(a).__name__ == "LlamaForCausalLM" and a.dtype == torch.bfloat16
    assert a.config._attn_implementation == "sdpa" and a.config.rope_parameters["rope_theta"] == 500000.0
    assert sum(p.numel() for p in a.parameters()) == total_params(hf_plan(spec).shape)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert expected_shapes(a)["model.embed_tokens.weight"] == (512, 64)
    assert load_model(tiny(**{"zero.stage": 2, "attention.backend": "unfused"})).config._attn_implementation == "eager"


def test_lora_spec_gives_peft_adapters_as_the_estimate_counts():
    """finetune.method lora on the HF path: peft's get_peft_model on the modules the family's
    weight table names for the megatron targets; B starts at zero (the base's logits), only the
    adapters train, and the plan's gradient and optimizer bytes count exactly them (bf16,
    ZeRO-2 over 2 ranks: 2 + 4 bytes of gradient, 12 of optimizer, each over 2 ranks)."""
    spec = tiny(2, **{"target": "hf", "zero.stage": 2, "finetune.method": "lora",
                      "finetune.lora.targets": ["linear_qkv", "linear_fc2"]})
    model, base = load_model(spec), load_model(tiny(**{"zero.stage": 2}))
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "k_proj", "v_proj", "down_proj"}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable) and len(trainable) == 4 * 4 * 2
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, base(input_ids=tokens).logits)
    n, stage = sum(trainable.values()), hf_plan(spec).memory.stages[0]
    assert stage.grads == 6 * n / 2 and stage.optimizer == 12 * n / 2
    assert set(expected_shapes(model)) == {k.replace(".default.", ".") for k in trainable}  # peft's saved keys
