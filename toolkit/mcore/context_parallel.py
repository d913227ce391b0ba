"""Context parallelism without TransformerEngine: an exact core attention for megatron-core's
local layer spec, on CPU (gloo) and on CUDA.

Why: the local spec (``get_gpt_layer_local_spec``, ``get_gpt_decoder_block_spec(...,
use_transformer_engine=False)``) uses ``DotProductAttention`` as core attention, and it asserts
context_parallel_size == 1: only TE's attention splits the sequence. ``ContextParallelAttention``
is a DotProductAttention (same constructor, forward signature, state dict) that also runs at
cp > 1; ``context_parallel_spec`` swaps it into a layer spec. At cp = 1 its forward IS
DotProductAttention's. With TE on CUDA, megatron's TE spec does the same job: use that.

At cp > 1, on each cp rank: query [s/cp, b, np, d], key and value [s/cp, b, ng, d] (np, ng: the
heads and query groups of this tp rank), tokens in megatron's layout (cp_comm.py: chunks r and
2cp-1-r of 2cp; megatron's RotaryEmbedding has already rotated q and k for their global
positions); output [s/cp, b, np*d]. Masks follow global positions. ``cp_comm_type``:

  p2p          ring: K/V pass around the cp group once, softmax merged by log-sum-exp in fp32
               (cp_ring.py); holds two ranks' K/V; with causal masks every rank skips half
               the chunk pairs (TE's load balance). Default (megatron's default is p2p too).
  all_gather   K/V all-gathered (backward: gradients reduce-scattered), then megatron's own
               (allgather) math on [s/cp queries x s keys]; holds the full K/V.
  a2a          Ulysses: DeepSpeed's DistributedAttention all-to-alls q/k/v from sequence- to
               head-sharded ([s, b, np/cp, d]), megatron's math over the whole sequence, and
               back. np and ng divisible by cp; needs deepspeed.comm initialised.
  a2a+p2p      a2a in the first level of megatron's hierarchical cp groups
               (hierarchical_context_parallel_sizes [a, p], a*p = cp), the ring over the second.

The attention mask is None (then the mask type decides: causal by global position, or
config.window_size's sliding window as megatron's local attention builds it) or megatron's cp
form of a full boolean mask (True = masked): [b|1, 1, s, s] with its rows sliced by
get_batch_on_this_cp_rank, i.e. [b|1, 1, s/cp, s], columns in global order. Refused at cp > 1:
softmax_type other than vanilla, attention dropout with p2p, packed sequences, attention bias.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from ..errors import SpecError, ToolkitError, closest
from .cp_comm import all_gather_seq, gather_seq, local_positions, member_cp_ranks
from .cp_ring import RingPlan, every_pair, pair_schedule, ring_attention
from .spec_swap import swap_module

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
ALIASES = {"allgather": "all_gather"}  # Megatron-LM's --help spelling; megatron-core and TE say all_gather


def comm_type(name: str | None) -> str:
    """megatron's cp_comm_type (None: p2p), checked; 'allgather' is read as 'all_gather'."""
    name = ALIASES.get(name or "p2p", name or "p2p")
    if name not in COMM_TYPES:
        hint = closest(name, COMM_TYPES)
        raise SpecError(f"cp_comm_type {name!r} is not one of {', '.join(COMM_TYPES)}"
                        + (f" (did you mean {hint!r}?)" if hint else ""))
    return name


def context_parallel_spec(spec):
    """`spec` (a layer or decoder-block spec) with ContextParallelAttention as core attention."""
    return swap_module(spec, DotProductAttention, ContextParallelAttention)


def _with(config, **fields):
    """A shallow copy of a TransformerConfig with `fields` set (no re-validation)."""
    config = copy.copy(config)
    for k, v in fields.items():
        setattr(config, k, v)
    return config


@dataclass(frozen=True)
class Visibility:
    """Which keys the held queries see, by global position; megatron's rules (FusedScaleMask-
    Softmax): a sliding window replaces any mask, else the given mask, else causal if the mask
    type is causal. `rows`: the caller's mask rows of the held queries [B|1, 1, sq, s]."""
    q_pos: Tensor
    rows: Tensor | None
    causal: bool
    window: tuple[int, int] | None

    def masked(self, q: slice, k_pos: Tensor) -> Tensor | None:
        """bool [B|1, 1, |q|, |k_pos|], True = masked; None = nothing masked."""
        if self.window is not None:  # megatron's get_sliding_window_causal_mask, sq == sk
            d = k_pos[None, :] - self.q_pos[q, None]
            return ~((d >= -self.window[0]) & (d <= self.window[1]))[None, None]
        if self.rows is not None:
            return self.rows[:, :, q][..., k_pos]
        if self.causal:
            return (k_pos[None, :] > self.q_pos[q, None])[None, None]
        return None

    def regrouped(self, q_pos: Tensor, group) -> Visibility:
        """The rules for the queries of all ranks of `group` in its rank order (after an all-to-all)."""
        return replace(self, q_pos=q_pos, rows=None if self.rows is None else gather_seq(self.rows, group, dim=2))


