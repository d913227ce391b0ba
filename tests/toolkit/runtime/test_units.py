"""The runtime's pure parts, no process group: what it refuses, the tiny flavour, the
DeepSpeed settings it adds, parameter groups, gradient rules, global names, checkpoints."""
import types

import pytest
import torch

from toolkit.cli.train import main
from toolkit.emit.deepspeed import deepspeed_config
from toolkit.errors import InputFileError, OutputExistsError
from toolkit.kernels import spec_kernels
from toolkit.plan import make_plan
from toolkit.runtime import checkpoint, engine, grads, init, trainer
from toolkit.runtime.recipe import tiny_flavor
from toolkit.spec import TrainingSpec, set_dotted

from tests.conftest import spec_dict


def tiny(**over):
    """A tiny llama plan on 2 CPU ranks, with dotted overrides (parallel__tp=2)."""
    d = {"model": "llama-tiny", "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"}, "precision": "fp32",
         "recompute": "none", "batch": {"micro": 2, "global": 16, "seq_len": 64},
         "moe": {"token_dispatcher": "allgather"}, "attention": {"backend": "unfused"}}
    for k, v in over.items():
        set_dotted(d, k.replace("__", "."), v)
    return make_plan(TrainingSpec.from_dict(d))


def test_unsupported_lists_only_missing_hardware():
    """The runtime's own limits are plan rules (tests/toolkit/plan/test_runtime_rules.py); at start only a missing
    GPU or library stops a valid plan."""
    for over in [{}, {"parallel__tp": 2}, {"parallel__pp": 2}, {"model": "mixtral-tiny", "parallel__ep": 2},
                 {"recompute": "selective"}, {"recompute": "full"}]:
        assert trainer.unsupported(tiny(**over), cuda=False) == []
    gpu = tiny(cluster__gpu="h100-80gb", attention__backend="flash")
    assert gpu.valid, gpu.errors
    [msg] = trainer.unsupported(gpu, cuda=False)
    assert "cluster.gpu=h100-80gb but this machine has no CUDA device" in msg
    [msg] = trainer.unsupported(gpu, cuda=True, te=False)
    assert "transformer_engine is not importable" in msg
    assert trainer.unsupported(gpu, cuda=True, te=True) == []
    assert trainer.unsupported(tiny(cluster__gpu="h100-80gb"), cuda=True) == []  # local spec: no TE needed


def test_world_size_message():
    plan = make_plan(TrainingSpec.from_dict(spec_dict(cluster__nodes=128, parallel__tp=8, parallel__pp=8,
                                                      batch__global=2048, model="llama3-70b")))
    with pytest.raises(trainer.WorldSizeError, match=r"^needs 1024 ranks \(tp8 x pp8 x dp16\), found 2$"):
        trainer.check_world(plan, 2)
    trainer.check_world(plan, 1024)


def test_tiny_flavor_keeps_how_changes_size():
    full = TrainingSpec.from_dict(spec_dict(zero__stage=2, zero__offload_optimizer="nvme", zero__nvme_path="/nvme",
                                            optimizer__weight_decay=0.05, train__seed=7))
    t = tiny_flavor(full, "llama-tiny", 4, cuda=False)
    assert (t.model, t.cluster.world_size, t.cluster.gpu) == ("llama-tiny", 4, "cpu")
    assert (t.precision, t.recompute, spec_kernels(t).attention) == ("fp32", "selective", "unfused")
    assert (t.zero.stage, t.zero.offload_optimizer, t.optimizer.weight_decay, t.train.seed) == (2, "cpu", 0.05, 7)
    assert (t.parallel.tp, t.batch.global_, t.train.steps, t.moe.token_dispatcher) == (1, 8, 30, "allgather")
    g = tiny_flavor(full, "llama-tiny", 8, cuda=True)
    assert (g.precision, g.cluster.gpu, g.recompute) == ("bf16", "h100-80gb", "selective")
    assert spec_kernels(g).attention == "flash"  # the recipe's default, auto, on a GPU


def test_runtime_config_adds_only_runtime_settings():
    plan = tiny()
    want = deepspeed_config(plan)
    del want["scheduler"]  # megatron's schedule replaces DeepSpeed's
    want["optimizer"]["params"]["torch_adam"] = True  # no CUDA here: torch's AdamW, not the fused kernel
    want["timers"] = {"throughput": {"enabled": False}}  # the runtime times its steps itself
    assert engine.runtime_config(plan) == want
    pp = engine.runtime_config(tiny(parallel__pp=2))
    assert pp["zero_optimization"]["overlap_comm"] is False
    off = engine.runtime_config(tiny(zero__offload_optimizer="cpu"))
    assert "torch_adam" not in off["optimizer"]["params"], "offload steps with DeepSpeed's CPU Adam"


