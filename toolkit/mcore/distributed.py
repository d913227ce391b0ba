"""Process groups: torch.distributed from the launcher's environment, then megatron-core's
parallel_state grid (order tp-cp-ep-dp-pp) for a layout (toolkit.parallel.layout.Layout: a
plan's, or a checkpoint's)."""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist

from ..parallel.layout import Layout
from . import cpu_compat
from .rendezvous import check_master_port


def init_process_group() -> tuple[int, int]:
    """(rank, world) from torchrun / the deepspeed launcher; gloo on CPU, nccl on GPU."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        cpu_compat.local_size_from_torchrun()
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one rank: an in-process store, no port to race for
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            check_master_port()
            dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def start_deepspeed_comm(backend: str | None) -> bool:
    """DeepSpeed's communication backend over the process group that is up (its CPU shared-memory
    op prints a line as it loads: kept quiet), and that op's /dev/shm segment unlinked at once
    (cpu_compat.release_deepspeed_shm: a process that stops before its engine is built, or a
    conversion that builds one, leaves no 66 MB behind); returns whether a segment was unlinked."""
    import deepspeed

    from .. import quiet

    with quiet.without_lines(quiet.DEEPSPEED_SHM_BUILT):
        deepspeed.init_distributed(dist_backend=backend)
    return cpu_compat.release_deepspeed_shm()


def init_parallel(layout: Layout, seed: int = 1234) -> None:
    """megatron-core's parallel_state for this layout's grid, and its random streams (``seed_streams``)."""
    from megatron.core import parallel_state

    init_process_group()
    cpu_compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp, hierarchical_context_parallel_sizes=layout.hierarchical_cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, create_gloo_process_groups=not torch.cuda.is_available())
    seed_streams(seed)


def seed_streams(seed: int) -> None:
    """Megatron-LM's ``_set_random_seed`` (without --data-parallel-random-init): every pipeline
    stage its own seed, seed + 100 x pp rank, for Python's, numpy's and torch's generators, then
    megatron-core's ``model_parallel_cuda_manual_seed``: the default stream (hidden dropout: the
    same on every tp rank), 'model-parallel-rng' (+2718 + tp rank: attention dropout, sequence
    parallel regions) and 'expert-parallel-rng'. On CPU the tracker is cpu_rng's (cpu_compat)."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def rng_states() -> dict:
    """Every random stream of this rank (what Megatron-LM's checkpoints keep): torch's CPU and
    CUDA generators and megatron's tracker (the model- and expert-parallel streams)."""
    from megatron.core import tensor_parallel

    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_states(rng: dict) -> None:
    """Resume the streams ``rng_states`` returned (a checkpoint without the tracker's keeps it)."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    if rng.get("tracker"):
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(rng["tracker"]))


def grid_groups() -> list:
    """This rank's process groups of megatron-core's current grid, in the order megatron made
    them (parallel_state's own list; empty when no grid is set up)."""
    from megatron.core import parallel_state

    return [g for g in (parallel_state._global_process_group_list or []) if g is not None]


def release_model_parallel() -> None:
    """Tear down megatron-core's grid and destroy its process groups, once nothing built on
    the grid is used any more. megatron's destroy_model_parallel only forgets its groups, and
    every gloo group keeps a thread that wakes every 10 ms (gloo's tcp Loop): a process that
    sets up grid after grid (`toolkit verify` with several checkpoints) would otherwise hold
    51 more threads per 2-rank grid, and after 30 grids an idle rank burned 0.62 of a core.
    The groups are the ones megatron lists as this rank's (parallel_state's own list); a
    group still referenced (a live model or engine) is unregistered but its thread stays."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return
    made = grid_groups()
    forget_moe_losses()
    parallel_state.destroy_model_parallel()  # destroys its gloo data-parallel groups itself
    for group in made:
        with contextlib.suppress(ValueError):  # already destroyed
            dist.destroy_process_group(group)


def forget_moe_losses() -> None:
    """Empty megatron's MoE auxiliary-loss tracker (moe_utils' module-level dict, which its routers
    fill at every forward): each entry is a tensor sized to the model's layers that holds this grid's
    groups, made once and never resized. A later model in the same process with more layers (an MTP
    layer: its router writes at index num_layers) indexed past its end ("index 4 is out of bounds for
    dimension 0 with size 4", a tiny Qwen3-MoE run and then a Qwen3-Next one with MTP in one worker)."""
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def destroy() -> None:
    release_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def all_max(value: int) -> int:
    """The largest `value` over all ranks (on the backend's device: NCCL needs CUDA tensors)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)
