"""Generated settings validated by the libraries that consume them: DeepSpeed's
DeepSpeedConfig (with the real data-parallel size) and megatron-core's TransformerConfig."""
import json
import os
import shlex
import signal
import subprocess
import time

import pytest

from toolkit.backends.deepspeed import unknown_deepspeed_keys
from toolkit.backends.megatron import load_transformer_config
from toolkit.emit import artifacts, write_artifacts
from toolkit.emit.deepspeed import AUTO, deepspeed_config
from toolkit.emit.launch import requeue_on_notice, slurm_script
from toolkit.emit.megatron import megatron_lm_args, transformer_config_kwargs
from toolkit.errors import OutputExistsError, PlanError
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

from tests.conftest import EXAMPLES, SUPPORT, PlanMPU, spec_dict

VARIANTS = [
    {"zero.stage": 0, "parallel.tp": 8, "precision": "fp32"}, {"zero.stage": 1}, {"zero.stage": 2}, {"zero.stage": 3},
    {"zero.stage": 2, "zero.offload_optimizer": "cpu"},
    {"zero.stage": 3, "zero.offload_optimizer": "cpu", "zero.offload_param": "cpu"},
    {"zero.stage": 3, "zero.offload_optimizer": "nvme", "zero.nvme_path": "/nvme"},
    {"precision": "fp16"}, {"precision": "fp32"}, {"optimizer.impl": "torch"},
    {"optimizer.decay": "linear"}, {"optimizer.decay": "constant"},
    {"parallel.pp": 2, "parallel.vpp": 2, "batch.global": 64, "target": "megatron-lm"},
    {"zero.stage": 3, "parallel.tp": 1, "zero.hpz_partition_size": 8},
]


def plans():
    out = [make_plan(TrainingSpec.from_yaml(p)) for p in EXAMPLES]
    out += [make_plan(TrainingSpec.from_dict(spec_dict(**v))) for v in VARIANTS]
    assert all(p.valid for p in out), [p.errors for p in out]
    return out


def _walk(d, path=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{path}{k}.")
        else:
            yield f"{path}{k}", v


def test_deepspeed_accepts_every_config_with_real_dp(ds_dist):
    from deepspeed.runtime.config import DeepSpeedConfig

    for plan in plans():
        cfg = deepspeed_config(plan)
        assert not [p for p, v in _walk(cfg) if v == AUTO]
        assert unknown_deepspeed_keys(cfg) == []
        ds = DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=PlanMPU(plan.layout.dp))
        assert ds.world_size == plan.layout.dp
        assert ds.train_batch_size == plan.batch.micro * plan.batch.grad_accum * plan.layout.dp
        assert ds.zero_optimization_stage == plan.spec.zero.stage
        assert ds.zero_config.zero_hpz_partition_size == plan.spec.zero.hpz_partition_size  # 1: DeepSpeed's off
        assert ds.bfloat16_config.enabled == (plan.spec.precision == "bf16")
        assert ds.gradient_clipping == plan.spec.optimizer.clip_grad


OVERRIDES = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
             "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_reuse_distance": 200_000_000}
AUTO_ALL = {"reduce_bucket_size": AUTO, "allgather_bucket_size": AUTO, "stage3_prefetch_bucket_size": AUTO,
            "stage3_max_reuse_distance": AUTO}