def test_causal_mask_is_built_once_and_counted():
    """The mask megatron's local attention is given: built once per sequence length and device
    (not at every forward: 2 s x s bool allocations each time before, 1 GiB apiece at 32k
    tokens), none with TransformerEngine's attention or at cp > 1; the memory estimate counts
    exactly what is kept."""
    from toolkit.estimate.memory import causal_mask_bytes

    plan = tiny()
    stage = engine.Stage([], explicit_mask=not spec_kernels(plan.spec).transformer_engine)
    mask = stage.causal_mask(64, torch.device("cpu"), cp=1)
    assert mask.dtype == torch.bool and mask.nbytes == causal_mask_bytes(plan.spec, plan.layout) == 64 * 64
    assert stage.causal_mask(64, torch.device("cpu"), cp=1) is mask
    assert torch.equal(mask[0, 0], torch.ones(64, 64, dtype=torch.bool).triu(1))  # megatron's: True = masked
    assert stage.causal_mask(32, torch.device("cpu"), cp=1).shape == (1, 1, 32, 32)
    assert stage.causal_mask(64, torch.device("cpu"), cp=2) is None
    assert causal_mask_bytes(tiny(parallel__cp=2).spec, tiny(parallel__cp=2).layout) == 0
    te = tiny(cluster__gpu="h100-80gb", attention__backend="flash")
    assert spec_kernels(te.spec).transformer_engine and causal_mask_bytes(te.spec, te.layout) == 0
    assert engine.Stage([], explicit_mask=False).causal_mask(64, torch.device("cpu"), cp=1) is None


def test_learning_rate_is_megatrons_schedule_counted_in_samples():
    """Linear warm-up from 0 (step k uses lr * k / warmup), then cosine to min_lr at
    train.steps, as Megatron-LM applies it; no weight decay on the wd_mult = 0 group."""
    import math

    plan = tiny(optimizer__warmup_steps=4, optimizer__lr=1e-3, optimizer__min_lr=1e-4, train__steps=20,
                optimizer__weight_decay=0.1)
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    opt = torch.optim.AdamW(engine.param_groups(m, 0.1, experts=False), lr=1.0)
    sched = engine.lr_scheduler(plan)(opt)
    want = [1e-3 * k / 4 if k <= 4 else 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (k - 4) / 16))
            for k in range(21)]
    got = []
    for _ in range(21):
        got.append(opt.param_groups[0]["lr"])
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        sched.step(increment=plan.batch.global_)
    assert got == pytest.approx(want, abs=1e-12)


def test_param_groups_decay_and_experts():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    expert = m[2].weight
    groups = engine.param_groups(m, 0.1, experts=False)
    summary = [(g["name"], len(g["params"]), g["weight_decay"]) for g in groups]
    assert summary == [("decay", 2, 0.1), ("no_decay", 3, 0.0)]
    expert.allreduce, expert.group_name = False, "ep_size_2"
    groups = engine.param_groups(m, 0.1, experts=True)
    moe = [g for g in groups if g.get("moe")]
    assert len(moe) == 1 and moe[0]["params"] == [expert] and moe[0]["name"] == "ep_size_2"
    dense = [p for g in groups if not g.get("moe") for p in g["params"]]
    assert moe[0]["weight_decay"] == 0.1 and all(expert is not p for p in dense)


def test_tp_reduction_rule_is_megatrons():
    cfg = types.SimpleNamespace(sequence_parallel=True, qk_layernorm=True)
    p = torch.nn.Parameter(torch.ones(2))
    assert grads.tp_reduction("decoder.final_layernorm.weight", p, cfg) is None
    p.sequence_parallel = True
    assert grads.tp_reduction("decoder.final_layernorm.weight", p, cfg) == "sum"
    assert grads.tp_reduction("x", p, types.SimpleNamespace(sequence_parallel=False, qk_layernorm=False)) is None
    q = torch.nn.Parameter(torch.ones(2))
    assert grads.tp_reduction("decoder.layers.0.self_attention.q_layernorm.weight", q, cfg) == "sum"
    q.average_gradients_across_tp_domain = True
    assert grads.tp_reduction("anything", q, cfg) == "mean"


