"""Ring attention (cp_comm_type "p2p"): each rank keeps its queries, the K/V of every rank pass
around the ring once, and the softmax is merged online by log-sum-exp; the backward passes
K/V around again with their partial gradients travelling beside them, so no rank ever holds
more than two ranks' K/V (forward and backward are exact, not autograd through the ring).

Shapes on a rank: q [sq, b, np, d]; k, v [sk, b, ng, d] with np = ng * rep (GQA: query head h
reads key head h // rep, as megatron's repeat_interleave); output [sq, b, np, d]. Inside,
q is viewed [b, ng, rep, sq, d] so grouped heads need no copy of K/V. Scores, softmax,
merge and gradients are fp32 for fp32/bf16/fp16 inputs (as flash/TE kernels accumulate; fp64
stays fp64); K/V travel in the input dtype, their gradients in the accumulation dtype.

Masking is megatron's: scores are scaled, masked positions set to -10000, then softmax. The
held sequences are lists of `chunk`-token chunks; when the mask comes from positions (causal
or sliding window, where every query sees itself) a (query chunk, key chunk) pair whose
scores are all masked is skipped. With megatron's chunk layout this is TE's load balance:
at ring step i > 0 a rank computes half of the pairs, the same on every rank.

Which pairs to skip and which need their mask is decided on the host once (``pair_schedule``:
two host reads of a mask per pair), not in every layer's forward and backward: masks from
positions are the same at every call, so the caller keeps the schedule; a mask given as data
is applied to every pair without being read (masked_fill with no True entry changes nothing,
so the result is bit for bit the one a skipped fill gives).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .cp_comm import ring_pass, ring_shift

MASKED = -10000.0  # megatron.core.transformer.utils.attention_mask_func


Pair = tuple[slice, slice, bool]  # query rows, key rows, whether some score of the pair is masked


@dataclass(frozen=True)
class RingPlan:
    """What a ring needs besides q/k/v: the group, the softmax scale (megatron's softmax_scale
    times its layer-scaling coefficient), the global positions of every ring rank's keys
    (`peer_positions[j]` [sk]), `masked(q_rows, k_pos)` -> bool [B|1, 1, |q_rows|, |k_pos|] or
    None (True = masked) for the held queries `q_rows` (a slice), and the chunk pairs to compute
    for each ring rank's keys (``pair_schedule`` or ``every_pair``)."""
    group: object
    scale: float
    peer_positions: tuple[Tensor, ...]
    masked: Callable[[slice, Tensor], Tensor | None]
    schedule: tuple[tuple[Pair, ...], ...]

    def pairs(self, src: int) -> Iterator[tuple[slice, slice, Tensor | None]]:
        """(query rows, key rows, mask or None) of every scheduled chunk pair, for the keys of
        ring rank `src`; no host read."""
        k_pos = self.peer_positions[src]
        for rows, cols, partly_masked in self.schedule[src]:
            yield rows, cols, (self.masked(rows, k_pos[cols]) if partly_masked else None)


