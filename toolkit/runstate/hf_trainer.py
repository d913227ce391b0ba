"""The runtime's training checkpoint -> a folder the Hugging Face Trainer resumes from.

toolkit.hf runs the Trainer with DeepSpeed, and the Trainer then resumes only through
DeepSpeed's engine: ``Trainer.train(resume_from_checkpoint=OUT)`` calls
``transformers.integrations.deepspeed.deepspeed_load_checkpoint``, which needs an
``OUT/global_step*`` folder and calls ``engine.load_checkpoint(OUT)``; ``optimizer.pt`` is read
only by a Trainer without DeepSpeed (``Trainer._load_optimizer_and_scheduler`` returns before it
for DeepSpeed). DeepSpeed's own ZeRO files are bound to the data-parallel size that wrote them;
its universal checkpoint loads at any, so OUT holds one, keyed by the HF parameter names, and
the Trainer's DeepSpeed config asks for it with ``"checkpoint": {"load_universal": true}``
(a toolkit.hf spec: ``deepspeed: {checkpoint: {load_universal: true}}``)::

  OUT/config.json, model*.safetensors, tokenizer files  the weights: converters.megatron_to_hf
  OUT/trainer_state.json                     the Trainer's position (global_step); it requires the file
  OUT/scheduler.pt                           torch LambdaLR state at the step (read when the Trainer
                                             made its own scheduler, i.e. the torch optimizer)
  OUT/latest_universal                       "global_step<N>"
  OUT/global_step<N>/zero/<HF name>/{fp32,exp_avg,exp_avg_sq,step}.pt
  OUT/global_step<N>/zero/optimizer_state.pt the param groups in the Trainer's order
                                             (decay, no decay) and the step, in the forms ZeRO-1/2
                                             and ZeRO-3 read
  OUT/global_step<N>/mp_rank_00_model_states.pt        counters and the scheduler state (read
  OUT/global_step<N>/zero_pp_rank_0_mp_rank_00_model_states.pt  when DeepSpeed owns the scheduler;
                                             the second name is the one ZeRO-3 looks for)

The masters and moments of each HF tensor are cut from the global Megatron tensors by the
weights' own route (converters' ModelMap.global_to_hf: q/k/v out of linear_qkv, gate/up out of
linear_fc1, the vocabulary padding dropped): Adam's state is elementwise, so it moves exactly as
the weight does. The learning rate of the next step is the runtime's (its param groups hold it
after the scheduler stepped); the Trainer's schedule, built from its TrainingArguments, takes
over after that step.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..runtime.optim_state import KEYS, saved_step
from .runtime_ckpt import SIDE, RunCheckpoint
from .universal import FILES, LATEST, MODEL_STATES, ds_version, model_states

ZERO3_MODEL_STATES = "zero_pp_rank_0_" + MODEL_STATES
TRAINER_STATE, SCHEDULER = "trainer_state.json", "scheduler.pt"
HPARAMS = ("lr", "betas", "eps")


def runtime_to_hf_trainer(ck: RunCheckpoint, out: Path, progress=None) -> Path:
    """Write the folder described in the module docstring into the (empty) folder `out`."""
    from toolkit.models import shape_from_hf

    shape, state, opt = shape_from_hf(ck.hf_config()), ck.state, ck.optimizer_common()
    _check_unpacked(shape)
    step = saved_step(opt)
    _weights(ck, out, progress)
    folder = out / f"global_step{step}"
    _optimizer_states(ck, shape, folder / "zero", step, progress)
    groups = hf_param_groups(opt["optimizer"]["param_groups"])
    torch.save(_optimizer_state(groups, step), folder / "zero" / "optimizer_state.pt")
    sched = scheduler_state(state.get("lr_scheduler") or {}, groups, step)
    counters = {**model_states(state, step), "lr_scheduler": sched}
    for name in (MODEL_STATES, ZERO3_MODEL_STATES):
        torch.save(counters, folder / name)
    torch.save(sched, out / SCHEDULER)
    (out / TRAINER_STATE).write_text(json.dumps(trainer_state(step, state), indent=2) + "\n")
    (out / LATEST).write_text(folder.name)
    return out


def _check_unpacked(shape) -> None:
    """The optimizer states below are cut per HF parameter by the weights' route; a family whose
    HF parameters pack several of the table's tensors (converters.packed: GPT-OSS's experts)
    has no route to them yet: refused before anything is written."""
    from toolkit.errors import UnsupportedModelError
    from toolkit.models.family import family_of

    if family_of(shape.architecture).packed is not None:
        raise UnsupportedModelError(f"{shape.architecture}: its HF checkpoint packs the experts' tensors (one 3-D "
                                    "tensor per layer), for which the HF Trainer's optimizer states are not written; "
                                    "export the weights with --export-hf or `toolkit convert megatron-to-hf`")


def _weights(ck: RunCheckpoint, out: Path, progress) -> None:
    """converters.megatron_to_hf of the checkpoint's weights, moved into `out` itself."""
    from converters import megatron_to_hf

    tmp = out / ".weights"
    done = [0]

    def bytes_done(n: int, _total: int) -> None:
        if progress:
            progress(n - done[0])
        done[0] = n

    megatron_to_hf(ck.model, tmp, hf_config=ck.model / SIDE, progress=bytes_done)
    for f in tmp.iterdir():
        f.rename(out / f.name)
    tmp.rmdir()


