"""Training checkpoints: DeepSpeed's engine state plus megatron-core's model shards.

A checkpoint is ``ROOT/global_step<N>/`` holding
  - what ``engine.save_checkpoint`` writes: optimizer partitions (ZeRO shards per data-
    parallel rank), fp32 masters, the learning-rate schedule, the engine's counters and
    one module file per model-parallel rank;
  - ``model/``: the weights with megatron-core's ``dist_checkpointing`` (torch_dist: global
    tensors, any tp/pp/ep layout can read them; the format ``converters.megatron_to_hf``
    reads). DeepSpeed writes module files from data-parallel rank 0 only, which misses the
    experts of the other expert-parallel ranks, so on resume the weights come from here;
  - ``rng/rank<R>.pt`` (torch RNG states) and ``train_state.json`` (step, samples seen);
  - whatever the caller adds (the trainer: ``model/hf/``, see toolkit.runtime.export).
``ROOT/latest`` names the newest complete checkpoint; it is written last, so a crash
while saving leaves the previous one in charge.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import InputFileError

LATEST = "latest"
STATE = "train_state.json"


@dataclass(frozen=True)
class TrainState:
    step: int
    consumed_samples: int


def tag(step: int) -> str:
    return f"global_step{step}"


def sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def gathered(engine, chunks):
    """ZeRO-3 keeps each weight partitioned; gather the full weights for dist_checkpointing.
    `engine` may be None (chunks outside DeepSpeed)."""
    import contextlib

    import deepspeed

    if engine is None or engine.zero_optimization_stage() < 3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters([p for c in chunks for p in c.parameters()])


def save_model(engine, chunks: list[torch.nn.Module], out: Path) -> None:
    """The weights alone, as megatron-core torch_dist (collective: every rank calls it)."""
    from megatron.core import dist_checkpointing

    out.mkdir(parents=True, exist_ok=True)
    with gathered(engine, chunks):
        dist_checkpointing.save(sharded_state_dict(chunks), str(out))


def load_model(engine, chunks: list[torch.nn.Module], src: Path) -> None:
    from megatron.core import dist_checkpointing

    with gathered(engine, chunks):
        sharded = sharded_state_dict(chunks)
        state = dist_checkpointing.load(sharded, str(src))
        state = {k: state[k] for k in sharded}  # Megatron-LM's common part (args, iteration) is not the model's
        if len(chunks) == 1:
            chunks[0].load_state_dict(state)
        else:
            for i, c in enumerate(chunks):
                c.load_state_dict(state[f"model{i}"])


def save(engine, chunks: list[torch.nn.Module], root: Path, state: TrainState,
         extra: Callable[[Path], None] | None = None) -> Path:
    """Collective; returns the checkpoint folder. `extra(folder)` adds files on rank 0
    before `latest` names the checkpoint."""
    folder = root / tag(state.step)
    engine.save_checkpoint(str(root), tag=tag(state.step), save_latest=False)
    save_model(engine, chunks, folder / "model")
    rank = dist.get_rank()
    (folder / "rng").mkdir(exist_ok=True)
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()}
    torch.save(rng, folder / "rng" / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        if extra is not None:
            extra(folder)
        (folder / STATE).write_text(json.dumps(asdict(state)) + "\n")
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(tag(state.step))
        os.replace(tmp, root / LATEST)
    dist.barrier()
    return folder


def resolve(path: str | Path) -> Path:
    """A checkpoint folder from: the folder itself, a ROOT with `latest`, or a run folder
    whose checkpoints/ has one."""
    p = Path(path)
    for root in (p, p / "checkpoints"):
        if (root / LATEST).is_file():
            return root / (root / LATEST).read_text().strip()
    if (p / STATE).is_file():
        return p
    raise InputFileError(f"no checkpoint at '{path}' (expected a '{LATEST}' file or a global_step folder)")


def weights_only(path: str | Path) -> Path | None:
    """The torch_dist folder of a bare megatron model (e.g. converted from Hugging Face), or
    None: the folder itself, or a Megatron-LM checkpoint root whose
    latest_checkpointed_iteration.txt names `release` or an iteration (iter_0000123/)."""
    p = Path(path)
    marker = p / "latest_checkpointed_iteration.txt"
    if marker.is_file():
        it = marker.read_text().strip()
        p = p / (it if it == "release" else f"iter_{int(it):07d}")
        if not (p / "metadata.json").is_file():
            raise InputFileError(f"'{p}' is not a torch_dist checkpoint (a legacy one? convert it with "
                                 "`toolkit convert ... --format torch_dist`)")
    return p if (p / "metadata.json").is_file() and not (p / STATE).is_file() else None


def load(engine, chunks: list[torch.nn.Module], folder: Path) -> TrainState:
    """Resume: engine state, weights, RNG; returns where training stopped."""
    engine.load_checkpoint(str(folder.parent), tag=folder.name)
    if engine.zero_optimization_stage() < 3:
        load_model(engine, chunks, folder / "model")
    rng = torch.load(folder / "rng" / f"rank{dist.get_rank()}.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    return TrainState(**json.loads((folder / STATE).read_text()))
