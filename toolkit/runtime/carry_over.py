"""What a run can take over from a checkpoint, decided before anything is read, as one line.

A checkpoint's tensors are global (megatron-core's sharded keys), so any layout of the same
model reads them; what cannot carry over is another model (a key this model needs is absent,
or its global shape differs: vocabulary padding excepted, which megatron marks
``allow_shape_mismatch``), another optimizer's state (no Adam moments under Megatron-LM's
``optimizer.state.exp_avg`` / ``exp_avg_sq`` keys), and another data order (the dataset is
shuffled by ``train.seed`` into samples of ``batch.seq_len`` + 1 tokens: a different seed or
length would silently train on other samples than the ones the checkpoint counted).
Every rank checks its own parameters; the first problem found on any rank is raised on all.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputFileError

ADAM = ("exp_avg", "exp_avg_sq")
OPTIMIZER_PREFIX = "optimizer.state."


class CheckpointMismatchError(InputFileError):
    """The checkpoint holds another model, or state this run cannot take over."""


@dataclass(frozen=True)
class Wanted:
    key: str
    shape: tuple[int, ...]
    name: str  # the parameter it is for (this rank's chunk index and name)
    flexible: bool  # megatron's allow_shape_mismatch (vocabulary padding)


def wanted(name: str, meta, prefix: str | None = None) -> list[Wanted]:
    """The global tensors megatron's metadata `meta` (ShardedTensor or SwiGLU factory, data on
    any device) asks for; `prefix`: an optimizer state ("optimizer.state.exp_avg")."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    built = list(nested_values(meta.build())) if isinstance(meta, ShardedTensorFactory) else [meta]
    return [Wanted(f"{prefix}.{sh.key}" if prefix else sh.key, tuple(sh.global_shape), name, sh.allow_shape_mismatch)
            for sh in built]


def tensor_problem(src: Path, stored: dict, want: list[Wanted]) -> str | None:
    """The first wanted tensor that `stored` ({key: TensorInfo}) lacks or holds in another shape."""
    for w in want:
        got = stored.get(w.key)
        if got is None:
            return (f"'{src}' holds another model: it has no tensor '{w.key}' (this model's {w.name}; "
                    f"it holds {len(stored)} tensors)")
        if got.shape != w.shape and not (w.flexible and got.shape[1:] == w.shape[1:]):
            return (f"'{src}' holds another model: '{w.key}' is {list(got.shape)} there and "
                    f"{list(w.shape)} in this model")
    return None


def optimizer_problem(src: Path, stored: dict) -> str | None:
    """None when the folder holds Adam moments; else which optimizer state it holds instead."""
    kinds = sorted({k[len(OPTIMIZER_PREFIX):].split(".")[0] for k in stored if k.startswith(OPTIMIZER_PREFIX)})
    if all(k in kinds for k in ADAM):
        return None
    held = f"it holds {', '.join(kinds)}" if kinds else "it holds no optimizer state"
    return (f"'{src}' has no Adam moments (optimizer.state.exp_avg / exp_avg_sq; {held}): another optimizer's "
            f"state cannot carry over to this run's AdamW; start from its weights alone with --load "
            f"{src.parent / 'model'}")


def data_problem(saved: dict, seed: int, seq_len: int, packing: bool = False) -> str | None:
    """A checkpoint that recorded its data order (train.seed, batch.seq_len, data.packing)
    resumed with another: a sample is seq_len + 1 tokens of the epoch shuffled by the seed (with
    packing, the conversations packed into it), so any change makes the samples consumed another
    set (the global batch may change: the run reads on from the samples consumed)."""
    if saved.get("seed") is not None and saved["seed"] != seed:
        return (f"the checkpoint's data order was shuffled with train.seed={saved['seed']} and this spec has "
                f"train.seed={seed}: set train.seed={saved['seed']} to continue the same sample order")
    if saved.get("seq_len") is not None and saved["seq_len"] != seq_len:
        return (f"the checkpoint's samples are batch.seq_len={saved['seq_len']} tokens and this spec's "
                f"batch.seq_len={seq_len}: its {saved['consumed_samples']} samples consumed are not a position in "
                f"this run's samples; set batch.seq_len={saved['seq_len']} to continue, or start from its weights "
                f"alone (--load its model/ folder)")
    if saved.get("packing") is not None and saved["packing"] != packing:
        was, now = str(saved["packing"]).lower(), str(packing).lower()
        return (f"the checkpoint's samples were {'packed' if saved['packing'] else 'one conversation each'} "
                f"(data.packing={was}) and this spec has data.packing={now}: "
                f"its {saved['consumed_samples']} samples consumed are not a position in this run's samples; set "
                f"data.packing={was} to continue, or start from its weights alone (--load "
                "its model/ folder)")
    return None


def raise_first(problem: str | None) -> None:
    """Collective: raise the first problem of any rank (in rank order) on every rank."""
    import torch.distributed as dist

    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    first = next((p for p in found if p is not None), None)
    if first is not None:
        raise CheckpointMismatchError(first)


def check_model(src: Path, entries, buffers=()) -> None:
    """Collective: every weight these catalog entries need, and every persistent buffer
    (the router's expert bias), is in `src` with its global shape."""
    from converters.formats import dcp

    want = [w for e in entries for w in wanted(e.name, e.meta)] + [w for b in buffers for w in wanted(b.name, b.meta)]
    raise_first(tensor_problem(src, dcp.tensors(src), want))


def check_optimizer(src: Path, entries, states: tuple[str, ...]) -> None:
    """Collective: `src` holds Adam state, and every state of every entry with its global shape."""
    from converters.formats import dcp

    stored = dcp.tensors(src)
    problem = optimizer_problem(src, stored) or tensor_problem(
        src, stored, [w for k in states for e in entries for w in wanted(e.name, e.meta, f"optimizer.state.{k}")])
    raise_first(problem)
