"""Training checkpoints that do not depend on the layout that wrote them.

``ROOT/global_step<N>/`` holds, all in megatron-core ``dist_checkpointing`` (torch_dist):
  - ``model/``: the weights in the module's dtype under megatron's keys (global tensors; any
    tp/pp/vpp/ep/etp layout reads them, and so do the converters and Megatron-LM), plus the
    ``hf/`` side folder (config.json, tokenizer) that the caller adds;
  - ``optimizer/``: per trained parameter (a LoRA run's: the adapters) the fp32 master weight and
    Adam's moments as global
    tensors under Megatron-LM's distributed-optimizer keys
    ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` (its ``fully_reshardable`` layout),
    and in common.pt what Megatron-LM keeps beside them: ``{"optimizer": {"optimizer":
    {"param_groups": [...]}, "param_state_sharding_type": "fully_reshardable"}}``, each group
    with its hyperparameters, Megatron-LM's group keys and the optimizer's step;
  - ``train_state.json``: step, samples consumed, steps skipped (train.on_nan), the data order (seed, global batch,
    sequence length), the learning-rate scheduler's state (megatron-core's
    OptimizerParamScheduler) and the layout it was saved at; ``rng/rank<R>.pt``: RNG states
    and megatron's RNG tracker's streams (used at the same layout).
Each checkpoint is written in a temporary sibling folder and renamed into place when complete
(an existing one is replaced only when the run was given --overwrite: trainer.check_out
refuses before training), then ``ROOT/latest`` names it; ``train_state.json``, written last
inside it, lists every other file with its size and CRC-32 (the ranks checksum a share each:
toolkit.runtime.integrity, which also checks them on load). A kill at any moment leaves the
previous checkpoints as they were and no folder --load takes for complete (checkpoint_folder);
``train.keep_checkpoints: N`` removes older ones only after a newer one is complete.
With ``train.async_save`` the torch_dist files are written by megatron's forked writers while
training goes on, and all of that after them happens in the save's finalization, once every
rank's writer is done (toolkit.runtime.async_save).

Saving streams (toolkit.runtime.state): each parameter part is written by one owner rank of
its data-parallel group, fetched whole through DeepSpeed's accessors one parameter at a time.
Loading first checks what can carry over (toolkit.runtime.carry_over: same model, Adam state,
same data order; one line naming what differs), reads the weights into the modules before
DeepSpeed builds its fp32 masters (so a run that starts from converted weights trains them),
then, for a training checkpoint, sets each parameter's master and moments through DeepSpeed's
accessors, one state of one parameter at a time. Tensors are read by byte range straight
into their destination (converters.formats.dcp.Reader: what megatron-core's ``dist_checkpointing.load``
would read for the same sharding metadata, without its decoding copies and collectives).
Vocabulary padding rows that exist only in the new layout start at zero (megatron-core's
``allow_shape_mismatch`` for embeddings).
"""
from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from converters.formats import dcp

from ..atomic import atomic_output_dir, publish
from ..mcore.distributed import all_max, rng_states, set_rng_states
from . import carry_over, integrity, optim_state, resume
from .carry_over import CheckpointMismatchError
from .checkpoint_folder import (CRC, FILES, GUIDE, GUIDE_TEXT, LATEST, MODEL, OPTIMIZER, STATE, manifest, prune,  # noqa: F401
                                resolve, tag, weights_only)
from .state import Catalog, Entry, with_data

BATCH_BYTES = 1 << 28  # fp32 bytes of parameters per ZeRO-3 gather while loading weights


@dataclass(frozen=True)
class TrainState:
    step: int
    consumed_samples: int
    skipped_steps: int = 0  # steps whose update was dropped (train.on_nan=skip), over the whole run


