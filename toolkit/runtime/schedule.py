"""One optimizer step: forward and backward of every micro-batch, then DeepSpeed's step.

pp = 1: DeepSpeed's own accumulation (``engine.backward`` and ``engine.step`` per
micro-batch; DeepSpeed reduces at the accumulation boundary).

pp > 1: megatron-core's pipeline schedule, 1F1B or interleaved 1F1B, with megatron's
point-to-point exchanges (toolkit.runtime.pipeline). DeepSpeed's accumulation boundary is held
off during the micro-batches and set after the flush, when the tied-embedding and
tensor-parallel replica gradients are summed (toolkit.runtime.grads); then DeepSpeed reduces
over data parallel and steps.
"""
from __future__ import annotations

import torch

from . import grads
from .pipeline import Pipe, run_pipeline


def aux_loss_scale(engine, micro_batches: int) -> None:
    """megatron's MoE auxiliary loss and MTP loss inject their gradients in backward with
    these factors, as megatron's schedules set them: the main loss is divided by the
    accumulation steps (and multiplied by the fp16 loss scale) by engine.backward, so both
    are too; the MoE one is also multiplied by cp, as the main loss is (engine.mean_token_loss)
    against the average over dp x cp (megatron's MTP scale has no cp factor: MTP at cp > 1 is
    a plan rule, toolkit.plan.runtime_rules.runtime_mtp)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    scale = float(getattr(engine.optimizer, "loss_scale", 1.0)) if engine.fp16_enabled() else 1.0
    cp = ps.get_context_parallel_world_size()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale * cp / micro_batches, device=engine.device))
    MTPLossAutoScaler.set_loss_scale(torch.tensor(scale / micro_batches, device=engine.device))


def accumulated_grad(engine, param: torch.nn.Parameter) -> torch.Tensor | None:
    """Where the engine's optimizer keeps a parameter's accumulated gradient (as DeepSpeed's
    pipeline engine reads it for tied weights)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    opt = engine.optimizer
    if isinstance(opt, BF16_Optimizer):
        return param._hp_grad
    if hasattr(opt, "get_param_gradient_attribute"):
        return opt.get_param_gradient_attribute(param)
    return param.grad


def train_step(engine, stage, micro_batches: list[dict], samples: int, pipe: Pipe | None = None) -> list[torch.Tensor]:
    """Run one step of `samples` samples (the global batch: the learning-rate schedule's
    increment); returns the last stage's micro-batch losses, detached, on the engine's
    device ([] on other stages): the host waits for them once per step, not per micro-batch."""
    aux_loss_scale(engine, len(micro_batches))
    reset_routing_counts(stage.chunks)
    lr_kwargs = {"increment": samples}
    if pipe is None:
        losses = []
        for mb in micro_batches:
            loss = engine(**mb)
            engine.backward(loss)
            engine.step(lr_kwargs=lr_kwargs)
            losses.append(loss.detach())
    else:
        engine.set_gradient_accumulation_boundary(False)
        losses = run_pipeline(engine, stage, micro_batches, pipe)
        engine.set_gradient_accumulation_boundary(True)
        tied = grads.tied_embedding_weight(stage.chunks)
        grads.allreduce_tied_embedding_grad(tied, accumulated_grad(engine, tied) if tied is not None else None)
        grads.allreduce_tp_deferred(pipe.tp_replicas, lambda p: accumulated_grad(engine, p))
        engine.allreduce_gradients()
        engine.step(lr_kwargs=lr_kwargs)
    update_expert_bias(stage.chunks)
    return losses


def reset_routing_counts(chunks: list) -> None:
    """Aux-loss-free routing counts each expert's tokens over the step (megatron-core's own
    reset, as its training loop calls it before every step)."""
    config = chunks[0].config
    if config.moe_router_enable_expert_bias:
        from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors

        reset_model_temporary_tensors(config, chunks)


def update_expert_bias(chunks: list) -> None:
    """megatron-core's update of the routers' expert bias from the tokens each expert received
    in the step (all-reduced over tp x dp x cp), moe_router_bias_update_rate per step; megatron
    runs it in finalize_model_grads, after the backward passes of the step."""
    config = chunks[0].config
    if config.moe_router_enable_expert_bias:
        from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

        _update_router_expert_bias(chunks, config)
