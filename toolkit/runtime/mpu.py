"""What DeepSpeed must know about megatron-core's process grid.

DeepSpeed reduces gradients over ``mpu.get_data_parallel_group()`` and sums gradient
norms over ``mpu.get_model_parallel_group()``; it counts a replicated parameter once per
model-parallel group by asking ``get_tensor_model_parallel_rank() == 0``. Every answer
here comes from megatron-core's parallel_state, so both libraries agree on which ranks
hold replicas: model parallel is megatron's tp x pp group (a pipeline stage holds other
parameters than its neighbours, so norms sum over stages too).

Experts: megatron-core marks expert parameters ``allreduce = False``. DeepSpeed reads that
as "MoE parameter of the expert group named ``param.group_name``" and then reduces and
partitions it over its expert data-parallel group, but only once the model holds an
instance of its own MoE layer. ``ExpertGroups`` is that declaration: it owns no weights,
never runs, and hands DeepSpeed megatron's expert-parallel and expert-data-parallel
groups under the group name the expert parameters carry, and DeepSpeed's expert
tensor-parallel size. That size decides the experts' share of the gradient norm on
DeepSpeed's bf16 ZeRO-1 path (BF16_Optimizer, deepspeed.runtime.utils
.get_global_norm_of_tensors): above 1 it sums the expert norms over the model-parallel
group (tp x pp) and then over the expert-parallel group; at 1 over the pipeline stages and
the expert-parallel group only. DeepSpeed sets it only when it builds its own expert groups,
so megatron's ``etp`` is given here: experts split over tp (etp = tp: megatron's
expert-tensor-parallel groups are then its tensor-parallel groups) are summed over their
tp ranks, whole experts (etp = 1) are not. Any other etp has no such group in DeepSpeed's
terms and the plan refuses it on that path (toolkit.plan.runtime_rules); DeepSpeed's ZeRO
optimizer (ZeRO-2, offload, fp32 and fp16) does not read the size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE

from ..mcore.distributed import grid_groups


class MegatronMPU:
    """DeepSpeed's ``mpu`` argument, answered from megatron-core's parallel_state."""

    @staticmethod
    def _ps():
        from megatron.core import parallel_state

        return parallel_state

    def get_data_parallel_group(self):
        return self._ps().get_data_parallel_group(with_context_parallel=True)

    def get_data_parallel_rank(self) -> int:
        return self._ps().get_data_parallel_rank(with_context_parallel=True)

    def get_data_parallel_world_size(self) -> int:
        return self._ps().get_data_parallel_world_size(with_context_parallel=True)

    def get_tensor_model_parallel_group(self):
        return self._ps().get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self) -> int:
        return self._ps().get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ps().get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ps().get_tensor_model_parallel_src_rank()

    def get_pipeline_model_parallel_group(self):
        return self._ps().get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._ps().get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._ps().get_pipeline_model_parallel_world_size()

    def get_model_parallel_group(self):
        return self._ps().get_model_parallel_group()

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(group=self.get_model_parallel_group())

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(group=self.get_model_parallel_group())


def expert_group_name(ep: int) -> str:
    """DeepSpeed's naming (``ep_size_<ep>``); it parses the size back out of the name."""
    return f"ep_size_{ep}"


class ExpertGroups(MoE):
    """Declares megatron-core's experts to DeepSpeed's engine (see the module docstring).

    ``num_local_experts`` is 0 on purpose: DeepSpeed would otherwise write and read one
    file per expert under its own MoE naming; expert weights are saved with the rest of
    the model by megatron's dist_checkpointing (toolkit.runtime.checkpoint)."""

    def __init__(self, num_experts: int, ep: int):
        torch.nn.Module.__init__(self)  # MoE.__init__ would build DeepSpeed's own gate and experts
        self.ep_size = ep
        self.expert_group_name = expert_group_name(ep)
        self.num_experts = num_experts
        self.num_local_experts = 0
        self.use_residual = False
        self.enable_expert_tensor_parallelism = False

    def set_deepspeed_parallelism(self, *_args, **_kwargs) -> None:
        """Called by deepspeed.initialize: register megatron's groups under our name, and
        DeepSpeed's expert tensor-parallel size (see the module docstring)."""
        from deepspeed.utils import groups
        from megatron.core import parallel_state as ps

        name = self.expert_group_name
        for table, group in (("EXPERT_PARALLEL", ps.get_expert_model_parallel_group()),
                             ("EXPERT_DATA_PARALLEL", ps.get_expert_data_parallel_group())):
            getattr(groups, f"_{table}_GROUP")[name] = group
            getattr(groups, f"_{table}_GROUP_RANKS")[name] = dist.get_process_group_ranks(group)
        groups.expert_tensor_parallel_world_size = deepspeed_expert_tp(
            ps.get_expert_tensor_parallel_world_size(), ps.get_tensor_model_parallel_world_size())

    def forward(self, *args, **kwargs):
        raise RuntimeError("ExpertGroups only declares expert groups to DeepSpeed; it never runs")


def deepspeed_expert_tp(etp: int, tp: int) -> int:
    """DeepSpeed's expert tensor-parallel size for megatron's etp and tp: etp where megatron's
    expert-tensor-parallel groups are its tensor-parallel groups (etp = tp), else 1."""
    return etp if etp == tp else 1


def tag_expert_params(model: torch.nn.Module, ep: int) -> list[torch.nn.Parameter]:
    """Give megatron's expert parameters (``allreduce = False``, set only when ep > 1)
    DeepSpeed's group name; returns them."""
    experts = [p for p in model.parameters() if getattr(p, "allreduce", True) is False]
    for p in experts:
        p.group_name = expert_group_name(ep)
    return experts


def forget_grid(engine) -> None:
    """Take megatron's grid out of DeepSpeed's module-level group tables (deepspeed.utils.groups)
    before the grid's groups are destroyed: the expert groups ExpertGroups declared (and the
    expert tensor-parallel size, back to DeepSpeed's default 1), and the engine's mpu.
    DeepSpeed keeps them after ``engine.destroy()``; a later engine in the same process would
    meet destroyed groups there (a universal checkpoint's load reads the largest ``ep_size_*``
    entry, an engine without an mpu asks ``groups.mpu``) or sum its expert norms over tp."""
    from deepspeed.utils import groups

    grid = {id(g) for g in grid_groups()}
    for table in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP"):
        declared, ranks = getattr(groups, table), getattr(groups, f"{table}_RANKS")
        for name in [n for n, g in declared.items() if id(g) in grid]:
            del declared[name]
            ranks.pop(name, None)
            groups.expert_tensor_parallel_world_size = 1
    if engine.mpu is not None and groups.mpu is engine.mpu:
        groups.mpu = None
