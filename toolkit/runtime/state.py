"""Which global tensor each of this rank's parameters is, and which rank writes it.

A parameter's place in the layout-free checkpoint is megatron-core's own sharding metadata
(``GPTModel.sharded_state_dict``: the global key, shape and offset of this rank's part, the
gate/up split of SwiGLU, the replica id), taken from a twin of the model built on the meta
device, so it is the same whether DeepSpeed keeps the real weight whole or partitioned
(ZeRO-3). The optimizer state of a parameter has the same metadata under Megatron-LM's
distributed-optimizer keys ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``
(megatron.core.dist_checkpointing.optimizer.make_sharded_optimizer_tensor).

Streaming: every rank holding a parameter part could write it, so each part is given to
one rank of its data-parallel group (the ``owner``; parts are dealt largest first to the
least loaded rank), which alone keeps it in memory on save and writes it. No rank holds
more than its share plus one parameter in flight.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

OPTIMIZER_PREFIX = "optimizer.state"


@dataclass
class Entry:
    """One parameter of this rank's chunks."""

    name: str  # "<chunk index>.<parameter name>" (unique on this rank)
    param: torch.nn.Parameter
    meta: object  # megatron ShardedTensor | ShardedTensorFactory (data on the meta device)
    group: object  # the data-parallel process group of its replicas
    owner: int  # rank in `group` that writes it
    main: bool  # megatron calls this rank's copy the main one apart from data parallelism
    trainable: bool = True  # False: frozen (LoRA's base), no optimizer state

    @property
    def writes(self) -> bool:
        return self.main and dist.get_rank(group=self.group) == self.owner

    @property
    def numel(self) -> int:
        return local_shape(self.param).numel()


def local_shape(param: torch.nn.Parameter) -> torch.Size:
    """The shape of this rank's (tensor-parallel) part of a weight, also under ZeRO-3, where
    the module holds an empty partition and DeepSpeed records the shape as ``ds_shape``."""
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


def _is_main(replica_id) -> bool:
    """Main copy except for the data-parallel component (megatron puts that one last)."""
    rid = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return all(r == 0 for r in rid[:-1])


def twin_metadata(plan) -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
    """({entry name: sharding metadata} of every parameter, the same of every persistent
    buffer megatron checkpoints (the router's ``expert_bias``), {key: ShardedObject} of module
    extra states), from a twin of this rank's chunks built on the meta device."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    from .model import build_model_chunks

    with torch.device("meta"):
        twin = build_model_chunks(plan, zero=False, use_cpu_initialization=True)
    params, buffers, objects = {}, {}, {}
    for i, chunk in enumerate(twin):
        names = {id(p): n for n, p in chunk.named_parameters()}
        buffer_names = {id(b): n for n, b in chunk.named_buffers()}
        full = chunk.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))  # as Megatron-LM passes
        tensors, _ = extract_sharded_tensors_and_factories(full)
        for sh in nested_values(tensors):
            if id(sh.data) in names:
                params.setdefault(f"{i}.{names[id(sh.data)]}", sh)
            elif id(sh.data) in buffer_names:
                buffers.setdefault(f"{i}.{buffer_names[id(sh.data)]}", sh)
        objects.update({f"{i}.{k}": v for k, v in full.items() if isinstance(v, ShardedObject)})
    return params, buffers, objects


@dataclass(frozen=True)
class Buffer:
    """A persistent buffer megatron checkpoints with the weights (not trained by the optimizer:
    the router's ``expert_bias`` is updated from token counts). Replicated over data parallel
    and never partitioned by ZeRO, so megatron's replica id says which rank writes it."""

    name: str
    tensor: torch.Tensor
    meta: object  # megatron ShardedTensor (data on the meta device)


@dataclass
class Catalog:
    """This rank's parameters (in a fixed order, owners dealt), persistent buffers and module
    extra states."""

    entries: list[Entry]
    objects: dict[str, object]
    buffers: list[Buffer] = field(default_factory=list)

    @property
    def trainable(self) -> list[Entry]:
        """The entries the optimizer holds state for (all but a LoRA run's frozen base)."""
        return [e for e in self.entries if e.trainable]


def data_parallel_group(param: torch.nn.Parameter):
    """The group holding replicas of this parameter: megatron's data-parallel group with
    context parallel, or its expert data-parallel group for experts (``allreduce=False``)."""
    from megatron.core import parallel_state as ps

    if getattr(param, "allreduce", True) is False:
        return ps.get_expert_data_parallel_group()
    return ps.get_data_parallel_group(with_context_parallel=True)


def catalog(plan, chunks: list[torch.nn.Module]) -> Catalog:
    """Every parameter of this rank in a fixed order (the same on all ranks of a data-parallel
    group, so collectives over it line up), with its owner; frozen ones (LoRA's base) are
    checkpointed with the weights, without optimizer state."""
    meta, buffer_meta, objects = twin_metadata(plan)
    out, buffers = [], []
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            key = f"{i}.{name}"
            if key not in meta:
                continue
            out.append(Entry(key, param, meta[key], data_parallel_group(param), 0, _is_main(meta[key].replica_id),
                             param.requires_grad))
        buffers += [Buffer(f"{i}.{name}", b, buffer_meta[f"{i}.{name}"]) for name, b in chunk.named_buffers()
                    if f"{i}.{name}" in buffer_meta]
    _deal(out)
    return Catalog(out, objects, buffers)


def _deal(ents: list[Entry]) -> None:
    """Owners: per group, largest parts first to the least loaded rank (deterministic)."""
    by_group: dict[int, list[Entry]] = {}
    for e in ents:
        by_group.setdefault(id(e.group), []).append(e)
    for group_entries in by_group.values():
        size = dist.get_world_size(group=group_entries[0].group)
        load = [0] * size
        for e in sorted(group_entries, key=lambda e: (-e.numel, e.name)):
            e.owner = min(range(size), key=lambda r: (load[r], r))
            load[e.owner] += e.numel


def with_data(meta, data: torch.Tensor, prefix: str | None = None, writer: bool = False):
    """The entry's ShardedTensor(Factory) holding `data`; `prefix`: the optimizer-state key
    prefix (Megatron-LM's names); `writer`: this rank saves it (the main replica), else the
    replica id stays megatron's (loading checks each part is read once as main)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    zero = tuple(0 for _ in meta.replica_id) if isinstance(meta.replica_id, tuple) else 0
    sh = replace(meta, replica_id=zero) if writer else meta
    if prefix is not None:
        return make_sharded_optimizer_tensor(sh, data, prefix)
    return replace(sh, data=data) if isinstance(sh, ShardedTensorFactory) else replace(sh, data=data, dtype=data.dtype)
