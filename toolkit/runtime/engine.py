"""This rank's pipeline stage inside a DeepSpeed engine whose process groups are megatron's.

megatron-core builds the layers (tensor/sequence/expert parallel); DeepSpeed owns data
parallelism, ZeRO, offload, precision, accumulation, clipping and checkpoints. The engine
is built from the spine's DeepSpeed config (``toolkit.emit.deepspeed.deepspeed_config``)
with three runtime-only changes:
  - the learning rate follows Megatron-LM's schedule exactly: megatron-core's
    OptimizerParamScheduler, counted in samples as Megatron-LM counts it, is the engine's
    client scheduler, in place of the config's DeepSpeed scheduler (which warms up for at
    least 2 steps and applies each value one step late);
  - with pp > 1 ZeRO's ``overlap_comm`` is off because the runtime reduces gradients itself
    after the pipeline flush (ZeRO-1 with overlap_comm reduces inside the last
    micro-batch's backward, before the tied-embedding gradients of the other stage exist);
  - on a machine without CUDA, DeepSpeed's AdamW is torch's (``torch_adam``), as
    DeepSpeed's fused kernel needs CUDA;
  - DeepSpeed's throughput timer is off (whatever the spec's ``deepspeed`` section says): the
    runtime times its steps itself (trainer.run_step), and the timer, synchronised by default,
    waited for the device twice per micro-batch (every forward, every engine.step()).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..emit.deepspeed import deepspeed_config
from ..emit.monitor import MONITOR_SECTIONS
from ..kernels import spec_kernels
from ..mcore import cpu_compat
from .mpu import ExpertGroups, MegatronMPU, tag_expert_params
from .state import local_shape

log = logging.getLogger(__name__)


class Stage(torch.nn.Module):
    """This rank's megatron-core GPTModel chunks (one per virtual pipeline stage) as
    DeepSpeed's module.

    forward(tokens [b, s], position_ids [b, s], labels [b, s], loss_mask [b, s], hidden, chunk)
    runs model chunk `chunk` and returns the mean loss over unmasked tokens on the last
    virtual stage (with MTP modules, megatron's GPTModel adds their loss to the backward
    through MTPLossAutoScaler; the returned loss stays the main one), else the hidden states [s / tp (sequence parallel) or s, b, h] for the
    next one; `hidden` is the previous virtual stage's output (None on the first)."""

    def __init__(self, chunks: list[torch.nn.Module], experts: ExpertGroups | None = None,
                 explicit_mask: bool = True):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        if experts is not None:
            self.expert_groups = experts
        self.explicit_mask = explicit_mask
        self._mask: tuple[tuple, torch.Tensor] | None = None

    def causal_mask(self, seq: int, device: torch.device, cp: int) -> torch.Tensor | None:
        """The attention mask given to megatron: None with TransformerEngine's attention (its
        causal mask type needs none) and at cp > 1 (ContextParallelAttention masks by global
        position); else megatron's local DotProductAttention's bool [1, 1, s, s], built once
        per sequence length and device and kept (s x s bytes, counted by the memory estimate:
        toolkit.estimate.memory.causal_mask_bytes). Without it megatron's softmax would build its
        own on "cuda" in every layer (get_default_causal_mask)."""
        if not self.explicit_mask or cp > 1:
            return None
        key = (seq, device)
        if self._mask is None or self._mask[0] != key:
            self._mask = (key, cpu_compat.causal_mask(seq, device))
        return self._mask[1]

    def forward(self, tokens, position_ids, labels, loss_mask, hidden=None, chunk: int = 0, segments=None,
                loss_denominator=None):
        """`segments` [b, s]: packed conversations (toolkit.runtime.packing); `loss_denominator`:
        per-token normalisation over the global batch (mean_token_loss)."""
        model = self.chunks[chunk]
        if not model.pre_process:
            model.set_input_tensor(hidden)
        cp = model.config.context_parallel_size  # > 1: this rank holds 2 of the 2cp sequence chunks
        mask, packed = self.causal_mask(tokens.shape[1], tokens.device, cp), {}
        if segments is not None:
            from . import packing

            if self.explicit_mask:
                mask = packing.segment_mask(segments)
            else:
                packed = {"packed_seq_params": packing.thd_params(segments)}
        last = model.post_process  # the MTP block (on the last stage) reads the loss mask too
        out = model(input_ids=tokens, position_ids=position_ids, attention_mask=mask,
                    labels=labels if last else None, loss_mask=loss_mask.to(torch.float) if last else None, **packed)
        if not model.post_process:
            return out
        loss_mask = loss_mask.to(out.dtype)
        return mean_token_loss(out, loss_mask, cp, loss_denominator)


