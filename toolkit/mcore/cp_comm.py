"""Communication for context-parallel attention (``context_parallel.py``): where each cp rank's
tokens sit in the sequence, and the exchanges along the sequence with exact backwards.

Layout (megatron's, ``megatron.core.utils.get_batch_on_this_cp_rank``): a sequence of s tokens
is cut into 2*cp chunks of c = s / (2cp) tokens; cp rank r holds chunks r and 2cp-1-r, so its
s/cp local tokens have the global positions [r*c, (r+1)*c) ++ [(2cp-1-r)*c, (2cp-r)*c). Pairing
an early chunk with a late one gives every rank the same causal work.

Every exchange moves dim 0 of megatron's [s, b, heads, head_dim] layout. All of them run on
gloo (CPU) and NCCL: all_gather_into_tensor, reduce_scatter_tensor and batch_isend_irecv are
all present in gloo with torch 2.13 (checked), so no fallback path exists here.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor


def local_positions(cp_size: int, cp_rank: int, s_local: int, device: torch.device | str) -> Tensor:
    """Global positions [s_local] (int64) of the tokens cp rank `cp_rank` holds, in its order."""
    if s_local % 2:
        raise ValueError(f"a cp rank holds 2 chunks: its sequence length {s_local} must be even")
    c = s_local // 2
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device),
                      torch.arange(second, second + c, device=device)])


def member_cp_ranks(sub_group, cp_group) -> list[int]:
    """cp ranks of the members of `sub_group` (a subgroup of `cp_group`), in `sub_group`'s rank
    order, which is the order in which its collectives concatenate."""
    return [dist.get_group_rank(cp_group, g) for g in dist.get_process_group_ranks(sub_group)]


def gather_seq(x: Tensor, group, dim: int = 0) -> Tensor:
    """All-gather along `dim` in `group`'s rank order, without autograd (positions, mask rows).
    bool travels as uint8 (NCCL has no bool)."""
    if group.size() == 1:
        return x
    wire = x.to(torch.uint8) if x.dtype == torch.bool else x
    wire = wire.movedim(dim, 0).contiguous()
    out = wire.new_empty((group.size() * wire.size(0), *wire.shape[1:]))
    dist.all_gather_into_tensor(out, wire, group=group)
    out = out.movedim(0, dim)
    return out.bool() if x.dtype == torch.bool else out


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0; backward reduce-scatters (sums) the gradient: every rank's queries
    read the gathered rows, so a row's gradient is the sum of all ranks' contributions, and each
    rank keeps the sum for the rows it owns. The sum is taken in fp32 (bf16 partial sums would
    add one rounding per rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        wire = grad.float().contiguous()
        out = wire.new_empty((wire.size(0) // ctx.group.size(), *wire.shape[1:]))
        dist.reduce_scatter_tensor(out, wire, group=ctx.group)
        return out.to(grad.dtype), None


def all_gather_seq(x: Tensor, group) -> Tensor:
    """[s_local, ...] -> [group.size() * s_local, ...] in rank order, differentiable."""
    return x if group.size() == 1 else _GatherSeq.apply(x, group)


def ring_start(t: Tensor, group) -> tuple[Tensor, list]:
    """Start sending `t` to the next rank of `group` and receiving the previous rank's tensor of
    the same shape; `ring_finish` waits. Batched so that gloo and NCCL pair the two in order."""
    n, r = group.size(), group.rank()
    t = t.contiguous()
    recv = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, (r + 1) % n), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % n), group)]
    return recv, dist.batch_isend_irecv(ops)


def ring_finish(recv: Tensor, works: list) -> Tensor:
    for w in works:
        w.wait()
    return recv


def ring_shift(t: Tensor, group) -> Tensor:
    """The previous rank's `t` (blocking); `t` itself on a group of one."""
    return t if group.size() == 1 else ring_finish(*ring_start(t, group))


def ring_pass(t: Tensor, group) -> Iterator[tuple[int, Tensor]]:
    """Yield (source rank, its tensor) for every rank of `group`, starting with our own: at step
    i we hold rank (r - i) mod n's tensor. The next exchange runs while the caller computes."""
    n, r = group.size(), group.rank()
    for step in range(n):
        pending = ring_start(t, group) if step < n - 1 else None
        yield (r - step) % n, t
        if pending is not None:
            t = ring_finish(*pending)
