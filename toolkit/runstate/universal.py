"""DeepSpeed's universal checkpoint <-> the runtime's training checkpoint.

A universal checkpoint (``deepspeed.checkpoint.ds_to_universal``'s layout, read by an engine
configured with ``"checkpoint": {"load_universal": true}``) is ``ROOT/latest_universal``
naming ``ROOT/<tag>/`` with ``zero/<parameter name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` (each a
dict ``{"param": whole tensor, ...}`` except the step), ``zero/optimizer_state.pt`` (param groups,
DeepSpeed's version) and ``mp_rank_00_model_states.pt`` (counters, scheduler state).

Names. DeepSpeed keys a parameter by its name in the engine's module. megatron-core names are
local: every pipeline stage calls its first layer ``decoder.layers.0`` and every
expert-parallel rank its first expert ``local_experts.0``, so the runtime's universal names are
those of the one-rank model (megatron-core's GPTModel at tp = pp = ep = 1, local layer spec):
stage s's local layer i is global layer ``offset(s) + i`` (megatron's
``get_transformer_layer_offset``, uneven first/last stages included) and expert-parallel rank
r's local expert j is global expert ``r * experts_per_rank + j``. The checkpoint's own keys need
no such mapping: megatron's sharded keys are already global (``decoder.layers.<key>`` with a
layer axis, experts with an expert axis); ``converters.formats.torch_dist.dist_key`` relates
the two. Norms also answer to their TransformerEngine names (``...linear_qkv.layer_norm_weight``).

Each tensor is whole (vocabulary padding stripped and marked ``vocab_tensor``) with the
metadata DeepSpeed's loader slices tensor-parallel engines by: ``cat_dim`` 1 for row-parallel
weights, 0 otherwise, and two sub-parameters (gate, up) for a gated ``linear_fc1``.
"""
from __future__ import annotations

import contextlib
import pickle
import shutil
from pathlib import Path

import torch

from converters.files import FileTensors

from ..errors import InputFileError
from ..runtime.optim_state import KEYS, saved_step
from .runtime_ckpt import RunCheckpoint, finish_run, write_torch_dist_files

LATEST = "latest_universal"
FILES = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
MODEL_STATES = "mp_rank_00_model_states.pt"
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def model_map(shape):
    """The one-rank model's global tensors (names, shapes with the vocabulary padded for tp = 1,
    how tp splits each)."""
    from converters.mapping import ModelMap
    from converters.megatron_args import VOCAB_DIVISOR
    from toolkit.backends.megatron import padded_vocab

    return ModelMap(shape, padded_vocab(shape.vocab_size, 1, VOCAB_DIVISOR))


def entry(name: str, split: str, t) -> dict:
    """What DeepSpeed's universal loader reads for one state of one parameter; `split`: how
    tensor parallelism divides it (toolkit.models.weights: replicated, column, row, gated); `t`: the
    tensor, or the converters' TensorSpec standing for it, with the vocabulary padding rows
    of an embedding or output layer already left out."""
    from ..errors import UnsupportedModelError
    from ..models.weights import GATED, PARTS, ROW

    if split == PARTS:  # uneven parts: DeepSpeed's universal checkpoint splits a tensor in equal sub-params
        raise UnsupportedModelError(f"'{name}' is split over tp by uneven parts (a gated delta net's); DeepSpeed's "
                                    "universal checkpoint cannot describe it")

    d = {"param": t, "cat_dim": 1 if split == ROW else 0}
    if name in VOCAB:
        d["vocab_tensor"] = True
    if split == GATED:
        d["param_n_sub_params"] = 2
    return d


# ---------------------------------------------------------------------------- runtime -> universal
def runtime_to_universal(ck: RunCheckpoint, out_root: Path, progress=None) -> Path:
    """Each state file is written by toolkit.runstate.torch_files (torch.save's zip, the
    tensor streamed from the checkpoint's files by the kernel where its rows move unchanged)."""
    from toolkit.models import shape_from_hf

    from . import torch_files

    shape, state, opt = shape_from_hf(ck.hf_config()), ck.state, ck.optimizer_common()
    step = saved_step(opt)
    folder = out_root / f"global_step{step}"
    mm = model_map(shape)
    with contextlib.ExitStack() as opened:
        sources = torch_files.optimizer_sources(opened, ck.optimizer, KEYS, mm)
        writer = opened.enter_context(torch_files.Writer())  # finishes its files before the sources close
        for gt in mm.tensors:
            name = gt.entry.name
            d = folder / "zero" / name
            d.mkdir(parents=True)
            stored, _ = sources[KEYS[0]].global_meta(name)
            # the vocabulary padding rows are left out (DeepSpeed pads for the engine it loads into)
            kept = (min(stored[0], shape.vocab_size), *stored[1:]) if name in VOCAB else stored
            spec = torch_files.fp32(kept)
            for k in KEYS:
                writer.save(d / f"{FILES[k]}.pt", entry(name, gt.entry.mapping.split, spec), spec,
                            torch_files.global_copies(sources[k], name, kept), sources[k], progress)
            torch.save(torch.tensor(float(step)), d / "step.pt")
    torch.save({"param_groups": opt["optimizer"]["param_groups"], "ds_version": ds_version()},
               folder / "zero" / "optimizer_state.pt")
    torch.save(model_states(state, step), folder / MODEL_STATES)
    shutil.copytree(ck.model / "hf", folder / "hf")
    (out_root / LATEST).write_text(folder.name)
    return folder