def mean_token_loss(token_losses: torch.Tensor, loss_mask: torch.Tensor, cp: int,
                    denominator: torch.Tensor | None = None) -> torch.Tensor:
    """The mean loss over the unmasked tokens of the micro-batch. Under context parallelism
    the tokens are spread over the cp ranks and DeepSpeed averages gradients over dp x cp:
    each cp rank returns cp x (its tokens' loss sum) / (all cp ranks' token count), whose mean
    over the cp ranks is the micro-batch's mean (Megatron-LM's loss x cp).

    With `denominator` (chat data), the loss is per token over the whole global batch, as
    Megatron-LM's calculate_per_token_loss: this micro-batch's loss sum / denominator, where
    denominator = (unmasked tokens of the global batch) / (micro-batches per rank x dp x cp),
    so that DeepSpeed's mean over micro-batches and dp x cp ranks is (loss sum of the global
    batch) / (its token count), whatever the number of tokens in each micro-batch (packed
    or not)."""
    count = loss_mask.sum()
    total = (token_losses * loss_mask).sum()
    if denominator is not None:
        return total / denominator
    if cp == 1:
        return total / count.clamp(min=1)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    count = count.detach().clone()
    dist.all_reduce(count, group=ps.get_context_parallel_group())
    return cp * total / count.clamp(min=1)