def test_global_names_are_layout_free():
    layer = lambda n, experts: types.SimpleNamespace(layer_number=n, mlp=types.SimpleNamespace(
        experts=types.SimpleNamespace(local_experts=[0] * experts)))
    chunk = types.SimpleNamespace(share_embeddings_and_output_weights=True,
                                  decoder=types.SimpleNamespace(layers=[layer(3, 2), layer(4, 2)]))
    assert init.global_name(chunk, "decoder.layers.1.self_attention.linear_qkv.weight", 0) == \
        "decoder.layers.3.self_attention.linear_qkv.weight"
    assert init.global_name(chunk, "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 1) == \
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    assert init.global_name(chunk, "output_layer.weight", 0) == "embedding.word_embeddings.weight"
    # crc32, not hash(): the same in every process
    assert init.seed_of(1234, "embedding.word_embeddings.weight") == 173528483


def test_checkpoint_resolution(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for part in (checkpoint.MODEL, checkpoint.OPTIMIZER):
        (root / "global_step15" / part).mkdir(parents=True)
        (root / "global_step15" / part / ".metadata").write_bytes(b"")
    (root / "global_step15" / checkpoint.STATE).write_text('{"step": 15, "consumed_samples": 240}')
    with pytest.raises(InputFileError, match="no checkpoint"):
        checkpoint.resolve(tmp_path / "run")
    (root / "latest").write_text("global_step15")
    for given in (tmp_path / "run", root, root / "global_step15"):
        assert checkpoint.resolve(given) == root / "global_step15"
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "metadata.json").write_text("{}")
    assert checkpoint.weights_only(tmp_path / "bare") == tmp_path / "bare"
    assert checkpoint.weights_only(root / "global_step15") is None
    mlm = tmp_path / "megatron_lm"  # Megatron-LM's layout, as `toolkit convert hf-to-megatron` writes it
    (mlm / "iter_0000200").mkdir(parents=True)
    (mlm / "latest_checkpointed_iteration.txt").write_text("200")
    with pytest.raises(InputFileError, match="not a torch_dist checkpoint"):
        checkpoint.weights_only(mlm)
    (mlm / "iter_0000200" / "metadata.json").write_text("{}")
    assert checkpoint.weights_only(mlm) == mlm / "iter_0000200"


def test_output_folder_rules(tmp_path):
    plan = tiny()
    trainer.check_out(plan, trainer.RunOptions(out=tmp_path))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("global_step3")
    with pytest.raises(OutputExistsError, match="latest' belongs to an earlier run"):
        trainer.check_out(plan, trainer.RunOptions(out=tmp_path))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        trainer.check_out(plan, trainer.RunOptions(out=tmp_path))
    trainer.check_out(plan, trainer.RunOptions(out=tmp_path, overwrite=True))
    trainer.check_out(plan, trainer.RunOptions(out=tmp_path, load=str(tmp_path)))


def test_entry_point_errors_before_any_process_group(tmp_path, capsys):
    assert main(["--spec", str(tmp_path / "none.yaml")]) == 3
    assert "does not exist" in capsys.readouterr().err
    spec = tmp_path / "s.yaml"
    spec.write_text(tiny().spec.to_yaml())
    assert main(["--spec", str(spec), "--set", "parallel.tpp=2"]) == 2
    assert "unknown key 'parallel.tpp' (did you mean 'tp'?)" in capsys.readouterr().err
    assert main(["--spec", str(spec), "--set", "parallel.tp=3"]) == 2
    assert "tp=3 does not divide num_attention_heads=4" in capsys.readouterr().err
    assert main(["--spec", str(spec)]) == 2
    assert "needs 2 ranks (tp1 x dp2), found 1" in capsys.readouterr().err


def test_teardown_warns_where_a_library_moved(monkeypatch, caplog):
    """engine.drop_module_references runs when training is over: a cache it no longer finds
    (another DeepSpeed or megatron-core release) is a warning naming it, not an error; this
    engine's entries leave ZeRO-3's module stack, other modules' stay."""
    from deepspeed.runtime.zero import parameter_offload
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    mine, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    monkeypatch.setattr(parameter_offload, "FWD_MODULE_STACK", [other, mine, mine])
    monkeypatch.setattr(RotaryEmbedding, "forward", lambda self, *a: None)
    engine.drop_module_references(types.SimpleNamespace(module=mine))
    assert parameter_offload.FWD_MODULE_STACK == [other]
    assert [r.getMessage() for r in caplog.records if r.name == "toolkit.runtime.engine"] == [
        "RotaryEmbedding.forward is no longer an lru_cache: a ZeRO-3 model may stay in memory after the run"]