def test_deepspeeds_own_bucket_defaults_and_names():
    """DEEPSPEED_DEFAULTS, what the estimate takes for an "auto" DeepSpeed drops, are the installed
    DeepSpeedZeroConfig's, and "auto" gives them; STAGE3_ALIASES are its fields' aliases, and a section
    with both names of one (the generated ZeRO-3 section plus a spec override) is refused by DeepSpeed and by
    rule deepspeed_zero_overrides alike."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    from toolkit.backends.deepspeed import DEEPSPEED_DEFAULTS, SIZE_KEYS, STAGE3_ALIASES

    field = {f.alias or name: name for name, f in DeepSpeedZeroConfig.model_fields.items()}
    for zc in (DeepSpeedZeroConfig(), DeepSpeedZeroConfig(**dict.fromkeys(SIZE_KEYS, AUTO))):
        assert {k: getattr(zc, field[k]) for k in SIZE_KEYS} == DEEPSPEED_DEFAULTS
    assert {name: alias for alias, name in field.items() if alias in STAGE3_ALIASES.values()} == STAGE3_ALIASES
    plan = make_plan(TrainingSpec.from_dict(spec_dict(**{"zero.stage": 3},
                                                      deepspeed={"zero_optimization": {"max_reuse_distance": 1}})))
    assert [f.rule for f in plan.findings if f.level == "error"] == ["deepspeed_zero_overrides"]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        DeepSpeedZeroConfig(**deepspeed_config(plan)["zero_optimization"])
    # a prefetch of 0 (DeepSpeed: prefetching off) is refused, not estimated as if prefetched
    no_prefetch = {"zero_optimization": {"stage3_prefetch_bucket_size": 0}}
    off = make_plan(TrainingSpec.from_dict(spec_dict(**{"zero.stage": 3, "parallel.tp": 1}, deepspeed=no_prefetch)))
    assert [f.rule for f in off.findings if f.level == "error"] == ["deepspeed_zero_overrides"]
    assert "turns prefetching off" in off.errors[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_estimate_reads_the_bucket_sizes_deepspeed_runs_with(ds_dist, stage):
    """The data-parallel estimate's buckets are the ones DeepSpeed's own DeepSpeedConfig reads from the
    generated JSON: the model-based sizes, a spec's deepspeed.zero_optimization numbers where it sets
    them (merged over the JSON; before 2026-11-29 the estimate kept the model-based ones regardless), and
    DeepSpeed's defaults for "auto", which DeepSpeed drops (target recipes: nothing fills it in)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from toolkit.backends.deepspeed import bucket_sizes
    from toolkit.estimate.data_time import buckets

    seen = {}
    for over in ({}, OVERRIDES, AUTO_ALL):
        plan = make_plan(TrainingSpec.from_dict(spec_dict(**{"zero.stage": stage, "parallel.tp": 1,
                                                             "cluster.nodes": 4, "batch.global": 256},
                                                          deepspeed={"zero_optimization": over})))
        assert plan.valid, plan.errors
        zc = DeepSpeedConfig(json.loads(json.dumps(deepspeed_config(plan))), mpu=PlanMPU(plan.layout.dp)).zero_config
        spec, shape = plan.spec, plan.shape
        b = buckets(spec.target, spec.precision, spec.zero, plan.layout, shape.hidden_size,
                    sizes=bucket_sizes(spec, shape))
        assert b.reduce == zc.reduce_bucket_size
        if stage == 3:
            assert (b.prefetch, b.reuse, b.gather) == (zc.prefetch_bucket_size, zc.max_reuse_distance,
                                                       zc.prefetch_bucket_size)
        else:
            assert b.gather == zc.allgather_bucket_size
        seen[len(seen)] = plan.time.seconds["dp"], zc.reduce_bucket_size
    # the override reached DeepSpeed and moved the estimate: 4,096^2 elements a bucket against 5e8
    assert seen[0][1] == 4096 * 4096 and seen[1][1] == seen[2][1] == OVERRIDES["reduce_bucket_size"]
    assert seen[0][0] != seen[1][0]


