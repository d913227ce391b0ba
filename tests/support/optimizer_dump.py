"""Not a test module: the optimizer state of a run, gathered with DeepSpeed's own accessors and
placed in global tensors by megatron-core's own sharding metadata, so that states saved at one
layout and loaded at another can be compared element by element.

``dump`` (every rank, collective) writes ``OUT/rank<R>.pt``: for each parameter part this rank
holds as megatron's main replica on data-parallel rank 0, the key, global shape and global
offset megatron gives it and the fp32 master, exp_avg and exp_avg_sq that
``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` return for it
(collectives over the parameter's data-parallel group), plus the optimizer's step. DeepSpeed
0.19.8's ZeRO-1/2 links those accessors to the optimizer state of its first parameter group
only (toolkit.runtime.optim_state.link redoes DeepSpeed's own linking for every group first).
``assemble`` (test process) puts every rank's parts back into whole tensors.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

STATES = ("param", "exp_avg", "exp_avg_sq")


def _accessor_states(param) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {"param": safe_get_full_fp32_param(param), "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq")}


def _pieces(meta, tensor: torch.Tensor) -> list:
    """megatron's ShardedTensors of this rank's part (a SwiGLU factory builds its gate and up parts)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    sh = replace(meta, data=tensor)
    return list(nested_values(sh.build())) if isinstance(sh, ShardedTensorFactory) else [sh]


def dump(engine, catalog, out: Path) -> None:
    import torch.distributed as dist

    from toolkit.runtime.optim_state import get_step, link

    link(engine)
    parts = []
    for e in catalog.trainable:
        states = _accessor_states(e.param)
        if not (e.main and dist.get_rank(group=e.group) == 0):
            continue
        pieces = {k: _pieces(e.meta, v.detach().float().cpu().reshape(e.meta.data.shape)) for k, v in states.items()}
        for i, sh in enumerate(pieces["param"]):
            parts.append({"key": sh.key, "global_shape": tuple(sh.global_shape), "offset": tuple(sh.global_offset),
                          **{k: pieces[k][i].data.clone() for k in STATES}})
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"step": get_step(engine), "parts": parts}, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()


def assemble(folder: Path) -> tuple[set[int], dict[str, dict[str, torch.Tensor]]]:
    """({steps seen}, {key: {state: whole tensor}}); every element must be covered exactly once."""
    steps, whole, filled = set(), {}, {}
    for f in sorted(folder.glob("rank*.pt")):
        d = torch.load(f, weights_only=True)
        steps.add(d["step"])
        for p in d["parts"]:
            if p["key"] not in whole:
                whole[p["key"]] = {k: torch.full(p["global_shape"], float("nan")) for k in STATES}
                filled[p["key"]] = torch.zeros(p["global_shape"], dtype=torch.int32)
            where = tuple(slice(o, o + n) for o, n in zip(p["offset"], _padded(p["param"].shape, p["offset"])))
            for k in STATES:
                whole[p["key"]][k][where] = p[k].reshape(whole[p["key"]][k][where].shape)
            filled[p["key"]][where] += 1
    for key, count in filled.items():
        assert bool((count == 1).all()), f"{folder}: '{key}' is not covered exactly once"
    return steps, whole


def _padded(shape: torch.Size, offset: tuple[int, ...]) -> tuple[int, ...]:
    """The piece's extent per global axis: leading (prepended layer/expert) axes have size 1."""
    lead = len(offset) - len(shape)
    return (1,) * lead + tuple(shape)