# ---------------------------------------------------------------------------- whole tensors
@contextlib.contextmanager
def whole(params: list[torch.nn.Parameter], modify: bool = False) -> Iterator[None]:
    """ZeRO-3 keeps each weight partitioned: gather these (collective over their group);
    ``modify``: rank 0's values are partitioned again on exit. Other stages: nothing."""
    if not zero3_partitioned(params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
        yield


def zero3_partitioned(params: list[torch.nn.Parameter]) -> bool:
    """Whether ZeRO-3 keeps any of these weights partitioned (``whole`` gathers them)."""
    return any(hasattr(p, "ds_id") for p in params)


def _batches(ents: list[Entry], budget: int = BATCH_BYTES) -> list[list[Entry]]:
    """Entries in batches of about `budget` bytes; every rank gets the same number of batches
    (ZeRO-3's gathers are collective), empty ones at the end."""
    out: list[list[Entry]] = [[]]
    size = 0
    for e in ents:
        if out[-1] and size + 4 * e.numel > budget:
            out.append([])
            size = 0
        out[-1].append(e)
        size += 4 * e.numel
    return out + [[] for _ in range(all_max(len(out)) - len(out))]


# ---------------------------------------------------------------------------- save
def save(engine, plan, cat: Catalog, root: Path, state: TrainState,
         extra: Callable[[Path], None] | None = None, replace: bool = False, saves=None) -> Path:
    """Collective; returns the checkpoint folder. `extra(folder)` adds files on rank 0
    before the checkpoint is complete. `replace`: an existing ROOT/global_step<N> is replaced
    by the new one once that is complete (else that is an error). `saves` (train.async_save:
    toolkit.runtime.async_save's queue, megatron-core's AsyncCallsQueue): the torch_dist files
    are written in the background and the checkpoint completes (``_complete``: checksums,
    train_state.json, the rename, ``latest``, pruning) in the queue's finalization, once every
    rank's files are written; without it, before this returns."""
    final = root / tag(state.step)
    optim_state.link(engine)
    staged = contextlib.ExitStack()  # the temporary folder: renamed into place by _complete, removed on an error
    folder = staged.enter_context(_staged(final, replace))
    with _removed_on_error(staged):
        parts = [_save_part(folder / MODEL, {**cat.objects, **_buffers(cat)}, cat.entries,
                            lambda e: {"": _whole_weight(e)}, background=saves is not None),
                 _save_part(folder / OPTIMIZER, {"optimizer": optim_state.megatron_common(engine)}, cat.trainable,
                            lambda e: optim_state.get_full(engine, e.param), background=saves is not None)]
        (folder / "rng").mkdir(exist_ok=True)
        torch.save(rng_states(), folder / "rng" / f"rank{dist.get_rank()}.pt")
        saved = {**asdict(state), "seed": plan.spec.train.seed, "global_batch": plan.batch.global_,
                 "seq_len": plan.batch.seq_len, "lr_scheduler": engine.lr_scheduler.state_dict(),
                 "layout": plan.layout.as_dict(), "zero_stage": plan.spec.zero.stage,
                 "packing": plan.spec.data.packing}  # as of now: training goes on during a background save
        if dist.get_rank() == 0:
            if extra is not None:
                extra(folder)
            (folder / GUIDE).write_text(GUIDE_TEXT)
    complete = functools.partial(_complete, staged, folder, saved, plan.spec.train.keep_checkpoints)
    if saves is None:
        complete()
    else:
        from . import async_save

        async_save.schedule(saves, parts, complete)
    return final


def _complete(staged: contextlib.ExitStack, folder: Path, saved: dict, keep: int | None) -> None:
    """Collective, once every rank's files of the checkpoint are written: each rank checksums a
    share of them, rank 0 writes train_state.json (last), renames the temporary folder into place
    (atomic_output_dir fsyncs it all first), then `latest` names it and older ones are pruned."""
    with staged:  # an error in here removes the temporary folder
        dist.barrier()
        names: list[dict | None] = [None]
        if dist.get_rank() == 0:
            names[0] = manifest(folder)
        dist.broadcast_object_list(names, src=0)
        crcs = integrity.crc_all(folder, list(names[0]))
        if dist.get_rank() == 0:
            (folder / STATE).write_text(json.dumps({**saved, FILES: names[0], CRC: crcs}) + "\n")
    root = folder.parent
    if dist.get_rank() == 0:  # the folder is complete and on the disk
        (root / f".{LATEST}.tmp").write_text(tag(saved["step"]))
        publish(root / f".{LATEST}.tmp", root / LATEST)  # `latest` names only a checkpoint on the disk
        if keep is not None:
            prune(root, keep, saved["step"])
    dist.barrier()


@contextlib.contextmanager
def _removed_on_error(staged: contextlib.ExitStack) -> Iterator[None]:
    """An error inside leaves `staged` (the temporary folder's context) through it: removed."""
    try:
        yield
    except BaseException as e:
        if not staged.__exit__(type(e), e, e.__traceback__):
            raise


@contextlib.contextmanager
def _staged(final: Path, replace: bool) -> Iterator[Path]:
    """Collective: every rank writes into one temporary sibling of `final` that rank 0 made
    (toolkit.atomic: locked while written; what a killed save leaves is removed by the next save
    of the same step); on rank 0's way out, once every file is on the disk, it becomes `final`."""
    name = [None]
    if dist.get_rank() != 0:
        dist.broadcast_object_list(name, src=0)
        yield Path(name[0])
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output_dir(final, overwrite=replace) as tmp:
        name[0] = str(tmp)
        dist.broadcast_object_list(name, src=0)
        yield tmp


def _whole_weight(e: Entry) -> torch.Tensor:
    """The parameter's (tensor-parallel) weight; under ZeRO-3 gathered (collective) and copied."""
    with whole([e.param]):
        return e.param.detach().to("cpu", copy=hasattr(e.param, "ds_id"))


def _buffers(cat: Catalog) -> dict:
    """The persistent buffers' sharded tensors (megatron's replica ids: one rank writes each)."""
    return {f"buffer/{b.name}": with_data(b.meta, b.tensor.detach().cpu().clone()) for b in cat.buffers}


def _save_part(out: Path, common: dict, entries: list[Entry], fetch: Callable[[Entry], dict],
               background: bool = False):
    """One dist_checkpointing.save of every entry's tensors from ``fetch(entry)`` ({"": weight}
    or {optimizer key: state}); fetching is collective, only the owner keeps what it fetched.
    The weights and the optimizer state are saved one after the other, so a rank holds at
    most its share of the larger of the two. `background`: megatron's ``async_sharded_save``,
    which writes common.pt now and returns the AsyncRequest that writes the rest (then a rank
    holds its share of both until the save completes, as in Megatron-LM)."""
    from megatron.core import dist_checkpointing

    sd = dict(common)
    for e in entries:
        values = fetch(e)
        if not e.writes:
            continue
        for k, v in values.items():
            prefix = f"optimizer.state.{k}" if k else None
            sd[f"{k}/{e.name}"] = with_data(e.meta, v.detach().float().cpu() if k else v, prefix, writer=True)
    out.mkdir(parents=True, exist_ok=True)
    return dist_checkpointing.save(sd, str(out), async_sharded_save=background)


# ---------------------------------------------------------------------------- load
def load_weights(plan, cat: Catalog, src: Path) -> None:
    """The weights of a torch_dist folder into this rank's chunks, at any layout (collective
    under ZeRO-3, which gathers each batch of weights). Before deepspeed.initialize: DeepSpeed
    then builds its fp32 masters from them. Unless ZeRO-3 partitions the weights (they are
    read one gathered batch at a time), the disk reads them all ahead of the copies
    (dcp.Reader.readahead)."""
    check_same_model(plan, src)
    entries = loaded_entries(cat, src)
    carry_over.check_model(src, entries, cat.buffers)
    with dcp.Reader(src) as reader:
        if not zero3_partitioned([e.param for e in entries]):
            reader.readahead([(with_data(e.meta, e.param.data), None) for e in entries])
        for batch in _batches(entries):
            with whole([e.param for e in batch], modify=True), torch.no_grad():
                for e in batch:
                    reader.fill(with_data(e.meta, e.param.data))
        with torch.no_grad():
            for b in cat.buffers:
                reader.fill(with_data(b.meta, b.tensor.detach()))


def loaded_entries(cat: Catalog, src: Path) -> list[Entry]:
    """The entries ``load_weights`` reads from `src`: all of them, except LoRA's adapters when
    `src` holds none (a base model, e.g. converted from Hugging Face: the adapters keep their
    initial values, B = 0, and training starts from the base)."""
    from converters.formats import dcp

    from .lora import is_adapter

    adapters = [e for e in cat.entries if is_adapter(e.name)]
    if adapters and not any(is_adapter(f".{key}") for key in dcp.tensors(src)):
        return [e for e in cat.entries if not is_adapter(e.name)]
    return cat.entries


def load_optimizer(engine, cat: Catalog, src: Path) -> None:
    """Masters, moments and step of a training checkpoint into DeepSpeed's optimizer (after
    deepspeed.initialize). One state of one parameter at a time, read by byte range
    (converters.formats.dcp.Reader) into one buffer of the (tensor-parallel) part's shape, the size of
    the largest part, and handed whole to DeepSpeed's accessor, which keeps this rank's
    partition of it. Only the rows holding that partition are read from disk (every ZeRO
    stage and the bf16 optimizer partition the flattened part: a run of rows; see
    optim_state.fragment); the accessor reads nothing else of the buffer, so the other rows
    are left as they are, and a parameter with nothing on this rank is not read at all.
    The disk starts reading those rows (dcp.Reader.readahead) before the optimizer state is
    created (optim_state.prime, which touches all of its memory), so the two overlap."""
    from megatron.core import dist_checkpointing

    carry_over.check_optimizer(src, cat.trainable, optim_state.KEYS)
    room = torch.empty(max((e.meta.data.numel() for e in cat.trainable), default=0), dtype=torch.float32)
    reads = []  # (parameter, state key, the view of room it is read into, (its request, the rows to read))
    for e in cat.trainable:
        shape = e.meta.data.shape
        rows = _fragment_rows(optim_state.fragment(e.param), shape)
        if rows is not None and rows[0] == rows[1]:
            continue
        value = room[:shape.numel()].view(shape)
        for k in optim_state.KEYS:
            reads.append((e.param, k, value, (with_data(e.meta, value, f"optimizer.state.{k}"), rows)))
    with dcp.Reader(src) as reader:
        reader.readahead([request for *_, request in reads])
        optim_state.prime(engine)
        for param, k, value, (sh, rows) in reads:
            reader.fill(sh, rows)
            optim_state.set_full(engine, param, {k: value})
    del room, reads
    with _common_types():
        common = dist_checkpointing.load_common_state_dict(str(src))
    optim_state.set_step(engine, optim_state.saved_step(common["optimizer"]))


def _fragment_rows(frag: tuple[int, int] | None, shape: torch.Size) -> tuple[int, int] | None:
    """The rows [start, stop) of a tensor of ``shape`` (first dimension) that hold its flat
    elements [frag start, frag start + numel), partial rows at either end included; None:
    all of it."""
    if frag is None or len(shape) == 0:
        return None
    start, numel = frag
    if numel == 0:
        return (0, 0)
    per_row = shape[1:].numel()
    if per_row == 0 or start < 0 or start + numel > shape.numel():
        return None  # not a range of this shape: read it all, DeepSpeed's accessor decides
    return (start // per_row, -(-(start + numel) // per_row))


def _common_types():
    """megatron's common.pt is read with torch.load(weights_only=True); Megatron-LM and the
    converters store their arguments there as an argparse.Namespace, a plain container."""
    import argparse

    return torch.serialization.safe_globals([argparse.Namespace])


def check_same_model(plan, src: Path) -> None:
    """One line naming what differs when the checkpoint's side config is another model."""
    from ..models import read_hf_config, shape_from_hf

    side = src / "hf" / "config.json"
    if not side.is_file():
        return
    saved, mine = _identity(shape_from_hf(read_hf_config(side))), _identity(plan.shape)
    diff = [f"{k} {saved[k]} vs {mine[k]}" for k in saved if saved[k] != mine[k]]
    if diff:
        raise CheckpointMismatchError(f"'{src}' holds another model than the spec's ({'; '.join(diff)}, "
                                      "checkpoint vs spec)")


def _identity(shape) -> dict:
    """What makes two models the same model for a checkpoint's weights."""
    return {"architecture": shape.architecture, "hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
            "num_attention_heads": shape.num_attention_heads, "num_query_groups": shape.num_query_groups,
            "ffn_hidden_size": shape.ffn_hidden_size, "vocab_size": shape.vocab_size,
            "num_experts": shape.moe.num_experts if shape.moe else None, "tie_embeddings": shape.tie_embeddings}


def load(engine, plan, cat: Catalog, folder: Path) -> TrainState:
    """Resume a training checkpoint (weights already loaded by ``load_weights``): optimizer
    state and step, RNG when the layout is the same; returns where training stopped (the
    learning-rate schedule: resume.apply_schedule)."""
    saved = json.loads((folder / STATE).read_text())
    load_optimizer(engine, cat, folder / OPTIMIZER)
    rng_file = folder / "rng" / f"rank{dist.get_rank()}.pt"
    if saved.get("layout") == plan.layout.as_dict() and rng_file.is_file():
        set_rng_states(torch.load(rng_file, weights_only=True))
    return TrainState(saved["step"], saved["consumed_samples"], saved.get("skipped_steps", 0))


def check_resume(plan, saved: dict, scheduler: str | None) -> None:
    """Before anything is built: the checkpoint's data order is this spec's (seed, sample
    length), and its learning-rate schedule is this run's unless `scheduler` (resume.OVERRIDE /
    resume.CHECKPOINT) says which one to use. Every rank reads the same train_state.json and
    plan, so every rank raises the same error without a collective."""
    problem = carry_over.data_problem(saved, plan.spec.train.seed, plan.batch.seq_len,
                                      plan.spec.data.packing)
    if problem is not None:
        raise CheckpointMismatchError(problem)
    schedule = resume.schedule_problem(plan, saved, scheduler)
    if schedule is not None:
        raise resume.SchedulerMismatchError(schedule)