def test_auto_bucket_sizes_under_the_hf_trainer(ds_dist, tmp_path):
    """With target hf, "auto" is what transformers' HF integration fills in from the model: the
    TrainingArguments toolkit.hf builds, their HfTrainerDeepSpeedConfig finalized against a model of the
    plan's hidden size (transformers' own Qwen2 at that width, one small layer), give the estimate's h^2 and 0.9 h^2;
    the reuse distance, which it leaves, is DeepSpeed's default."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.backends.deepspeed import DEEPSPEED_DEFAULTS, bucket_sizes
    from toolkit.hf import training_arguments

    spec = TrainingSpec.from_dict(spec_dict(**{"model": "qwen2-0.5b", "zero.stage": 3, "parallel.tp": 1,
                                               "cluster.gpus_per_node": 1, "batch.global": 1, "target": "hf",
                                               "recompute": "none"},
                                            deepspeed={"zero_optimization": AUTO_ALL}))
    plan = make_plan(spec)
    args = training_arguments(spec, tmp_path, use_cpu=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", hidden_size=plan.shape.hidden_size, num_hidden_layers=1, intermediate_size=64, vocab_size=128,
        num_attention_heads=14, num_key_value_heads=2))
    args.hf_deepspeed_config.trainer_config_finalize(args, model, 10)
    zo = args.hf_deepspeed_config.config["zero_optimization"]
    sizes = bucket_sizes(plan.spec, plan.shape)
    h = plan.shape.hidden_size
    assert (zo["reduce_bucket_size"], zo["stage3_prefetch_bucket_size"]) == (h * h, int(0.9 * h * h))
    assert (sizes["reduce_bucket_size"], sizes["stage3_prefetch_bucket_size"]) == (h * h, int(0.9 * h * h))
    assert zo["stage3_max_reuse_distance"] == AUTO  # left for DeepSpeed, which drops it
    assert sizes["stage3_max_reuse_distance"] == DEEPSPEED_DEFAULTS["stage3_max_reuse_distance"]


def test_deepspeed_rejects_a_wrong_dp(ds_dist):
    """The same check fails when DeepSpeed is told a different data-parallel size."""
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = plans()[0]
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        DeepSpeedConfig(deepspeed_config(plan), mpu=PlanMPU(plan.layout.dp * 2))


def test_hf_variant_auto_exactly_where_training_arguments_own_it():
    plan = make_plan(TrainingSpec.from_dict(spec_dict(**{"zero.stage": 3})))
    autos = {p for p, v in _walk(deepspeed_config(plan, hf=True)) if v == AUTO}
    assert autos == {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "gradient_clipping", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                     "optimizer.params.eps", "optimizer.params.weight_decay", "zero_optimization.reduce_bucket_size",
                     "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold"}
    assert "scheduler" not in deepspeed_config(plan, hf=True)


def test_overrides_merge_and_unknown_nested_keys():
    plan = make_plan(TrainingSpec.from_dict(spec_dict(
        deepspeed={"zero_optimization": {"stage3_max_live_parameters": 5}, "steps_per_print": 7})))
    cfg = deepspeed_config(plan)
    assert cfg["zero_optimization"]["stage3_max_live_parameters"] == 5 and cfg["steps_per_print"] == 7
    assert cfg["zero_optimization"]["stage"] == 1
    assert unknown_deepspeed_keys({"zero_optimization": {"overlap_com": True}}) == [
        "unknown key 'zero_optimization.overlap_com' (did you mean 'overlap_comm'?)"]
    assert unknown_deepspeed_keys({"timers": {"throughput": {"synchronised": False}, "thruput": {}}}) == [
        "unknown key 'timers.thruput' (did you mean 'throughput'?)",
        "unknown key 'timers.throughput.synchronised' (did you mean 'synchronized'?)"]


def test_throughput_timer_never_waits_for_the_device():
    """DeepSpeed's throughput timer, as DeepSpeed reads the config: the generated config keeps its
    log line unsynchronised (synchronised, it waits for the device at every forward and every
    engine.step()); the toolkit's runtime, which times its steps itself, switches it off."""
    from deepspeed.utils.config import get_timers_config

    from toolkit.runtime.engine import runtime_config

    plan = make_plan(TrainingSpec.from_dict(spec_dict()))
    emitted = get_timers_config(deepspeed_config(plan))
    assert emitted.enabled and not emitted.synchronized
    assert get_timers_config(deepspeed_config(plan, hf=True)) == emitted
    assert not get_timers_config(runtime_config(plan)).enabled


MODELS = ["llama3-70b", "llama3.1-8b", "mistral-7b", "qwen2-0.5b", "qwen3-8b", "mixtral-8x7b", "qwen1.5-moe-a2.7b",
          "qwen3-30b-a3b", "deepseek-v2-lite", "deepseek-v3"]


