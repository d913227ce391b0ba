"""One optimizer step: forward and backward of every micro-batch, then DeepSpeed's step.

pp = 1: DeepSpeed's own accumulation (``engine.backward`` and ``engine.step`` per
micro-batch; DeepSpeed reduces at the accumulation boundary).

pp > 1: megatron-core's pipeline order, non-interleaved 1F1B (one model chunk per rank) or
interleaved 1F1B (vpp chunks), taken from megatron's own schedule arithmetic
(``get_pp_rank_microbatches``: warm-up count; ``get_schedule_table``: which micro-batch
and chunk each virtual step runs, ``microbatch_group_size_per_vp_stage`` = pp), so the
order of forwards and backwards on every rank is megatron's. Megatron's schedules allocate
on "cuda"; here activations and their gradients move as tagged point-to-point messages on
any backend: a rank sends as soon as it has produced (non-blocking) and waits only for the
one message its next computation needs, so any order megatron's synchronous exchanges run
without deadlock runs here too.

A chunk that is not the last virtual stage backpropagates the gradient g received for its
output y with ``engine.backward((y * g).sum(), scale_wrt_gas=False)``: the gradient of that
scalar with respect to the chunk's weights is exactly the vector-Jacobian product, and g
already holds the 1/accumulation factor the last stage's ``engine.backward(loss)`` applied.
DeepSpeed's accumulation boundary is held off during the micro-batches and set after the
flush, when the tied-embedding and tensor-parallel replica gradients are summed
(toolkit.runtime.grads); then DeepSpeed reduces over data parallel and steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import grads


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


def train_step(engine, stage, micro_batches: list[dict], samples: int, pipe=None) -> list[torch.Tensor]:
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


@dataclass
class Pipe:
    """This rank's place in the pipeline and the shape of what moves between stages:
    activations and their gradients of [s_local, b, h]."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    tp_replicas: list = field(default_factory=list)  # summed over tp at the flush (toolkit.runtime.grads)

    def __post_init__(self):
        from megatron.core import parallel_state as ps

        self.group = ps.get_pipeline_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(self.group)  # global rank of each stage
        self.stage, self.stages = ps.get_pipeline_model_parallel_rank(), len(self.ranks)


def virtual_steps(stage: int, stages: int, chunks: int, micro: int) -> tuple[int, list[tuple[int, int]]]:
    """(warm-up count, [(micro-batch, chunk) of each forward in order]) as megatron-core's
    interleaved (chunks > 1) or non-interleaved schedule runs them on this stage."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    if chunks == 1:
        warmup = stages - stage - 1
    else:
        warmup = (stages - stage - 1) * 2 + (chunks - 1) * stages
    return min(warmup, micro * chunks), get_schedule_table(micro, chunks, stages)


class Transfers:
    """Tagged messages between virtual stages: (kind, micro-batch, producing chunk) names each."""

    def __init__(self, pipe: Pipe, chunks: int):
        self.pipe, self.chunks, self.pending = pipe, chunks, []

    def _tag(self, grad: bool, mb: int, chunk: int) -> int:
        return (mb * self.chunks + chunk) * 2 + int(grad)

    def _prev(self, chunk: int) -> tuple[int, int] | None:
        """(global rank, chunk) of the virtual stage feeding this chunk, None for the first."""
        s, n = self.pipe.stage, self.pipe.stages
        if s > 0:
            return self.pipe.ranks[s - 1], chunk
        return (self.pipe.ranks[n - 1], chunk - 1) if chunk > 0 else None

    def _next(self, chunk: int) -> tuple[int, int] | None:
        s, n = self.pipe.stage, self.pipe.stages
        if s < n - 1:
            return self.pipe.ranks[s + 1], chunk
        return (self.pipe.ranks[0], chunk + 1) if chunk < self.chunks - 1 else None

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(self.pipe.shape, dtype=self.pipe.dtype, device=self.pipe.device)
        dist.irecv(buf, src, tag=tag).wait()
        return buf

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, dst, tag=tag), t))

    def input(self, mb: int, chunk: int) -> torch.Tensor | None:
        prev = self._prev(chunk)
        if prev is None:
            return None
        return self._recv(prev[0], self._tag(False, mb, prev[1])).requires_grad_()

    def output(self, y: torch.Tensor, mb: int, chunk: int) -> None:
        nxt = self._next(chunk)
        if nxt is not None:
            self._send(y, nxt[0], self._tag(False, mb, chunk))

    def output_grad(self, mb: int, chunk: int) -> torch.Tensor | None:
        nxt = self._next(chunk)
        return None if nxt is None else self._recv(nxt[0], self._tag(True, mb, chunk))

    def input_grad(self, gx: torch.Tensor | None, mb: int, chunk: int) -> None:
        prev = self._prev(chunk)
        if prev is not None:
            self._send(gx, prev[0], self._tag(True, mb, prev[1]))

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def run_pipeline(engine, stage, micro_batches: list[dict], pipe: Pipe) -> list[torch.Tensor]:
    """Every forward and backward of this rank in megatron's order; returns the losses of
    the last virtual stage ([] elsewhere)."""
    chunks, m = len(stage.chunks), len(micro_batches)
    warmup, table = virtual_steps(pipe.stage, pipe.stages, chunks, m)
    io = Transfers(pipe, chunks)
    live: dict[int, list] = {c: [] for c in range(chunks)}  # per chunk, FIFO of (mb, x, y)
    losses = []

    def forward(k: int) -> None:
        mb, c = table[k]
        x = io.input(mb, c)
        y = engine(**micro_batches[mb], hidden=x, chunk=c)
        live[c].append((mb, x, y))
        if stage.chunks[c].post_process:
            losses.append(y.detach())
        else:
            io.output(y, mb, c)

    def backward(k: int) -> None:
        c = chunks - 1 - table[k][1]
        mb, x, y = live[c].pop(0)
        g = io.output_grad(mb, c)
        engine.backward(y if g is None else (y * g).sum(), scale_wrt_gas=g is None)
        io.input_grad(x.grad if x is not None else None, mb, c)

    total = m * chunks
    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(k + warmup)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    io.finish()
    return losses
