"""megatron-core's pipeline schedules, run with DeepSpeed's engine on any backend.

Order: non-interleaved 1F1B (one model chunk per rank) or interleaved 1F1B (vpp chunks) from
megatron's own arithmetic: ``get_pp_rank_microbatches``' warm-up count and
``get_schedule_table`` (which micro-batch and chunk each virtual step runs;
``microbatch_group_size_per_vp_stage`` = pp), so every rank runs its forwards and backwards in
megatron's order. Megatron's schedule functions themselves allocate on "cuda" and run
megatron's forward and backward steps, not DeepSpeed's engine; their communication is
followed here call for call.

Communication: the calls megatron-core's schedules make on its P2PCommunicator, at the same
points (``forward_backward_pipelining_without_interleaving``; with interleaving
``forward_backward_pipelining_with_interleaving`` without ``overlap_p2p_comm``, its receive
decisions ``recv_tensor_from_previous_stage``), each as its ``_communicate`` runs them with
``batch_p2p_comm`` (megatron's default): one ``batch_isend_irecv`` of the call's sends and
receives, all waited for before the schedule goes on. NCCL ignores tags and runs the messages
between two ranks in the order they are posted, a send finishing only when the peer's receive
runs: the k-th send of each directed pair has to meet the k-th receive, which megatron's calls
guarantee (tests/toolkit/runtime/test_pipeline.py replays every schedule the planner proposes at small
sizes under those rules, against megatron-core's own schedule functions). One change inside a
call: megatron lists send_prev, recv_prev, send_next, recv_next; here activations go first
(send_next, recv_prev, send_prev, recv_next). From pp = 3 on a call carries at most one message
per directed pair, so the two are the same exchange; at pp = 2 with vpp > 1 previous and next
stage are the same rank and megatron's order would post the gradient before the activation to
a peer that receives the activation first (the messages cross; Megatron-LM refuses pp = 2 with
the interleaved schedule unless overlap_p2p_comm). Activations first, both ranks list the
pair's two messages in the same order.

Memory: what megatron keeps, as Megatron-LM runs it (``deallocate_pipeline_outputs``): per chunk
the inputs and outputs of the micro-batches in flight (megatron's input_tensors and
output_tensors), the activations received ahead of their forward and the gradients ahead of
their backward; nothing sent outlives its call, and a sent output keeps only its autograd node
(megatron's ``deallocate_output_tensor`` replaces its data by one element). A chunk that is not
the last virtual stage backpropagates the gradient g received for its output y through
``engine.backward(_OutputGrad(y, g), scale_wrt_gas=False)``: a scalar whose backward hands g
to y's node without reading y (megatron calls the autograd engine directly instead,
``custom_backward``, which bypasses DeepSpeed's engine), so the weight gradient is exactly the
vector-Jacobian product; g already holds the 1/accumulation factor the last stage's
``engine.backward(loss)`` applied.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..parallel.pipeline import warmup_forwards

Step = Callable[[int, "torch.Tensor | None"], "torch.Tensor | None"]  # virtual step k, received -> to send


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


class P2P:
    """One rank's exchanges with its neighbours in the pipeline ring (global ranks, as
    megatron's P2PCommunicator: the last stage's next is the first)."""

    def __init__(self, pipe):
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        s, n = pipe.stage, pipe.stages
        self.pipe, self.prev, self.next = pipe, pipe.ranks[(s - 1) % n], pipe.ranks[(s + 1) % n]
        self.free = deallocate_output_tensor

    def __call__(self, *, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
                 recv_prev: bool = False, recv_next: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """megatron's ``_communicate``: returns (activation from prev, gradient from next);
        the sent activation's data is freed once sent (``deallocate_output_tensor``)."""
        x = self._buffer(requires_grad=True) if recv_prev else None
        g = self._buffer() if recv_next else None
        ops = [("send_next", self.next, send_next), ("recv_prev", self.prev, x),
               ("send_prev", self.prev, send_prev), ("recv_next", self.next, g)]
        ops = [op for op in ops if op[2] is not None]
        if ops:
            self.post(ops)
        self.free(send_next, deallocate_pipeline_outputs=True)
        return x, g

    def _buffer(self, requires_grad: bool = False) -> torch.Tensor:
        p = self.pipe
        return torch.empty(p.shape, dtype=p.dtype, device=p.device, requires_grad=requires_grad)

    def post(self, ops: list[tuple[str, int, torch.Tensor]]) -> None:
        """One batch of (role, global peer rank, tensor), every request waited for."""
        batch = [dist.P2POp(dist.isend if role.startswith("send") else dist.irecv, t.detach().contiguous(), peer,
                            self.pipe.group) for role, peer, t in ops]
        for work in dist.batch_isend_irecv(batch):
            work.wait()