def _chunks(n: int, chunk: int) -> list[slice]:
    return [slice(i * chunk, (i + 1) * chunk) for i in range(n // chunk)]


def every_pair(sq: int, peer_sizes: list[int], chunk: int) -> tuple[tuple[Pair, ...], ...]:
    """Every chunk pair, each with its mask applied: for a mask given as data (never read)."""
    return tuple(tuple((r, c, True) for r in _chunks(sq, chunk) for c in _chunks(n, chunk)) for n in peer_sizes)


def pair_schedule(sq: int, peer_positions: tuple[Tensor, ...], chunk: int,
                  masked: Callable[[slice, Tensor], Tensor | None]) -> tuple[tuple[Pair, ...], ...]:
    """The chunk pairs with a visible score for a mask from positions, and whether each needs its
    mask. Reads each pair's mask on the host (all, any): build it once and keep it."""
    out = []
    for k_pos in peer_positions:
        pairs = []
        for rows in _chunks(sq, chunk):
            for cols in _chunks(k_pos.numel(), chunk):
                mask = masked(rows, k_pos[cols])
                if mask is None:
                    pairs.append((rows, cols, False))
                elif not bool(mask.all()):
                    pairs.append((rows, cols, bool(mask.any())))
        out.append(tuple(pairs))
    return tuple(out)


def _acc(t: Tensor) -> Tensor:
    """`t` in the accumulation dtype: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _q5(q: Tensor, groups: int) -> Tensor:
    """[sq, b, np, d] -> [b, ng, rep, sq, d] (accumulation dtype)."""
    sq, b, heads, d = q.shape
    return _acc(q.reshape(sq, b, groups, heads // groups, d).permute(1, 2, 3, 0, 4))


def _from_q5(x: Tensor) -> Tensor:
    """[b, ng, rep, sq, d] -> [sq, b, np, d]."""
    b, g, rep, sq, d = x.shape
    return x.permute(3, 0, 1, 2, 4).reshape(sq, b, g * rep, d)


def _k4(k: Tensor) -> Tensor:
    """[sk, b, ng, d] -> [b, ng, sk, d] (accumulation dtype)."""
    return _acc(k.permute(1, 2, 0, 3))


def _scores(q5: Tensor, k4: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    s = torch.einsum("bgrqd,bgkd->bgrqk", q5, k4) * scale
    return s if mask is None else s.masked_fill(mask.unsqueeze(2), MASKED)


def block_forward(q5, k4, v4, mask, scale) -> tuple[Tensor, Tensor]:
    """Softmax attention of one block: output [b, ng, rep, sq, d] and its log-sum-exp [.., sq]."""
    s = _scores(q5, k4, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bgrqk,bgkd->bgrqd", torch.exp(s - lse.unsqueeze(-1)), v4), lse


def block_backward(q5, k4, v4, mask, scale, lse, do5, delta) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the final log-sum-exp and delta = rowsum(dO * O):
    dS = P * (dP - delta), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO."""
    p = torch.exp(_scores(q5, k4, mask, scale) - lse.unsqueeze(-1))
    dv = torch.einsum("bgrqk,bgrqd->bgkd", p, do5)
    ds = p * (torch.einsum("bgrqd,bgkd->bgrqk", do5, v4) - delta.unsqueeze(-1)) * scale
    return (torch.einsum("bgrqk,bgkd->bgrqd", ds, k4), torch.einsum("bgrqk,bgrqd->bgkd", ds, q5), dv)


class RingAttention(torch.autograd.Function):
    """out [sq, b, np, dv] = softmax attention of the held queries over every ring rank's keys.
    K and V travel as one tensor [sk, b, ng, dk + dv] (multi-latent attention has dv != dk)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: RingPlan) -> Tensor:
        groups, dk = k.size(2), k.size(-1)
        q5 = _q5(q, groups)
        out = q5.new_zeros((*q5.shape[:-1], v.size(-1)))
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=q5.dtype, device=q5.device)
        for src, kv in ring_pass(torch.cat([k, v], dim=-1), plan.group):
            for rows, cols, mask in plan.pairs(src):
                o, l = block_forward(q5[..., rows, :], _k4(kv[cols, ..., :dk]), _k4(kv[cols, ..., dk:]), mask,
                                     plan.scale)
                new = torch.logaddexp(lse[..., rows], l)
                out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows] - new).unsqueeze(-1)
                                     + o * torch.exp(l - new).unsqueeze(-1))
                lse[..., rows] = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return _from_q5(out).to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        plan, groups, dk = ctx.plan, k.size(2), k.size(-1)
        q5, do5 = _q5(q, groups), _q5(dout, groups)
        delta = (do5 * out).sum(-1)
        dq = torch.zeros_like(q5)
        dkv = _acc(torch.zeros((*k.shape[:-1], dk + v.size(-1)), dtype=k.dtype, device=k.device))
        for src, kv in ring_pass(torch.cat([k, v], dim=-1), plan.group):
            for rows, cols, mask in plan.pairs(src):
                gq, gk, gv = block_backward(q5[..., rows, :], _k4(kv[cols, ..., :dk]), _k4(kv[cols, ..., dk:]),
                                            mask, plan.scale, lse[..., rows], do5[..., rows, :], delta[..., rows])
                dq[..., rows, :] += gq
                dkv[cols, ..., :dk] += gk.permute(2, 0, 1, 3)
                dkv[cols, ..., dk:] += gv.permute(2, 0, 1, 3)
            # the partial dK/dV follow their K/V to the next rank; after the last step they are home
            dkv = ring_shift(dkv, plan.group)
        return _from_q5(dq).to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, plan: RingPlan) -> Tensor:
    return RingAttention.apply(q, k, v, plan)