@pytest.mark.parametrize("model", MODELS)
def test_transformer_config_builds(model):
    moe = model.startswith(("mixtral", "qwen1.5", "qwen3-30", "deepseek"))
    over = {"model": model, "cluster.nodes": 8, "parallel.tp": 2, "parallel.pp": 2, "batch.global": 256,
            "recompute": "full", "target": "megatron-lm"}
    if moe:
        over.update({"parallel.ep": 4 if model != "deepseek-v3" else 8, "moe.token_dispatcher": "allgather"})
    if model in ("deepseek-v2-lite", "deepseek-v3"):
        over["parallel.pp"] = 1
    plan = make_plan(TrainingSpec.from_dict(spec_dict(**over)))
    assert [e for e in plan.errors if not e.startswith("needs ")] == []  # layout valid (fit is not the point)
    kw = transformer_config_kwargs(plan)
    cfg = load_transformer_config(json.loads(json.dumps(kw)), use_cpu_initialization=True)
    assert cfg.tensor_model_parallel_size == 2 and cfg.num_layers == plan.shape.num_layers
    assert cfg.num_query_groups == plan.shape.num_query_groups
    assert cfg.recompute_granularity == "full"
    if moe:
        assert cfg.num_moe_experts == plan.shape.moe.num_experts and cfg.moe_router_topk == plan.shape.moe.topk
        assert cfg.expert_model_parallel_size == plan.layout.ep
    if model.startswith("deepseek"):
        assert type(cfg).__name__ == "MLATransformerConfig" and cfg.kv_lora_rank == 512


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_transformer_config(path):
    plan = make_plan(TrainingSpec.from_yaml(path))
    cfg = load_transformer_config(transformer_config_kwargs(plan))
    assert cfg.pipeline_model_parallel_size == plan.layout.pp
    assert cfg.sequence_parallel == plan.layout.sequence_parallel


def test_megatron_lm_args_agree():
    plan = make_plan(TrainingSpec.from_yaml(EXAMPLES[0].parent / "llama70b_1024gpu.yaml"))
    a = " ".join(megatron_lm_args(plan))
    for flag in ["--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 8", "--sequence-parallel",
                 "--num-layers 80", "--hidden-size 8192", "--num-query-groups 8", "--group-query-attention",
                 "--micro-batch-size 1", "--global-batch-size 2048", "--seq-length 4096", "--bf16",
                 "--normalization RMSNorm", "--swiglu", "--rotary-base 500000", "--recompute-granularity selective",
                 "--untie-embeddings-and-output-weights", "--use-distributed-optimizer", "--lr-warmup-iters 2000"]:
        assert flag in a, flag


