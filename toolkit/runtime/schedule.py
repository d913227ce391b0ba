"""One optimizer step: forward and backward of every micro-batch, then DeepSpeed's step.

pp = 1: DeepSpeed's own accumulation (``engine.backward`` and ``engine.step`` per
micro-batch; DeepSpeed reduces at the accumulation boundary).

pp > 1: megatron-core's non-interleaved 1F1B order (warm-up forwards, steady one-forward-
one-backward, cool-down backwards), with point-to-point transfers over the pipeline group
on any backend (megatron's own schedules allocate on "cuda"). A non-last stage
backpropagates the gradient g received for its output y with
``engine.backward((y * g).sum(), scale_wrt_gas=False)``: the gradient of that scalar with
respect to the stage's weights is exactly the vector-Jacobian product, and g already holds
the 1/accumulation factor the last stage's ``engine.backward(loss)`` applied. DeepSpeed's
accumulation boundary is held off during the micro-batches and set after the flush, when
the tied-embedding gradients of first and last stage are summed (toolkit.runtime.grads),
then DeepSpeed reduces over data parallel and steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import grads


def aux_loss_scale(engine, micro_batches: int) -> None:
    """megatron's MoE auxiliary loss injects its gradient in backward with this factor;
    the main loss is divided by the accumulation steps (and multiplied by the fp16 loss
    scale) by engine.backward, so the auxiliary gradient must be too."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = float(getattr(engine.optimizer, "loss_scale", 1.0)) if engine.fp16_enabled() else 1.0
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale / micro_batches, device=engine.device))


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


def train_step(engine, stage, micro_batches: list[dict], samples: int, pipe=None) -> list[float]:
    """Run one step of `samples` samples (the global batch: the learning-rate schedule's
    increment); returns the last stage's micro-batch losses ([] on other stages)."""
    aux_loss_scale(engine, len(micro_batches))
    lr_kwargs = {"increment": samples}
    if pipe is None:
        losses = []
        for mb in micro_batches:
            loss = engine(**mb)
            engine.backward(loss)
            engine.step(lr_kwargs=lr_kwargs)
            losses.append(loss.detach())
        return [float(x) for x in losses]
    engine.set_gradient_accumulation_boundary(False)
    losses = one_f_one_b(engine, stage, micro_batches, pipe)
    engine.set_gradient_accumulation_boundary(True)
    tied = grads.tied_embedding_weight([stage.chunk])
    grads.allreduce_tied_embedding_grad(tied, accumulated_grad(engine, tied) if tied is not None else None)
    engine.allreduce_gradients()
    engine.step(lr_kwargs=lr_kwargs)
    return losses


class Pipe:
    """Point-to-point transfers of [s_local, b, h] activations and their gradients."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        from megatron.core import parallel_state as ps

        self.shape, self.dtype, self.device = shape, dtype, device
        self.group = ps.get_pipeline_model_parallel_group()
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.prev = None if first else ps.get_pipeline_model_parallel_prev_rank()
        self.next = None if last else ps.get_pipeline_model_parallel_next_rank()

    def exchange(self, send: torch.Tensor | None, to: int | None, recv_from: int | None) -> torch.Tensor | None:
        """Send to one neighbour and receive from one (either may be None) in one batch,
        so two stages exchanging at the same time cannot deadlock."""
        ops, buf = [], None
        if recv_from is not None:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, recv_from, self.group))
        if send is not None and to is not None:
            ops.append(dist.P2POp(dist.isend, send.detach().contiguous(), to, self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return buf

    def recv_forward(self):
        x = self.exchange(None, None, self.prev)
        return x.requires_grad_() if x is not None else None

    def send_forward_recv_backward(self, y):
        return self.exchange(y if self.next is not None else None, self.next, self.next)

    def send_backward_recv_forward(self, gx):
        x = self.exchange(gx, self.prev, self.prev)
        return x.requires_grad_() if x is not None else None


def _forward(engine, mb: dict, x):
    return engine(**mb, hidden=x)


def _backward(engine, stage, x, y, g):
    if stage.is_last:
        engine.backward(y)
    else:
        engine.backward((y * g).sum(), scale_wrt_gas=False)
    return x.grad if x is not None else None


def one_f_one_b(engine, stage, micro_batches: list[dict], pipe: Pipe) -> list[float]:
    """megatron-core's forward_backward_pipelining_without_interleaving, step for step."""
    from megatron.core import parallel_state as ps

    m = len(micro_batches)
    warmup = min(ps.get_pipeline_model_parallel_world_size() - ps.get_pipeline_model_parallel_rank() - 1, m)
    live, losses = [], []

    def fwd(i, x):
        y = _forward(engine, micro_batches[i], x)
        live.append((x, y))
        if stage.is_last:
            losses.append(float(y.detach()))
        return y

    for i in range(warmup):
        fwd(i, pipe.recv_forward())
        pipe.exchange(live[-1][1] if pipe.next is not None else None, pipe.next, None)
    x = pipe.recv_forward() if m > warmup else None
    for i in range(warmup, m):
        g = pipe.send_forward_recv_backward(fwd(i, x))
        gx = _backward(engine, stage, *live.pop(0), g)
        x = pipe.send_backward_recv_forward(gx) if i < m - 1 else pipe.exchange(gx, pipe.prev, None)
    for _ in range(warmup):
        g = pipe.exchange(None, None, pipe.next)
        pipe.exchange(_backward(engine, stage, *live.pop(0), g), pipe.prev, None)
    return losses