def param_groups(model: torch.nn.Module, weight_decay: float, experts: bool) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on norms and biases (megatron's rule: 1-D tensors;
    ``wd_mult`` is how megatron's scheduler knows); experts (ep > 1) in DeepSpeed's MoE
    groups, partitioned over expert data parallel."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = {id(p): len(local_shape(p)) > 1 for p in params}  # ZeRO-3 partitions are flat: use their shape
    groups = [{"name": "decay", "params": [p for p in params if matrix[id(p)]], "weight_decay": weight_decay,
               "wd_mult": 1.0},
              {"name": "no_decay", "params": [p for p in params if not matrix[id(p)]], "weight_decay": 0.0,
               "wd_mult": 0.0}]
    groups = [g for g in groups if g["params"]]
    if experts:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return [g for g in groups if g["params"]]


def runtime_config(plan, cuda: bool | None = None) -> dict[str, Any]:
    """The spine's DeepSpeed config with the runtime-only changes of the module docstring
    (``cuda``: whether the ranks have GPUs; default: this machine)."""
    cfg = deepspeed_config(plan)
    cfg.pop("scheduler", None)
    if plan.layout.cp > 1:  # DeepSpeed's data-parallel group spans dp x cp: a cp rank holds part of each sample
        cfg["train_batch_size"] = plan.batch.micro * plan.batch.grad_accum * plan.layout.dp_cp
    for section in MONITOR_SECTIONS:  # toolkit.runtime.monitor writes them, in the run folder
        cfg.pop(section, None)
    cfg["timers"] = {"throughput": {"enabled": False}}
    zero = cfg["zero_optimization"]
    if plan.layout.pp > 1 and zero.get("stage", 0) >= 1:
        zero["overlap_comm"] = False
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if "optimizer" in cfg and not cuda and plan.spec.zero.offload_optimizer == "none":
        cfg["optimizer"]["params"]["torch_adam"] = True
    return cfg


def lr_scheduler(plan) -> Callable:
    """optimizer -> megatron-core's OptimizerParamScheduler for this plan. Steps count
    samples (Megatron-LM's unit): the runtime steps it by the global batch per optimizer
    step. Weight decay is constant (groups with wd_mult 0 get none). On resume,
    resume.apply_schedule sets it from the checkpoint by Megatron-LM's rule."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, g, steps = plan.spec.optimizer, plan.batch.global_, plan.spec.train.steps

    def make(optimizer):
        return OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps * g,
            lr_decay_steps=steps * g, lr_decay_style=o.decay, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=steps * g, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True)

    return make


def build_engine(plan, chunks: list[torch.nn.Module]):
    """deepspeed.initialize on this rank's stage; returns (engine, stage)."""
    import deepspeed

    experts = None
    if plan.layout.ep > 1:
        tagged = [p for chunk in chunks for p in tag_expert_params(chunk, plan.layout.ep)]
        experts = ExpertGroups(plan.shape.moe.num_experts, plan.layout.ep)
        if not any(p.requires_grad for p in tagged):  # LoRA froze them: DeepSpeed's ZeRO must see no MoE
            experts.set_deepspeed_parallelism()  # layer (it asserts an expert param group), only the groups
            experts = None  # its start-up broadcast of every expert weight reads
    stage = Stage(chunks, experts, explicit_mask=not spec_kernels(plan.spec).transformer_engine)
    groups = param_groups(stage, plan.spec.optimizer.weight_decay, experts is not None)
    optimizer = None
    if plan.spec.optimizer.impl == "torch":
        o = plan.spec.optimizer
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
    engine, *_ = deepspeed.initialize(model=stage, model_parameters=None if optimizer else groups,
                                      optimizer=optimizer, lr_scheduler=lr_scheduler(plan),
                                      config=runtime_config(plan), mpu=MegatronMPU())
    cpu_compat.release_deepspeed_shm()
    keep_fp32_clip_norm(engine)
    return engine, stage


def keep_fp32_clip_norm(engine) -> None:
    """fp32 without ZeRO, DeepSpeed clips with ``clip_fp32_gradients`` and drops the norm it
    computed, so ``get_global_grad_norm()`` says None: the same call, keeping the norm."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients():
        engine._global_grad_norm = float(clip_grad_norm_(parameters=engine.module.parameters(),
                                                          max_norm=engine.gradient_clipping(), mpu=engine.mpu))

    engine.clip_fp32_gradients = clip_fp32_gradients


def drop_module_references(engine) -> None:
    """Remove what still points at the engine's module after ``engine.destroy()``: three
    process-wide references (DeepSpeed 0.19.8, megatron-core 0.16) that kept a ZeRO-3 run's
    model, and with it every parameter, alive for the life of the process.
      - ZeRO-3 pushes the module on ``parameter_offload.FWD_MODULE_STACK`` when it sets up
        its hooks (``DeepSpeedZeRoOffload.setup_zero_stage3_hooks``) and nothing pops it: this
        engine's entries are removed, other modules' kept.
      - ``PartitionedParameterCoordinator.__params_to_release`` is an unbounded
        ``functools.lru_cache`` on a method (under DeepSpeed's ``instrument_w_nvtx``): its
        keys hold every coordinator and submodule it saw.
      - megatron-core's ``RotaryEmbedding.forward`` is an ``lru_cache(maxsize=32)`` on a
        method: its keys hold the rotary module, whose ZeRO-3 backward-hook classes (one per
        module) reach the parameter coordinator.
    The two caches are emptied (another live engine recomputes its entries). Each of the
    three alone is not enough (checked on 2 ranks); tests/toolkit/runtime/test_correctness.py::
    test_close_gives_the_run_back asserts the model is freed, ZeRO-3 runs included. A
    library whose internals moved (another release) gets a warning naming what was not
    found, not an error: this runs when training is over."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not engine.module]
    else:
        log.warning("deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK not found: a ZeRO-3 "
                    "model may stay in memory after the run")
    for owner, name in ((PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release"),
                        (RotaryEmbedding, "forward")):
        cache = _lru_cache(getattr(owner, name, None))
        if cache is None:
            log.warning("%s.%s is no longer an lru_cache: a ZeRO-3 model may stay in memory after the run",
                        owner.__qualname__, name)
            continue
        cache.cache_clear()


def _lru_cache(fn):
    """The ``functools.lru_cache`` wrapper that is ``fn`` or that a decorator around it closed
    over (DeepSpeed's ``instrument_w_nvtx`` keeps no ``__wrapped__``); None if there is none."""
    for _ in range(4):
        if fn is None or hasattr(fn, "cache_clear"):
            return fn
        inner = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if callable(c.cell_contents)]
        fn = getattr(fn, "__wrapped__", None) or (inner[0] if len(inner) == 1 else None)
    return None