def test_artifacts_and_scripts(tmp_path):
    plan = make_plan(TrainingSpec.from_yaml(EXAMPLES[0].parent / "llama70b_1024gpu.yaml"))
    out = write_artifacts(plan, tmp_path / "cfg")
    names = {p.name for p in out.iterdir()}
    assert {"ds_config.json", "megatron_config.json", "megatron_lm_args.txt", "accelerate_config.yaml",
            "launch_deepspeed.sh", "hostfile", "launch_torchrun.sh", "slurm.sbatch", "plan.json"} <= names
    for script in ("launch_deepspeed.sh", "launch_torchrun.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(out / script)], check=True)
        assert os.access(out / script, os.X_OK)
    ds = (out / "launch_deepspeed.sh").read_text()
    assert "--num_nodes 128 --num_gpus 8" in ds and "--module toolkit.cli.train --spec spec.yaml" in ds
    assert (out / "hostfile").read_text().count("slots=8") == 128
    assert "#SBATCH --nodes=128" in (out / "slurm.sbatch").read_text()
    assert json.loads((out / "plan.json").read_text())["layout"]["dp"] == 16
    import yaml

    acc = yaml.safe_load((out / "accelerate_config.yaml").read_text())
    assert acc["num_processes"] == 1024 and acc["distributed_type"] == "DEEPSPEED"
    assert acc["deepspeed_config"]["deepspeed_config_file"] == str(out / "ds_config_hf.json")  # as named
    assert TrainingSpec.from_yaml(out / "spec.yaml") == plan.spec
    # the written megatron_config.json builds megatron-core's TransformerConfig as it is
    cfg = load_transformer_config(out / "megatron_config.json")
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (8, 8)
    assert cfg.num_layers == 80 and cfg.sequence_parallel and str(cfg.params_dtype) == "torch.bfloat16"
    gm = json.loads((out / "megatron_model.json").read_text())["gpt_model"]
    assert gm["vocab_size"] == 129024 and gm["rotary_base"] == 500000


def test_writer_refuses_and_is_atomic(tmp_path, monkeypatch):
    plan = make_plan(TrainingSpec.from_dict(spec_dict()))
    out = tmp_path / "cfg"
    write_artifacts(plan, out)
    with pytest.raises(OutputExistsError, match="--overwrite"):
        write_artifacts(plan, out)
    write_artifacts(plan, out, overwrite=True)
    bad = make_plan(TrainingSpec.from_dict(spec_dict(**{"parallel.tp": 3})))
    with pytest.raises(PlanError):
        write_artifacts(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    # a failure half-way leaves neither the folder nor a temporary one behind
    import toolkit.emit as emit

    real = emit.hostfile
    monkeypatch.setattr(emit, "hostfile", lambda p: (_ for _ in ()).throw(RuntimeError("disk full")))
    with pytest.raises(RuntimeError):
        write_artifacts(plan, tmp_path / "half")
    monkeypatch.setattr(emit, "hostfile", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg"]


def test_artifacts_need_a_valid_plan():
    with pytest.raises(PlanError):
        artifacts(make_plan(TrainingSpec.from_dict(spec_dict(**{"batch.global": 3}))), "x")


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_deepspeed_scheduler_builds_and_follows_megatron(decay, warmup):
    """DeepSpeed builds the emitted scheduler (as its engine does: lr_schedules.<type>(opt, **params))
    and it follows megatron-core's OptimizerParamScheduler to within two steps' change of the
    learning rate (DeepSpeed warms up for >= 2 steps and applies values one step later)."""
    import torch
    from deepspeed.runtime import lr_schedules
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    spec = TrainingSpec.from_dict(spec_dict(**{"optimizer.decay": decay, "optimizer.warmup_steps": warmup,
                                               "optimizer.lr": 1e-3, "optimizer.min_lr": 1e-4, "train.steps": 40}))
    sched = deepspeed_config(make_plan(spec))["scheduler"]
    steps, o = spec.train.steps, spec.optimizer

    def lrs(make, mega=False):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=o.lr)
        s, out = make(opt), []
        for _ in range(steps + 1):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            s.step(1) if mega else s.step()
        return out

    ds = lrs(lambda opt: getattr(lr_schedules, sched["type"])(opt, **sched["params"]))
    mc = lrs(lambda opt: OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup, lr_decay_steps=steps,
        lr_decay_style=decay, start_wd=0.0, end_wd=0.0, wd_incr_steps=steps, wd_incr_style="constant"), mega=True)
    # linear decay with < 2 warm-up steps: DeepSpeed's forced 2-step warm-up delays the whole line
    # by up to 2 steps, plus its one-step lag (the plan warns about it)
    forced = decay == "linear" and warmup < 2
    window = (3 if forced else 2) * max(abs(a - b) for a, b in zip(mc[1:], mc)) + 1e-12
    start = 3 if forced else 1
    assert all(0 <= d <= o.lr for d in ds)
    assert all(abs(d - m) <= window for d, m in zip(ds[start:], mc[start:])), list(zip(ds, mc))
    assert abs(ds[-1] - mc[-1]) <= window and mc[-1] == pytest.approx(o.lr if decay == "constant" else o.min_lr)


def test_min_lr_above_lr_is_a_spec_error():
    from toolkit.errors import SpecError

    with pytest.raises(SpecError, match="min_lr=0.1 is larger than lr=0.001"):
        TrainingSpec.from_dict(spec_dict(**{"optimizer.lr": 1e-3, "optimizer.min_lr": 0.1}))


MEGATRON_LM_FLAGS = {line for line in (SUPPORT / "data" / "megatron_lm_core_v0.16.1_flags.txt")
                     .read_text().splitlines() if line.startswith("--")}


@pytest.mark.parametrize("over", [
    {},
    {"parallel.tp": 4, "parallel.pp": 4, "parallel.vpp": 5, "parallel.cp": 2, "batch.global": 512},
    {"parallel.cp": 4, "parallel.cp_comm": "a2a+p2p", "parallel.cp_a2a": 2, "parallel.tp": 2},
    {"parallel.cp": 2, "parallel.cp_comm": "all_gather"},
    {"model": "llama3.1-405b", "parallel.tp": 8, "parallel.pp": 16, "parallel.embedding_in_split": True,
     "parallel.loss_in_split": True},
    {"model": "deepseek-v3", "parallel.tp": 2, "parallel.pp": 16, "parallel.ep": 64, "parallel.etp": 1,
     "parallel.first_stage_layers": 1, "parallel.vpp": 1},
    {"model": "mixtral-8x7b", "parallel.tp": 2, "parallel.ep": 8, "parallel.etp": 1, "recompute": "full"},
    {"model": "mixtral-8x7b", "parallel.tp": 2, "parallel.pp": 4, "parallel.vpp": 2, "parallel.ep": 8,
     "parallel.etp": 1, "moe.a2a_overlap": True},
    {"model": "mistral-7b", "batch.seq_len": 8192},
    {"cross_entropy_fusion": "native"},
    {"cross_entropy_fusion": "te"},
], ids=lambda d: ",".join(f"{k.split('.')[-1]}={v}" for k, v in d.items()) or "seed")
def test_megatron_lm_flags_are_megatron_lms(over):
    """Every flag we generate is one Megatron-LM core_v0.16.1's parser defines (tests/support/data), and the
    layout settings appear with their values."""
    spec = TrainingSpec.from_yaml(EXAMPLES[0].parent / "llama70b_1024gpu.yaml").with_overrides(
        {"target": "megatron-lm", **over})
    args = megatron_lm_args(make_plan(spec))
    flags = {a for a in args if a.startswith("--")}
    assert flags <= MEGATRON_LM_FLAGS, sorted(flags - MEGATRON_LM_FLAGS)
    joined = " ".join(args)
    expect = {"parallel.cp_comm": f"--cp-comm-type {over.get('parallel.cp_comm')}",
              "parallel.cp_a2a": "--hierarchical-context-parallel-sizes 2 2",
              "parallel.vpp": f"--num-virtual-stages-per-pipeline-rank {over.get('parallel.vpp')}",
              "parallel.etp": f"--expert-tensor-parallel-size {over.get('parallel.etp')}",
              "parallel.first_stage_layers": f"--decoder-first-pipeline-num-layers {over.get('parallel.first_stage_layers')}",
              "parallel.embedding_in_split": "--account-for-embedding-in-pipeline-split",
              "parallel.loss_in_split": "--account-for-loss-in-pipeline-split",
              "moe.a2a_overlap": "--overlap-moe-expert-parallel-comm",
              "cross_entropy_fusion": f"--cross-entropy-loss-fusion --cross-entropy-fusion-impl "
                                      f"{over.get('cross_entropy_fusion')}"}
    for key, flag in expect.items():
        if key in over and (key != "parallel.vpp" or over[key] > 1):
            assert flag in joined, flag
    if over.get("parallel.cp", 1) > 1 and "parallel.cp_comm" not in over:
        assert "--cp-comm-type p2p" in joined
    if "cross_entropy_fusion" not in over:  # megatron-core's and Megatron-LM's default: unfused
        assert "--cross-entropy-loss-fusion" not in joined


def test_dropout_follows_the_hf_config(tmp_path):
    """attention_dropout comes from the model's HF config (transformers' own config class reads
    the same value), into megatron's TransformerConfig and Megatron-LM's --attention-dropout;
    hidden_dropout stays 0 (these HF decoders have no residual or embedding dropout), written
    out because Megatron-LM's default for both is 0.1. A shape rebuilt into a config keeps it."""
    from dataclasses import replace

    from toolkit.models import hf_config_dict, named_models
    from toolkit.models.registry import hf_config_object

    cfg = dict(named_models()["llama-tiny"]["config"], attention_dropout=0.25)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plan = make_plan(TrainingSpec.from_dict(spec_dict(model=str(tmp_path), target="megatron-lm")))
    assert plan.shape.attention_dropout == hf_config_object(cfg).attention_dropout == 0.25
    tc = load_transformer_config(transformer_config_kwargs(plan), use_cpu_initialization=True)
    assert (tc.attention_dropout, tc.hidden_dropout) == (0.25, 0.0)
    args = megatron_lm_args(plan)
    assert args[args.index("--attention-dropout") + 1] == "0.25" and args[args.index("--hidden-dropout") + 1] == "0.0"
    assert hf_config_dict(replace(plan.shape, hf_config={}))["attention_dropout"] == 0.25
    seed = make_plan(TrainingSpec.from_yaml(EXAMPLES[0].parent / "llama70b_1024gpu.yaml"))
    assert transformer_config_kwargs(seed)["attention_dropout"] == 0.0  # Llama 3's config: none


@pytest.mark.parametrize("gpu, backend, te", [("h100-80gb", "auto", True), ("h100-80gb", "unfused", False),
                                              ("cpu", "auto", False)])
def test_megatron_model_json_names_the_layer_spec_the_other_files_say(gpu, backend, te):
    """megatron_model.json named megatron's local layer spec while megatron_config.json and the
    Megatron-LM flags said transformer_engine (issue 37). All three now say the same, and the
    named function, given the written arguments, builds megatron-core's spec (local layers here:
    TransformerEngine is not installed on this machine)."""
    import importlib

    spec = TrainingSpec.from_dict(spec_dict(**{"model": "llama-tiny", "cluster.gpu": gpu, "attention.backend": backend,
                                               "cluster.gpus_per_node": 2, "parallel.tp": 1, "batch.global": 8,
                                               "batch.seq_len": 64, "precision": "bf16" if te else "fp32"}))
    files = artifacts(make_plan(spec), "cfg")
    layer = json.loads(files["megatron_model.json"])["layer_spec"]
    impl = json.loads(files["megatron_config.json"])["transformer_impl"]
    assert layer["use_transformer_engine"] is te and impl == ("transformer_engine" if te else "local")
    assert f"--transformer-impl {impl}" in files["megatron_lm_args.txt"]
    if te:
        return
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    module, name = layer["function"].rsplit(".", 1)
    config = load_transformer_config(json.loads(files["megatron_config.json"]), use_cpu_initialization=True)
    kwargs = {k: v for k, v in layer.items() if k != "function"}
    built = getattr(importlib.import_module(module), name)(config, **kwargs, vp_stage=None, pp_rank=0)
    assert built.layer_specs[0].submodules.self_attention.submodules.core_attention is DotProductAttention


NOTICE_CHILD = """trap 'echo "$0" >> {log}; kill "$nap"; exit 4' USR1
sleep 30 &
nap=$!
echo started >> {log}
wait"""


@pytest.mark.parametrize("notice", [True, False])
def test_slurm_script_passes_the_notice_on_and_requeues(tmp_path, notice):
    """slurm.sbatch (SLURM signals the batch shell: --signal=B:USR1@N) passes the signal to its
    srun and requeues the job once srun has exited; the runtime starts with --resume. The wait
    and requeue block runs here in bash with a child in srun's place (it exits 4, as the
    runtime's ranks do after saving) and `scontrol` recording its arguments."""
    plan = make_plan(TrainingSpec.from_yaml(EXAMPLES[0].parent / "llama70b_1024gpu.yaml"))
    text = slurm_script(plan)
    assert "#SBATCH --signal=B:USR1@600\n#SBATCH --requeue\n" in text
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 600" in text
    assert "-m toolkit.cli.train --spec spec.yaml --resume &\n" in text
    log, bin_ = tmp_path / "log", tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> {log}\n')
    (bin_ / "scontrol").chmod(0o755)
    child = f"bash -c {shlex.quote(NOTICE_CHILD.format(log=log))} srun-got-USR1"
    script = tmp_path / "block.sh"
    script.write_text("set -euo pipefail\n" + requeue_on_notice(child if notice else "true"))
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}
    p = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)
    if notice:
        deadline = time.monotonic() + 20
        while not (log.exists() and "started" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=30)
    if notice:
        assert (p.returncode, log.read_text()) == (4, "started\nsrun-got-USR1\nscontrol requeue 77\n"), err
        assert err == "preempted (exit 4): requeueing job 77; it continues with --resume\n"
    else:
        assert (p.returncode, log.exists(), err) == (0, False, "")