class _OutputGrad(torch.autograd.Function):
    """A scalar standing for sum(y * g): its backward hands g (times the incoming gradient,
    DeepSpeed's loss scale) to y's autograd node without reading y, whose data may be freed;
    the engine checks g against the shape y had when it was made."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g)
        return torch.zeros((), dtype=g.dtype, device=g.device)

    @staticmethod
    def backward(ctx, scale: torch.Tensor) -> tuple[torch.Tensor, None]:
        (g,) = ctx.saved_tensors
        return g * scale, None


def run_pipeline(engine, stage, micro_batches: list[dict], pipe, p2p: P2P | None = None) -> list[torch.Tensor]:
    """Every forward and backward of this rank in megatron's order with megatron's exchanges;
    returns the losses of the last virtual stage ([] elsewhere)."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    chunks, m = len(stage.chunks), len(micro_batches)
    table = get_schedule_table(m, chunks, pipe.stages)
    live: list[list] = [[] for _ in range(chunks)]  # per chunk, FIFO of (input, output) in flight
    losses = []

    def forward(k: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """Virtual step k's forward; its output to send, None on the last virtual stage."""
        mb, c = table[k]
        y = engine(**micro_batches[mb], hidden=x, chunk=c)
        live[c].append((x, y))
        if stage.chunks[c].post_process:
            losses.append(y.detach())
            return None
        return y

    def backward(k: int, g: torch.Tensor | None) -> torch.Tensor | None:
        """Virtual step k's backward; its input's gradient to send, None on the first virtual stage."""
        x, y = live[chunks - 1 - table[k][1]].pop(0)
        engine.backward(y if g is None else _OutputGrad.apply(y, g), scale_wrt_gas=g is None)
        return None if x is None else x.grad

    p2p = p2p or P2P(pipe)
    warmup = warmup_forwards(pipe.stages, chunks, pipe.stage, micro_batches=m)  # the planner's count
    if chunks == 1:
        one_f_one_b(p2p, forward, backward, pipe.stage, pipe.stages, m, warmup)
    else:
        interleaved(p2p, forward, backward, pipe.stage, pipe.stages, chunks, table, warmup)
    return losses


def one_f_one_b(p2p: P2P, forward: Step, backward: Step, s: int, n: int, m: int, warmup: int) -> None:
    """The exchanges of megatron's ``forward_backward_pipelining_without_interleaving``:
    recv_forward / send_forward in the warm-up, send_forward_recv_backward and
    send_backward_recv_forward around each steady backward, recv_backward / send_backward
    in the cool-down."""
    first, last = s == 0, s == n - 1
    for k in range(warmup):
        x, _ = p2p(recv_prev=not first)
        p2p(send_next=forward(k, x))
    x = p2p(recv_prev=not first)[0] if warmup < m else None
    steady = m - warmup
    for i in range(steady):
        _, g = p2p(send_next=forward(warmup + i, x), recv_next=not last)
        x, _ = p2p(send_prev=backward(i, g), recv_prev=not first and i < steady - 1)
    for i in range(steady, m):
        _, g = p2p(recv_next=not last)
        p2p(send_prev=backward(i, g))


def received_chunk(k: int, forward: bool, s: int, n: int, chunks: int, table: list[tuple[int, int]]) -> int | None:
    """The chunk the tensor received in exchange k goes to, None when none is received:
    megatron's ``recv_tensor_from_previous_stage``. The leading stage (the first in forward,
    the last in backward) receives from the other end of the ring, which runs pp - 1 virtual
    steps behind; the last chunk of the ending stage sends nothing around the ring."""
    total = len(table)

    def chunk(j: int) -> int:
        c = table[j % total][1]
        return c if forward else chunks - 1 - c

    if s != (0 if forward else n - 1):
        return chunk(k + 1)
    if k < n - 1:
        return None
    c = chunk(k - (n - 1))
    if c == (chunks - 1 if forward else 0):
        return None
    return c + 1 if forward else c - 1


def interleaved(p2p: P2P, forward: Step, backward: Step, s: int, n: int, chunks: int,
                table: list[tuple[int, int]], warmup: int) -> None:
    """The exchanges of megatron's ``forward_backward_pipelining_with_interleaving`` without
    overlap_p2p_comm: each virtual step computes, then sends what it produced and receives what
    a later step needs (send_forward_recv_forward in the warm-up, whose last step also receives
    the first gradient; send_forward_backward_recv_forward_backward in the steady state;
    send_backward_recv_backward in the cool-down)."""
    total, first, last = len(table), s == 0, s == n - 1
    inputs: list[list] = [[] for _ in range(chunks)]  # received ahead of their forward
    grads: list[list] = [[] for _ in range(chunks)]  # received ahead of their backward

    def fwd(k: int) -> torch.Tensor | None:
        c = table[k][1]
        return forward(k, None if first and c == 0 else inputs[c].pop(0))

    def bwd(k: int) -> torch.Tensor | None:
        c = chunks - 1 - table[k][1]
        return backward(k, None if last and c == chunks - 1 else grads[c].pop(0))

    def keep(into: list[list], c: int | None, t: torch.Tensor | None) -> None:
        if c is not None:
            into[c].append(t)

    if not first:
        inputs[0].append(p2p(recv_prev=True)[0])
    for k in range(warmup):
        y = fwd(k)
        c = received_chunk(k, True, s, n, chunks, table) if k < total - 1 else None
        if k == warmup - 1 and warmup < total:
            x, g = p2p(send_next=y, recv_prev=c is not None, recv_next=not last)
            keep(grads, None if last else chunks - 1, g)
        else:
            x, _ = p2p(send_next=y, recv_prev=c is not None)
        keep(inputs, c, x)
    steady = total - warmup
    for k in range(steady):
        y, gx = fwd(warmup + k), bwd(k)
        cf = received_chunk(warmup + k, True, s, n, chunks, table) if k < steady - 1 else None
        cb = received_chunk(k, False, s, n, chunks, table)
        x, g = p2p(send_next=y, send_prev=gx, recv_prev=cf is not None, recv_next=cb is not None)
        keep(inputs, cf, x)
        keep(grads, cb, g)
    if steady == 0 and not last:
        grads[chunks - 1].append(p2p(recv_next=True)[1])
    for k in range(steady, total):
        cb = received_chunk(k, False, s, n, chunks, table) if k < total - 1 else None
        _, g = p2p(send_prev=bwd(k), recv_next=cb is not None)
        keep(grads, cb, g)
