"""The training runtime's model: megatron-core's GPTModel chunks of the plan
(toolkit.mcore.model), built under ZeRO-3 inside ``deepspeed.zero.Init`` so that no rank ever
holds the whole stage."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..mcore import model


def zero_init(plan):
    """ZeRO-3: ``deepspeed.zero.Init`` partitions each module's weights over data parallel as
    soon as it is built (DeepSpeed's own mechanism); other stages: nothing."""
    if plan.spec.zero.stage != 3:
        return contextlib.nullcontext()
    import deepspeed
    import torch.distributed as dist

    from .engine import runtime_config
    from .mpu import MegatronMPU

    deepspeed.init_distributed(dist_backend=dist.get_backend())  # zero.Init reads ranks from deepspeed.comm
    # dtype comes from the config: an explicit dtype= is replaced by bf16 on accelerators
    # without fp16 (deepspeed 0.19.8, partition_parameters.Init._set_dtype's precedence)
    # the group is passed explicitly: zero.Init partitions over the world group otherwise (its mpu
    # argument is not read for that), and with tp > 1 each rank's tensor-parallel part would then be
    # partitioned (and gathered, and broadcast on modification) across other tp ranks' parts
    mpu = MegatronMPU()
    return deepspeed.zero.Init(config_dict_or_path=runtime_config(plan), mpu=mpu,
                               data_parallel_group=mpu.get_data_parallel_group())


def build_model_chunks(plan, zero: bool = True, **config_overrides: Any) -> list[torch.nn.Module]:
    """toolkit.mcore.model.build_model_chunks, under ZeRO-3's partitioning when the plan runs
    ZeRO-3. ``zero=False``: never partitioned (a meta-device twin, or a model outside DeepSpeed).
    With ``finetune.method: lora`` the target layers get adapters and everything else is frozen
    (toolkit.runtime.lora), here, so the twin whose sharding metadata names the checkpoint's
    tensors has them too."""
    chunks = model.build_model_chunks(plan, zero_init(plan) if zero else None, **config_overrides)
    if plan.spec.finetune.method == "lora":
        from .lora import apply_lora

        apply_lora(chunks, plan.spec.finetune.lora)
    return chunks