def _optimizer_states(ck: RunCheckpoint, shape, zero: Path, step: int, progress) -> None:
    """zero/<HF name>/{fp32,exp_avg,exp_avg_sq}.pt: one optimizer state ("param": the fp32
    master, "exp_avg", "exp_avg_sq") of every HF parameter (tied aliases left out: the
    Trainer's model names a tied tensor once), cut from the global tensors by the weights'
    route (ModelMap.global_to_hf) and written by toolkit.runstate.torch_files. The masters are
    weights: where megatron's value is HF's plus a constant (Qwen3-Next's delta-net norms,
    converters.shifted) they are shifted as the weight export shifts them; the moments are the
    gradient's, the same on both sides."""
    import contextlib

    from converters.shifted import megatron_shift_patterns, shifted

    from . import torch_files
    from .universal import model_map

    mm = model_map(shape)
    with contextlib.ExitStack() as opened:
        sources = torch_files.optimizer_sources(opened, ck.optimizer, KEYS, mm)
        writer = opened.enter_context(torch_files.Writer())  # finishes its files before the sources close
        for key, source in sources.items():
            if key == "param":
                source = shifted(source, {}, megatron_shift_patterns(mm))
            for name, outer in mm.global_to_hf.items():
                if name in mm.aliases:
                    continue
                spec = torch_files.fp32(mm.hf_shapes[name])
                (zero / name).mkdir(parents=True, exist_ok=True)
                writer.save(zero / name / f"{FILES[key]}.pt", {"param": spec}, spec,
                            torch_files.hf_copies(source, outer), source, progress)
    for d in zero.iterdir():
        torch.save(torch.tensor(float(step)), d / "step.pt")


def hf_param_groups(groups: list[dict]) -> list[dict]:
    """The Trainer's two groups (transformers' Trainer.create_optimizer: with weight decay,
    then without) with the runtime's hyper-parameters and learning rate of the next step."""
    first = groups[0]
    plain = {k: (list(first[k]) if k == "betas" else first[k]) for k in HPARAMS if k in first}
    decay = max(float(g.get("weight_decay", 0.0)) for g in groups)
    return [{**plain, "weight_decay": decay}, {**plain, "weight_decay": 0.0}]


def _optimizer_state(groups: list[dict], step: int) -> dict:
    """zero/optimizer_state.pt: ZeRO-1/2 read "param_groups" group by group; ZeRO-3 reads
    "optimizer_state_dict": the step of state 0, and group 0's hyper-parameters, which it copies
    into EVERY group (DeepSpeed 0.19.8, stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3).
    Its group 0 therefore has no weight_decay: each group keeps the Trainer's own (decay, 0)."""
    shared = [{k: v for k, v in g.items() if k != "weight_decay"} for g in groups[:1]]
    return {"param_groups": groups, "ds_version": ds_version(),
            "optimizer_state_dict": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": shared}}


def scheduler_state(runtime_sched: dict, groups: list[dict], step: int) -> dict:
    """torch.optim.lr_scheduler.LambdaLR's state after `step` steps (what the Trainer's schedule
    saves): base_lrs the peak learning rate, _last_lr the next step's."""
    lr = [float(g["lr"]) for g in groups]
    base = float(runtime_sched.get("max_lr", max(lr)))
    return {"base_lrs": [base] * len(groups), "last_epoch": step, "_step_count": step + 1,
            "_get_lr_called_within_step": False, "_last_lr": lr, "lr_lambdas": [None] * len(groups)}


def trainer_state(step: int, state: dict) -> dict:
    """transformers' TrainerState fields that say where training stands (the rest default).
    train_batch_size must be there (transformers' compare_trainer_and_checkpoint_args divides
    it); the runtime's samples per data-parallel rank and step stand for it, and the Trainer
    only warns when its per-device batch differs."""
    dp = max(1, state.get("layout", {}).get("dp", 1))
    per_rank = max(1, state.get("global_batch", dp) // dp)
    return {"global_step": step, "epoch": 0.0, "log_history": [], "train_batch_size": per_rank}