def ds_version() -> str:
    """The installed DeepSpeed's version, as its files record it (without importing it: seconds)."""
    from importlib.metadata import version

    return version("deepspeed")


def model_states(state: dict, step: int) -> dict:
    lay = state.get("layout", {})
    return {"module": None, "dp_world_size": lay.get("dp", 1), "mp_world_size": 1, "global_steps": step,
            "global_samples": state["consumed_samples"], "skipped_steps": 0,
            "lr_scheduler": scheduler_state(state.get("lr_scheduler"), step), "ds_version": ds_version()}


def scheduler_state(megatron: dict | None, step: int) -> dict:
    """What either kind of scheduler an engine loading the checkpoint has reads back: megatron's
    OptimizerParamScheduler state (the runtime's, a client scheduler; its load_state_dict
    ignores other keys) and DeepSpeed's own schedulers' counter (the ``scheduler`` section of
    ds_config.json; their load_state_dict reads only ``last_batch_iteration``), which starts
    at -1 and is stepped after each optimizer step: ``step - 1`` after ``step`` steps."""
    return {**(megatron or {}), "last_batch_iteration": step - 1}


# ---------------------------------------------------------------------------- universal -> runtime
def find_tag(path: str | Path) -> Path:
    p = Path(path)
    if (p / LATEST).is_file():
        p = p / (p / LATEST).read_text().strip()
    if not (p / "zero").is_dir():
        raise InputFileError(f"'{p}' is not a DeepSpeed universal checkpoint (no zero/ folder)")
    return p


def _deepspeed_types() -> list:
    """The classes DeepSpeed's own files hold beside tensors, numbers and containers: what
    ``torch.load(weights_only=True)`` may build from them (anything else is refused)."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [SubparamShape, LossScaler, DynamicLossScaler, ZeroStageEnum]


def _load(path: Path, meta: bool = False):
    """One file of the universal checkpoint, memory-mapped (``meta``: tensors on the meta
    device, only the pickle and the zip directory read). DeepSpeed's classes are allowed only
    when the pickle names one (importing DeepSpeed takes seconds; state files hold none)."""
    if not path.is_file():
        raise InputFileError(f"missing '{path}' in the universal checkpoint")
    from converters.formats.torch_pickle import with_named_globals

    try:
        return with_named_globals(lambda allowed: _torch_load(path, meta, allowed), [],
                                  {"deepspeed": _deepspeed_types})
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise InputFileError(f"'{path}' is not a readable torch file: {str(e).splitlines()[0]}") from None


def _torch_load(path: Path, meta: bool, allowed: list):
    with torch.serialization.safe_globals(allowed):
        if meta:
            return torch.load(path, map_location="meta", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _folder_of(tag: Path, name: str) -> Path:
    """The parameter's folder under its local-spec name or its TransformerEngine name."""
    from converters.formats.torch_dist import NORM_KEYS

    d = tag / "zero" / name
    for local, te in NORM_KEYS.items():
        if not d.is_dir() and name.endswith(local):
            d = tag / "zero" / (name[:-len(local)] + te)
    if not d.is_dir():
        raise InputFileError(f"the universal checkpoint '{tag}' has no parameter '{name}' (zero/{name}/): "
                             "it holds another model")
    return d


class StateFiles(FileTensors):
    """The universal checkpoint's state files as one converters source (converters.files):
    tensor ``(key, name)`` is state ``key`` ("param", "exp_avg", "exp_avg_sq") of parameter
    ``name``, read from where its bytes lie in its torch.save file (found from the pickle and
    the zip directory, nothing else read). A model has three files per parameter, so once more
    than MAX_OPEN are open the writer's queue is drained and they are closed (``queued``)."""

    MAX_OPEN = 256

    def __init__(self, tag: Path, global_shapes: dict[str, tuple[int, ...]]):
        from converters.files import TensorInfo
        from converters.formats.torch_pickle import stored

        infos = {}
        for name, gshape in global_shapes.items():
            folder = _folder_of(tag, name)
            for key in KEYS:
                path = folder / f"{FILES[key]}.pt"
                s = stored(_load(path, meta=True)["param"], str(path))
                if not _fits(name, s.shape, gshape):
                    raise InputFileError(f"'{name}' {key} is {list(s.shape)} in the universal checkpoint and "
                                         f"{list(gshape)} in the model")
                infos[(key, name)] = TensorInfo(path, s.dtype, s.shape, s.offset)
        super().__init__(infos, "universal checkpoint")

    @property
    def open_files(self) -> int:
        return len(self._fds)

    def queued(self, writer) -> None:
        if self.open_files > self.MAX_OPEN:
            writer.flush()  # the queued chunks read these descriptors
            self.close()


