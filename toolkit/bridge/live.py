"""A live megatron-core model seen through the converters' tables: which of the model's rank
tensors this process holds, and the copies (toolkit.regions) that build them from the HF
tensors or build each HF tensor from them.

Nothing here is a second mapping: the family's weight table (toolkit.models.weights) gives
the HF <-> global megatron copies (converters.mapping.ModelMap), and the converters' sharding
(converters.sharding.rank_tensors, torch_dist naming: dense tensors keyed (tp rank, pp, ep 0),
experts (expert-tp rank, pp, ep rank)) gives each rank tensor's part of a global tensor. This
module only matches those rank tensors to the live parameters of this process, by
state-dict name, and cross-checks each against the global name the runtime gives the
parameter (toolkit.runtime.init.global_name) so a layout read wrongly is an error, not a
silently misplaced layer.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ToolkitError
from ..models import ModelShape, read_hf_config, shape_from_hf
from ..parallel.layout import Layout
from ..regions import Copy, by_dst, compose, invert


class BridgeError(ToolkitError):
    """The live model and the Hugging Face weights or config do not fit together, or an export
    failed (exit 1: inconsistent input data, or a failure while working)."""


def chunks_of(model: Any) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks from a GPTModel, a list of them, the runtime's DeepSpeed
    engine or its Stage module (``.chunks``)."""
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the Stage
    if hasattr(module, "chunks"):
        return list(module.chunks)
    if isinstance(model, (list, tuple)):
        return list(model)
    return [model]


def hf_shape(hf: str | Path | dict | ModelShape) -> ModelShape:
    """The ModelShape of an HF folder, config.json path, config dict, or a shape as it is."""
    if isinstance(hf, ModelShape):
        return hf
    return shape_from_hf(hf if isinstance(hf, dict) else read_hf_config(hf))


def current_layout(vpp: int = 1, config=None) -> Layout:
    """The layout of megatron-core's parallel_state as initialised in this process (the uneven
    pipeline split, if any, from the model's TransformerConfig)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise BridgeError("megatron-core's parallel_state is not initialised on this process "
                          "(parallel_state.initialize_model_parallel, or toolkit.mcore.distributed.init_parallel)")
    split = {}
    if config is not None:
        split = {"first_stage_layers": config.num_layers_in_first_pipeline_stage,
                 "last_stage_layers": config.num_layers_in_last_pipeline_stage,
                 "embedding_in_split": bool(config.account_for_embedding_in_pipeline_split),
                 "loss_in_split": bool(config.account_for_loss_in_pipeline_split)}
    tp = ps.get_tensor_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    return Layout(tp=tp, pp=ps.get_pipeline_model_parallel_world_size(), vpp=vpp,
                  ep=ps.get_expert_model_parallel_world_size(), etp=None if etp == tp else etp,
                  cp=ps.get_context_parallel_world_size(), world=dist.get_world_size(), **split)


@dataclass(frozen=True)
class Held:
    """One rank tensor this process holds: the live tensor and the group of its replicas."""

    key: Hashable  # converters.sharding.Local
    tensor: torch.Tensor  # the parameter (under ZeRO-3 a partitioned one) or persistent buffer
    group: object  # data-parallel group of its replicas (rank 0 of it contributes to exports)
    from_hf: tuple[Copy, ...]  # HF tensors -> this rank tensor


class LiveModel:
    """This rank's chunks, with the converters' map of the model at the live layout."""

    def __init__(self, model: Any, hf: str | Path | dict | ModelShape):
        from converters.mapping import ModelMap

        self.chunks = chunks_of(model)
        config = self.chunks[0].config
        self.shape = replace(hf_shape(hf), mtp_layers=config.mtp_num_layers or 0)
        self.layout = current_layout(len(self.chunks), config)
        self.grouped_gemm = bool(getattr(config, "moe_grouped_gemm", False))
        self.map = ModelMap(self.shape, self.chunks[0].vocab_size)
        self._check_family()

    def _check_family(self) -> None:
        problem = family_problem(self.shape, self.map)
        if problem:
            raise BridgeError(problem)

    @cached_property
    def rank_tensors(self) -> list:
        """Every rank tensor of the layout (converters.sharding, torch_dist keys)."""
        return self.map.rank_tensors(self.layout, self.grouped_gemm, legacy=False)

    def _coords(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(tp, pp, ep) of this rank's dense keys and of its expert keys."""
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_rank()
        return ((ps.get_tensor_model_parallel_rank(), pp, 0),
                (ps.get_expert_tensor_parallel_rank(), pp, ps.get_expert_model_parallel_rank()))

    @cached_property
    def held(self) -> dict[Hashable, Held]:
        """This rank's rank tensors, each matched to its live parameter or buffer."""
        from megatron.core import parallel_state as ps

        from ..runtime.init import global_name
        from ..runtime.state import data_parallel_group

        dense, expert = self._coords()
        live = [{**dict(c.named_parameters()), **dict(c.named_buffers())} for c in self.chunks]
        out, missing = {}, []
        for rt in self.rank_tensors:
            k = rt.key
            if (k.tp, k.pp, k.ep) != (expert if ".mlp.experts." in k.name else dense):
                continue
            t = live[k.vp].pop(k.name, None)
            if t is None:
                missing.append(k.name)
                continue
            own = global_name(self.chunks[k.vp], k.name, ps.get_expert_model_parallel_rank())
            if own != rt.copies[0].src:
                raise BridgeError(f"chunk {k.vp}'s '{k.name}' is '{own}' in the model but '{rt.copies[0].src}' in "
                                  f"{self.layout.describe()}: the model was not built at the layout read")
            out[k] = Held(k, t, data_parallel_group(t), tuple(compose(rt.copies, self.map.hf_to_global)))
        unplaced = [f"{v}.{n}" for v, names in enumerate(live) for n, t in names.items()
                    if isinstance(t, torch.nn.Parameter)]
        if missing or unplaced:
            raise BridgeError(f"{self.shape.architecture} at {self.layout.describe()}: " + "; ".join(
                [f"missing in the model: {', '.join(missing[:3])}"] * bool(missing)
                + [f"no HF tensor for: {', '.join(unplaced[:3])}"] * bool(unplaced)))
        return out

    @cached_property
    def routes(self) -> dict[str, list[Copy]]:
        """HF name -> copies from rank tensors (the first holder of each value, as the
        converters' export reads), in the converters' HF order (aliases last)."""
        supply = by_dst(invert(c for rt in self.rank_tensors for c in rt.copies))
        return {name: compose(self.map.global_to_hf[name], supply) for name in self.map.hf_shapes}


def family_problem(shape, model_map) -> str | None:
    """Why the live bridge cannot move this family's weights (the converters can), or None."""
    from converters.shifted import hf_shifts

    from ..models.family import check_supported, family_of

    check_supported(shape.architecture)
    if family_of(shape.architecture).packed is not None:
        return (f"{shape.architecture} stores its experts packed in 3-D HF tensors; the live bridge does not read or "
                "write those yet (use the converters)")
    shifted = hf_shifts(model_map)
    if shifted:
        return (f"{shape.architecture} stores {len(shifted)} weights as megatron's value minus a constant (e.g. "
                f"'{next(iter(shifted))}'); the live bridge does not apply the shift yet (use the converters)")
    return None

