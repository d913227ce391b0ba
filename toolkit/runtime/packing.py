"""Packed sequences (data.packing): what megatron-core's GPTModel is given so that attention
never crosses a conversation boundary.

``segments`` [b, s] numbers the conversations of each sequence (toolkit.runtime.chat_dataset).
  - megatron's local attention (CPU, attention.backend=unfused): a boolean mask [b, 1, s, s],
    True = masked out (megatron's convention, as cpu_compat.causal_mask), causal and
    block-diagonal. RoPE, the only position embedding of the supported models, makes a
    score depend on q - k alone, so a conversation at offset p inside a sequence attends
    exactly as it would alone at 0 (megatron's RoPE ignores position_ids; its positions run
    0..s-1 across the sequence, and only differences within a conversation count);
  - TransformerEngine (CUDA): megatron-core's PackedSeqParams in the THD format (cumulative
    sequence lengths), which also restarts RoPE per sequence. megatron takes THD with one
    row, so each micro-batch is one packed sequence (batch.micro 1). This path has never run
    on a GPU (no GPU here): only its parameters are checked, against the segments.
Loss normalisation per token: toolkit.runtime.engine.mean_token_loss.
"""
from __future__ import annotations

import torch


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True where query i may not see key j: j > i or another segment."""
    s = segments.shape[1]
    future = torch.triu(torch.ones(s, s, dtype=torch.bool, device=segments.device), diagonal=1)
    other = segments[:, :, None] != segments[:, None, :]
    return (future[None] | other)[:, None]


def cu_seqlens(segments: torch.Tensor) -> torch.Tensor:
    """int32 [n + 1]: where each segment of the flattened batch starts, then the total
    (segments of different rows are different sequences)."""
    flat = segments.reshape(-1)
    row_start = torch.zeros_like(flat, dtype=torch.bool)
    row_start[:: segments.shape[1]] = True
    starts = torch.nonzero(row_start | torch.cat([flat.new_ones(1, dtype=torch.bool), flat[1:] != flat[:-1]]))
    return torch.cat([starts.reshape(-1), flat.new_tensor([flat.numel()])]).to(torch.int32)


def thd_params(segments: torch.Tensor):
    """megatron-core's PackedSeqParams (qkv_format "thd") for one packed row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if segments.shape[0] != 1:
        raise ValueError(f"THD packing takes one packed sequence per micro-batch, got {segments.shape[0]}")
    cu = cu_seqlens(segments)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)