def test_gemma3_settings_are_megatron_cores_and_the_toolkits_layers():
    """Gemma-3-27B: megatron-core's own fields where it has them ((1 + w) norms, query_pre_attn_scalar
    168 as the softmax scale, 5 sliding-window layers of 1024 tokens to 1 global, tanh-GeGLU, linear
    rope scaling 8 as the position interpolation factor); the post-norms, local rope base and embedding
    scale named as the toolkit's layers; Megatron-LM, which has no flags for them, refused."""
    import torch

    from toolkit.emit.megatron import gpt_model_kwargs, layer_spec

    plan = make_plan(TrainingSpec.from_dict(spec_dict(model="gemma3-27b", **{"batch.seq_len": 4096})))
    kw = transformer_config_kwargs(plan)
    cfg = load_transformer_config(json.loads(json.dumps(kw)), use_cpu_initialization=True)
    assert cfg.layernorm_zero_centered_gamma and cfg.gated_linear_unit and cfg.qk_layernorm
    assert cfg.softmax_scale == 168 ** -0.5 and cfg.window_size == (1023, 0)
    assert cfg.window_attn_skip_freq == [int((i + 1) % 6 != 0) for i in range(62)]
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    assert cfg.activation_func(x).equal(torch.nn.functional.gelu(x, approximate="tanh"))
    assert not kw["bias_activation_fusion"]  # megatron fuses silu and erf-gelu GLUs only
    gm = gpt_model_kwargs(plan)
    assert gm["seq_len_interpolation_factor"] == 8.0 and gm["rotary_base"] == 1_000_000
    assert gm["share_embeddings_and_output_weights"]
    assert layer_spec(plan)["toolkit_layers"]["features"] == ["zero_centered_norm", "post_norms", "embedding_scale",
                                                              "local_rope_theta"]
    refused = make_plan(TrainingSpec.from_dict(spec_dict(model="gemma3-27b", target="megatron-lm")))
    assert any("post_norms, embedding_scale, local_rope_theta: Megatron-LM" in e for e in refused.errors)


