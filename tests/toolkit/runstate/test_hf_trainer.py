"""`toolkit convert run-state --to hf`: the HF Trainer (toolkit.hf, DeepSpeed) resumes the runtime's
training state. The runtime trains a tiny LLaMA (bf16, ZeRO-1, 2 ranks) for 2N steps and saves at
step N; N's checkpoint is converted; the real HF Trainer resumes from the folder
(`trainer.train(resume_from_checkpoint=OUT)`, DeepSpeed `load_universal`) at ZeRO-2 and at ZeRO-3
(one deepspeed launch, this file as the driver) and, right after DeepSpeed loaded, its state is
read through DeepSpeed's own accessors (safe_get_full_fp32_param / safe_get_full_optimizer_state).

Expected values come by another route than the converter's: the runtime's optimizer torch_dist
records, renamed as if they were weights, exported by converters.megatron_to_hf (the weight
export checked against transformers elsewhere). Checked: (1) fp32 masters, exp_avg, exp_avg_sq
and step bit for bit per HF parameter; (2) the resumed bf16 weights equal the exported
safetensors and the masters rounded; (3) the scheduler stands at step N, the first resumed step
uses the runtime's learning rate of step N+1 and the next one the Trainer's schedule.

    python -m deepspeed.launcher.runner --num_gpus 2 tests/toolkit/runstate/test_hf_trainer.py TMP   (the driver)
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "hf_trainer_finetune.py"
N = 3
RUNTIME_SETS = {"precision": "bf16", "zero.stage": 1, "recompute": "none", "train.save_interval": N,
                "optimizer.weight_decay": 0.1}
VARIANTS = {"zero2": {"zero.stage": 2}, "zero3": {"zero.stage": 3}}
KEYS = {"fp32": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # DeepSpeed's name -> runtime's


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    from toolkit.runstate import convert_run_state

    from tests.conftest import SUPPORT, free_port, shm_segments, subprocess_env
    from tests.recipes.test_recipes import launch, tail

    tmp = tmp_path_factory.mktemp("run_state_hf")
    run = {"name": "runtime", "recipe": "llama8b", "sets": RUNTIME_SETS, "steps": 2 * N, "out": str(tmp / "run")}
    # Qwen3-Next (its gated delta nets' input norm under their own key, in_proj and conv1d one key per part)
    nxt = {"name": "qwen3-next", "recipe": "llama8b", "sets": {**RUNTIME_SETS, "model": "qwen3-next-tiny"},
           "steps": N, "out": str(tmp / "next")}
    (tmp / "runs.json").write_text(json.dumps([run, nxt]))
    r = launch(str(SUPPORT / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun", timeout=900)
    assert r.returncode == 0, tail(r)
    convert_run_state(checkpoint(tmp), tmp / "hf", to="hf")
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                        str(port), __file__, str(tmp)], cwd=ROOT, env=subprocess_env(), capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    assert not shm_segments(port)
    return tmp


def checkpoint(tmp: Path, run: str = "run") -> Path:
    return tmp / run / "checkpoints" / f"global_step{N}"


def expected(tmp: Path, key: str, run: str = "run") -> dict:
    """The runtime's saved `key` state ("param", "exp_avg", "exp_avg_sq") under HF names: its
    torch_dist records renamed as weights (metadata only; the data files are linked) and
    exported by converters.megatron_to_hf, which keeps their fp32."""
    from safetensors.torch import load_file

    from converters import megatron_to_hf

    ck, prefix, d = checkpoint(tmp, run), f"optimizer.state.{key}.", tmp / f"as_weights_{run}_{key}"
    out = tmp / f"expected_{run}_{key}"
    if not out.is_dir():
        md = pickle.loads((ck / "optimizer" / ".metadata").read_bytes())
        md.state_dict_metadata = {k[len(prefix):]: v for k, v in md.state_dict_metadata.items() if k.startswith(prefix)}
        md.storage_data = {dataclasses.replace(i, fqn=i.fqn[len(prefix):]): v for i, v in md.storage_data.items()
                           if i.fqn.startswith(prefix)}
        d.mkdir(exist_ok=True)
        for f in (ck / "optimizer").glob("*.distcp"):
            os.symlink(f, d / f.name)
        (d / ".metadata").write_bytes(pickle.dumps(md))
        for name in ("common.pt", "metadata.json"):
            shutil.copy(ck / "model" / name, d / name)
        megatron_to_hf(d, out, hf_config=ck / "model" / "hf")
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def dump(tmp: Path, variant: str) -> dict:
    import torch

    return torch.load(tmp / f"dump_{variant}.pt", weights_only=True)


@pytest.mark.multirank
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trainer_holds_the_saved_optimizer_state_bit_for_bit(resumed, variant):
    import torch

    got = dump(resumed, variant)
    assert got["step"] == [float(N)], got["step"]
    for ds_key, key in KEYS.items():
        want = expected(resumed, key)
        names = set(got["state"])
        assert names == set(want), sorted(set(want) ^ names)  # llama-tiny: untied, 39 tensors
        bad = [n for n in names if not torch.equal(got["state"][n][ds_key], want[n])]
        assert not bad, f"{ds_key}: {len(bad)} of {len(names)} differ, e.g. {bad[:3]}"
        assert all(want[n].dtype == torch.float32 for n in names)


@pytest.mark.multirank
def test_qwen3_next_state_converts_for_the_trainer(resumed):
    """Qwen3-Next's run state as the Trainer's folder: every HF parameter's fp32 master, exp_avg
    and exp_avg_sq bit for bit as the expected route gives them (before, its optimizer records were
    looked up under the Llama layers' norm key and failed: 'missing tensor
    decoder.layers.0.input_layernorm.weight'). The delta nets' out norms are megatron's HF value
    minus 1 (converters.shifted): their masters are exported shifted (the route's weight export
    shifts them too; before, they were copied unshifted), their moments as stored (read here with
    torch.distributed.checkpoint; the route would shift them)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from toolkit.runstate import convert_run_state

    ck = checkpoint(resumed, "next")
    convert_run_state(ck, resumed / "next_hf", to="hf")
    zero = resumed / "next_hf" / f"global_step{N}" / "zero"
    names = {d.name for d in zero.iterdir() if d.is_dir()}  # and optimizer_state.pt beside them
    assert any(".linear_attn.in_proj_qkvz." in n for n in names) and any(".linear_attn.conv1d." in n for n in names)
    norms = {n: "decoder.layers.{}.self_attention.out_norm.weight".format(n.split(".")[2])
             for n in names if n.endswith(".linear_attn.norm.weight")}
    assert len(norms) == 3  # qwen3-next-tiny: 3 delta nets, then gated attention
    md = dcp.FileSystemReader(str(ck / "optimizer")).read_metadata()
    for ds_key, key in KEYS.items():
        want = expected(resumed, key, "next")
        assert names == set(want), sorted(set(want) ^ names)
        if key != "param":
            raw = {n: torch.empty(md.state_dict_metadata[f"optimizer.state.{key}.{m}"].size) for n, m in norms.items()}
            dcp.load({f"optimizer.state.{key}.{m}": raw[n] for n, m in norms.items()},
                     checkpoint_id=str(ck / "optimizer"), no_dist=True)
            want.update(raw)
        bad = [n for n in names if not torch.equal(torch.load(zero / n / f"{ds_key}.pt")["param"], want[n])]
        assert not bad, f"{ds_key}: {len(bad)} of {len(names)} differ, e.g. {bad[:3]}"


@pytest.mark.multirank
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trainer_weights_are_the_exported_weights(resumed, variant):
    import torch
    from safetensors.torch import load_file

    got, masters = dump(resumed, variant)["weights"], expected(resumed, "param")
    saved = {k: v for f in sorted((resumed / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert got and all(t.dtype == torch.bfloat16 for t in got.values())
    assert [n for n in got if not torch.equal(got[n], saved[n])] == []
    assert [n for n in got if not torch.equal(got[n], masters[n].to(torch.bfloat16))] == []


@pytest.mark.multirank
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_schedule_continues_at_the_saved_step(resumed, variant):
    """The first resumed step (N+1) runs at the runtime's learning rate of step N+1 (the converted
    param groups); the next ones at the Trainer's own schedule (transformers' cosine_with_min_lr
    from the scheduler's step N), which is the runtime's (megatron-core's) cosine."""
    got = dump(resumed, variant)
    runtime = [json.loads(line) for line in (resumed / "run" / "metrics.jsonl").read_text().splitlines()]
    lr = {m["step"]: m["lr"] for m in runtime}
    assert got["scheduler_last_epoch"] == N and got["global_step_at_begin"] == N
    assert got["lrs"][0] == [lr[N + 1], lr[N + 1]], (got["lrs"], lr)
    assert [g[0] for g in got["lrs"][1:]] == pytest.approx([lr[s] for s in range(N + 2, 2 * N + 1)], rel=1e-12)
    assert got["steps_run"] == N and got["final_step"] == 2 * N
    assert got["weight_decay"] == [0.1, 0.0]  # the Trainer's groups: with weight decay, without


@pytest.mark.multirank
def test_progress_reports_every_byte_once(resumed, tmp_path):
    """The progress callback hears every byte of the weights and of the optimizer states exactly
    once, and a second conversion writes the same safetensors."""
    import torch
    from safetensors import safe_open

    from toolkit.runstate import convert_run_state

    heard = []
    out = convert_run_state(checkpoint(resumed), tmp_path / "hf", to="hf", progress=heard.append)
    states = sum(torch.load(f, mmap=True, weights_only=True)["param"].nbytes
                 for f in out.glob("global_step*/zero/*/*.pt") if f.stem in KEYS)
    weights = 0
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            weights += sum(st.get_tensor(k).nbytes for k in st.keys())
    assert sum(heard) == states + weights
    for f in (resumed / "hf").glob("*.safetensors"):
        assert (out / f.name).read_bytes() == f.read_bytes()


@pytest.mark.multirank
def test_a_failed_weights_export_leaves_no_output(resumed, tmp_path, monkeypatch):
    """An error in the weights' writer reaches the caller, and nothing is left at the output."""
    from toolkit.runstate import convert_run_state, hf_trainer

    def broken(*_args):
        raise OSError("disk full (test)")

    monkeypatch.setattr(hf_trainer, "_weights", broken)
    with pytest.raises(OSError, match="disk full"):
        convert_run_state(checkpoint(resumed), tmp_path / "hf", to="hf")
    assert not (tmp_path / "hf").exists() and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ driver
def _read_state(trainer) -> dict:
    """Every rank (collectives): each parameter's masters, moments and 16-bit weight, whole."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state, weights = {}, {}
    for name, p in trainer.deepspeed.module.named_parameters():
        state[name] = {"fp32": safe_get_full_fp32_param(p).clone(),
                       **{k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}}
        with deepspeed.zero.GatheredParameters([p]):
            weights[name] = p.detach().clone()
    basic = trainer.deepspeed.optimizer.optimizer
    steps = sorted({float(s["step"]) for s in basic.state.values() if "step" in s})
    return {"state": state, "weights": weights, "step": steps,
            "weight_decay": [g["weight_decay"] for g in basic.param_groups]}


def driver(tmp: Path) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback

    sys.path.insert(0, str(EXAMPLE.parent))
    sys.path.insert(0, str(ROOT))
    import hf_trainer_finetune as example
    from tests.support.runtime_worker import recipe_spec
    from toolkit.hf import PlanCallback, leave_process_group, load_model, training_arguments
    from toolkit.spec import TrainingSpec

    o = recipe_spec("llama8b", 2, RUNTIME_SETS).optimizer
    base = TrainingSpec.from_yaml(example.SPEC).with_overrides({
        "train.steps": 2 * N, "deepspeed.checkpoint.load_universal": True, "optimizer.lr": o.lr,
        "optimizer.min_lr": o.min_lr, "optimizer.warmup_steps": o.warmup_steps, "optimizer.decay": o.decay,
        "optimizer.weight_decay": o.weight_decay, "optimizer.betas": list(o.betas), "optimizer.eps": o.eps,
        "optimizer.clip_grad": o.clip_grad})

    class Probe(TrainerCallback):
        def __init__(self):
            self.got, self.trainer = {"lrs": []}, None

        def on_train_begin(self, args, state, control, **kw):
            self.got.update(_read_state(self.trainer), scheduler_last_epoch=self.trainer.lr_scheduler.last_epoch,
                            global_step_at_begin=state.global_step)

        def on_step_begin(self, args, state, control, **kw):
            self.got["lrs"].append([g["lr"] for g in self.trainer.deepspeed.optimizer.optimizer.param_groups])

    for name, over in VARIANTS.items():
        spec = base.with_overrides(over)
        args = training_arguments(spec, tmp / name, report_to="none", save_strategy="no", disable_tqdm=True)
        probe = Probe()
        trainer = Trainer(model=load_model(spec, tmp / "hf", args=args), args=args, callbacks=[PlanCallback(spec), probe],
                          train_dataset=example.TextBlocks(example.TEXT, spec.batch.seq_len))
        probe.trainer = trainer
        trainer.train(resume_from_checkpoint=str(tmp / "hf"))
        probe.got.update(steps_run=len(probe.got["lrs"]), final_step=trainer.state.global_step)
        if dist.get_rank() == 0:
            torch.save(probe.got, tmp / f"dump_{name}.pt")
        dist.barrier()
    leave_process_group()  # before the ranks exit (toolkit.hf.leave_process_group says why)


if __name__ == "__main__":
    driver(Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