class ContextParallelAttention(DotProductAttention):
    """megatron's DotProductAttention, also at context_parallel_size > 1 (see the module doc)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **channels):
        # DotProductAttention refuses cp > 1 by reading the config: it is given a copy at cp = 1;
        # `channels`: multi-latent attention's k_channels / v_channels (cpu_compat.local_mla)
        super().__init__(_with(config, context_parallel_size=1), layer_number, attn_mask_type, attention_type,
                         attention_dropout, softmax_scale, cp_comm_type, pg_collection, **channels)
        self.config = config
        self.cp_size = config.context_parallel_size
        if self.cp_size == 1:
            return
        self.cp_comm_type = comm_type(cp_comm_type)
        self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        self._check(config)
        # masks, the window's included, are built from global positions here and always given to
        # the softmax, whose own causal mask (and fused upper-triangular CUDA kernel) would be
        # by local index: it is told the mask is given ("padding"), as for a non-causal layer
        self.window = self.scale_mask_softmax.window_size
        self._mask_is_given(self)
        self._cache: dict = {}  # positions and ring schedules by sequence length and device
        if "a2a" in self.cp_comm_type:
            self.a2a_group, self.ring_group = self._a2a_groups(config, pg_collection)
            a = self.a2a_group.size()
            self._check_heads(a)
        if self.cp_comm_type == "a2a":  # megatron's math for this rank's np/cp heads
            self.heads_subset = DotProductAttention(
                _with(config, context_parallel_size=1, num_attention_heads=config.num_attention_heads // a,
                      num_query_groups=config.num_query_groups // a),
                layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale, None, pg_collection,
                **channels)
            self._mask_is_given(self.heads_subset)

    @staticmethod
    def _mask_is_given(attention: DotProductAttention) -> None:
        attention.scale_mask_softmax.window_size = None
        attention.scale_mask_softmax.attn_mask_type = AttnMaskType.padding

    def _check(self, config) -> None:
        if config.softmax_type != "vanilla":
            raise SpecError(f"context parallelism without TransformerEngine has softmax_type 'vanilla' only, "
                            f"not {config.softmax_type!r} (cp={self.cp_size})")
        if "p2p" in self.cp_comm_type and self.attention_dropout.p > 0:
            raise SpecError(f"cp_comm_type {self.cp_comm_type} has no attention dropout (attention_dropout="
                            f"{self.attention_dropout.p}): set it to 0 or use all_gather or a2a")

    def _check_heads(self, a: int) -> None:
        np_, ng = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        if np_ % a or ng % a:
            raise SpecError(f"cp_comm_type {self.cp_comm_type} splits heads over {a} ranks: heads per tp rank "
                            f"{np_} and query groups per tp rank {ng} must both be divisible by {a}")

    def _a2a_groups(self, config, pg_collection):
        """(all-to-all group, ring group): the cp group and none for a2a; megatron's hierarchical cp
        groups (level 0, level 1) for a2a+p2p."""
        if self.cp_comm_type == "a2a":
            return self.cp_group, None
        sizes = config.hierarchical_context_parallel_sizes
        groups = getattr(pg_collection, "hcp", None) or parallel_state.get_hierarchical_context_parallel_groups(
            check_initialized=False)
        if not sizes or len(sizes) != 2 or not groups or len(groups) != 2:
            raise SpecError(f"cp_comm_type a2a+p2p needs hierarchical_context_parallel_sizes [a2a, p2p] with "
                            f"product cp={self.cp_size}, in the config and in parallel_state (got {sizes})")
        return groups[0], groups[1]

    # ------------------------------------------------------------------------------------ forward
    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        """[s/cp, b, np, d] x 3 -> [s/cp, b, np*d]; at cp = 1 DotProductAttention.forward."""
        if self.cp_size == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise ToolkitError("context parallelism without TransformerEngine has no packed sequences and no "
                               "attention bias")
        vis = self._visibility(attention_mask, query.size(0), query.device)
        kind = {"p2p": self._p2p, "all_gather": self._all_gather, "a2a": self._a2a, "a2a+p2p": self._a2a_p2p}
        out = kind[self.cp_comm_type](query, key, value, vis)
        return out.reshape(query.size(0), query.size(1), -1)

    def _visibility(self, mask: Tensor | None, s_local: int, device) -> Visibility:
        if mask is not None and (mask.dim() != 4 or mask.dtype != torch.bool or mask.size(-2) != s_local
                                 or mask.size(-1) != s_local * self.cp_size):
            raise ValueError(f"at cp={self.cp_size} the attention mask is None or megatron's cp form, bool "
                             f"[b|1, 1, s/cp={s_local}, s={s_local * self.cp_size}] (get_batch_on_this_cp_rank "
                             f"slices the rows); got {mask.dtype} {tuple(mask.shape)}")
        return Visibility(self._held(s_local, device), mask, self.attn_mask_type == AttnMaskType.causal, self.window)

    def _held(self, s_local: int, device) -> Tensor:
        return local_positions(self.cp_size, self.cp_group.rank(), s_local, device)

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _cp_positions(self, s_local: int, device, ranks) -> Tensor:
        """Global positions of the tokens of cp ranks `ranks`, concatenated."""
        return self._cached(("cp", s_local, str(device), tuple(ranks)), lambda: torch.cat(
            [local_positions(self.cp_size, r, s_local, device) for r in ranks]))

    def _ring_plan(self, vis: Visibility, group, peers: tuple[Tensor, ...], chunk: int) -> RingPlan:
        """The ring's plan; its chunk pairs, for masks from positions, decided once per sequence
        length and device (host reads of the masks then, never in a step)."""
        sq = vis.q_pos.numel()
        if vis.rows is not None:  # a mask given as data: applied to every pair, never read
            schedule = every_pair(sq, [p.numel() for p in peers], chunk)
        else:
            schedule = self._cached(("pairs", sq, chunk, str(vis.q_pos.device)),
                                    lambda: pair_schedule(sq, peers, chunk, vis.masked))
        return RingPlan(group=group, scale=self.softmax_scale * (self.scale_mask_softmax.scale or 1.0),
                        peer_positions=peers, masked=vis.masked, schedule=schedule)

    def _p2p(self, q, k, v, vis: Visibility) -> Tensor:
        s, dev = q.size(0), q.device
        peers = tuple(self._cp_positions(s, dev, [r]) for r in range(self.cp_size))
        return ring_attention(q, k, v, self._ring_plan(vis, self.cp_group, peers, s // 2))

    def _all_gather(self, q, k, v, vis: Visibility) -> Tensor:
        kv = all_gather_seq(torch.cat([k, v], dim=-1), self.cp_group)  # [s, b, ng, dk + dv], one collective
        k_all, v_all = (t.contiguous() for t in kv.split([k.size(-1), v.size(-1)], dim=-1))
        k_pos = self._cp_positions(q.size(0), q.device, range(self.cp_size))
        return super().forward(q, k_all, v_all, vis.masked(slice(None), k_pos))

    def _a2a(self, q, k, v, vis: Visibility) -> Tensor:
        return self._ulysses(q, k, v, vis, self._a2a_local)

    def _a2a_local(self, q, k, v, vis: Visibility, held: Tensor) -> Tensor:
        """megatron's math on the whole sequence for np/cp heads: [s, b, np/cp, d] x 3 -> same."""
        vis = vis.regrouped(held, self.a2a_group)
        return self.heads_subset(q, k, v, vis.masked(slice(None), held)).view(*q.shape[:-1], v.size(-1))

    def _a2a_p2p(self, q, k, v, vis: Visibility) -> Tensor:
        return self._ulysses(q, k, v, vis, self._ring_local)

    def _ring_local(self, q, k, v, vis: Visibility, held: Tensor) -> Tensor:
        """The ring over the second level on the first level's gathered sequence."""
        s_local = held.numel() // self.a2a_group.size()
        peers = self._cached(("ring", s_local, str(held.device)),
                             lambda: tuple(gather_seq(held, self.ring_group).split(held.numel())))
        return ring_attention(q, k, v, self._ring_plan(vis.regrouped(held, self.a2a_group), self.ring_group,
                                                       peers, s_local // 2))

    def _ulysses(self, q, k, v, vis: Visibility, local) -> Tensor:
        """DeepSpeed's DistributedAttention over the a2a group around `local`; `held`: the global
        positions of the gathered sequence (the a2a group's ranks' tokens in its rank order)."""
        from deepspeed import comm
        from deepspeed.sequence.layer import DistributedAttention

        if not comm.is_initialized():
            raise ToolkitError(f"cp_comm_type {self.cp_comm_type} uses DeepSpeed's DistributedAttention: "
                               "initialise deepspeed.comm (deepspeed.init_distributed) first")
        held = self._cp_positions(q.size(0), q.device, member_cp_ranks(self.a2a_group, self.cp_group))
        attention = DistributedAttention(functools.partial(local, vis=vis, held=held), self.a2a_group,
                                         scatter_idx=2, gather_idx=0)
        return attention(q, k, v, 1)