def _fits(name: str, stored: tuple[int, ...], gshape: tuple[int, ...]) -> bool:
    """The stored tensor is the global one, or (embedding, output layer) its first rows: the
    vocabulary without the padding, whose rows start at zero here."""
    return stored == gshape or (name in VOCAB and stored[1:] == gshape[1:] and stored[0] <= gshape[0])


def _items(shape, mm, files: StateFiles, key: str | None) -> list:
    """The torch_dist items of one state of every parameter (``key`` None: the fp32 masters
    as the model's weights), each a whole global tensor as megatron's ShardedTensor stores it."""
    from dataclasses import replace

    from converters.formats.torch_dist_write import Piece, tensor_item
    from converters.stream import Target
    from toolkit.regions import as_2d, whole

    from . import torch_files

    sizes = {"layer": shape.num_layers, "expert": shape.moe.num_experts if shape.moe else 0}
    out = []
    for name, gshape in mm.global_shapes.items():
        src = (key or "param", name)
        rows, cols = as_2d(files.meta(src)[0])
        spec = torch_files.fp32(gshape)
        piece = Piece(name, 0, 0, gshape)
        target = Target(piece, gshape, spec.dtype, (whole(src, piece, rows, cols),))
        it = tensor_item(target, mm.global_shapes, sizes, not shape.is_moe)
        out.append(replace(it, key=f"optimizer.state.{key}.{it.key}") if key else it)
    return out


def universal_to_runtime(tag: Path, out_root: Path, hf_config: dict | None, progress=None) -> Path:
    """model/ holds the fp32 masters as the weights (a bf16 run casts them as it loads, as
    DeepSpeed would), optimizer/ the masters and moments. Every tensor is streamed from its
    state file (the kernel copies the bytes file to file) into torch_dist files laid out as
    megatron's dist_checkpointing.save lays them out (converters.formats.torch_dist_write),
    so what is in memory is the files' pickles, not their tensors."""
    import json

    from converters import jobs
    from converters.formats import torch_dist_write
    from converters.stream import Meter
    from toolkit.models import shape_from_hf

    from . import torch_files

    side = tag / "hf" / "config.json"
    if hf_config is None and not side.is_file():
        raise InputFileError(f"the universal checkpoint '{tag}' does not say which model it holds: pass --hf-config")
    config = hf_config or json.loads(side.read_text())
    shape = shape_from_hf(config)
    mm = model_map(shape)
    states = _load(tag / MODEL_STATES) if (tag / MODEL_STATES).is_file() else {}
    groups = _load(tag / "zero" / "optimizer_state.pt").get("param_groups", [])
    first = next(iter(mm.global_shapes))
    step_value = _load(_folder_of(tag, first) / "step.pt")
    step = int(states.get("global_steps", float(step_value)))
    folder = out_root / f"global_step{step}"
    files = StateFiles(tag, mm.global_shapes)
    parts = {"model": _items(shape, mm, files, None), "optimizer": [i for k in KEYS for i in _items(shape, mm, files, k)]}
    todo, written = [], {}
    for part, items in parts.items():
        (folder / part).mkdir(parents=True)
        part_jobs, written[part] = torch_dist_write.file_jobs(folder / part, items, 2)
        todo += part_jobs
    meter = Meter(sum(j.nbytes for j in todo), None if progress is None else torch_files.increments(progress))
    try:
        jobs.run(todo, files, meter, meanwhile=torch_dist_write.import_dcp)
    finally:
        files.close()
    for part, named in written.items():
        torch_dist_write.write_metadata(folder / part, torch_dist_write.records(named))
    write_torch_dist_files(folder / "model", {})
    write_torch_dist_files(folder / "optimizer", {"optimizer": _groups(groups, int(float(step_value)))})
    state = {"step": step, "consumed_samples": int(states.get("global_samples", 0)), "lr_scheduler": None,
             "layout": {"tp": 1, "pp": 1, "dp": states.get("dp_world_size", 1)}}
    return finish_run(out_root, step, state, config)


def _groups(groups: list[dict], step: int) -> dict:
    from ..runtime.optim_state import SHARDING

    out = []
    for g in groups:
        plain = {k: v for k, v in g.items() if k != "params" and isinstance(v, (bool, int, float, str, tuple, list))}
        out.append({**plain, "wd_mult": 1.0 if g.get("weight_decay", 0.0) > 0 else 0.0, "lr_mult": 1.0,
                    "is_expert_parallel": bool(g.get("moe", False)), "is_decoupled_lr": False, "step": step})
    return {"optimizer": {"param_groups": out}, "param_state_sharding_type": SHARDING}