@pytest.mark.parametrize("fp8", [
    {"format": "hybrid"},
    {"format": "e4m3", "recipe": "delayed", "amax_history_len": 1024, "param": True},
    {"format": "hybrid", "recipe": "tensorwise", "bf16_layers": 1, "param": True},
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_fp8_settings_are_megatron_cores_and_megatron_lms(fp8):
    """The spec's fp8 section builds megatron-core's TransformerConfig with those FP8 fields, and every
    Megatron-LM flag it adds is one core_v0.16.1's parser defines, with its value."""
    plan = make_plan(TrainingSpec.from_dict(spec_dict(target="megatron-lm", fp8=fp8)))
    cfg = load_transformer_config(json.loads(json.dumps(transformer_config_kwargs(plan))), use_cpu_initialization=True)
    assert (cfg.fp8, cfg.fp8_recipe) == (fp8["format"], fp8.get("recipe", "delayed"))
    assert cfg.fp8_param == fp8.get("param", False)
    assert cfg.fp8_amax_history_len == fp8.get("amax_history_len", 1)
    assert cfg.first_last_layers_bf16 == bool(fp8.get("bf16_layers"))
    if fp8.get("bf16_layers"):
        assert cfg.num_layers_at_start_in_bf16 == cfg.num_layers_at_end_in_bf16 == fp8["bf16_layers"]
    args = megatron_lm_args(plan)
    assert {a for a in args if a.startswith("--")} <= MEGATRON_LM_FLAGS
    joined = " ".join(args)
    assert f"--fp8-format {fp8['format']}" in joined and f"--fp8-recipe {cfg.fp8_recipe}" in joined
    assert ("--fp8-param-gather" in args) == cfg.fp8_param
    assert ("--first-last-layers-bf16" in args) == cfg.first_last_layers_bf16


def test_no_fp8_settings_without_the_section():
    kw = transformer_config_kwargs(make_plan(TrainingSpec.from_dict(spec_dict(target="megatron-lm"))))
    assert not [k for k in kw if "fp8" in k or "bf16_layers" in k or k == "first_last_layers_bf16"]
