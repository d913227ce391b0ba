"""The runtime's view of chat data (toolkit.runtime.chat_data): samples of seq_len positions
with the loss on the assistant tokens only.

Conversations are read with megatron-core's IndexedDataset (tokens and PREFIX.mask) and
shuffled once with the run's seed; sample i of the run is sample i mod epoch, as for
pretraining data. A conversation of L tokens fills L - 1 positions (inputs ids[:-1],
labels ids[1:], loss mask mask[1:]); the rest of a sequence is padding (EOD tokens, no loss).

data.packing puts several conversations in one sequence: in the shuffled order, each goes
into the current sequence while it fits, else starts the next (order kept, so a run's
conversations come in the same order packed or not). ``segments`` numbers the conversations of
a sequence (the padding is one more): attention never crosses a segment
(toolkit.runtime.packing), and positions restart at 0 in each.
"""
from __future__ import annotations

from pathlib import Path

import numpy
import torch

from ..errors import MissingInputError, SpecError
from .chat_data import MASK


def pack(lengths: numpy.ndarray, order: numpy.ndarray, seq_len: int) -> list[list[int]]:
    """Conversations (indices into lengths, in `order`) grouped into sequences of at most
    seq_len positions, each conversation taking its length - 1."""
    packs, current, used = [], [], 0
    for i in order.tolist():
        n = int(lengths[i]) - 1
        if current and used + n > seq_len:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(current)
    return packs


def fills(lengths: numpy.ndarray, seq_len: int) -> tuple[float, float]:
    """(packed, unpacked): the share of a sequence's positions that hold a conversation, the
    conversations in file order. A run's shuffle packs a little differently: examples/chat.jsonl at
    seq_len 64 fills 76.1% in file order, 74.1-77.6% in the orders of seeds 1234, 1, 2, 3. What the
    plan's tokens/s is multiplied by (data.fill)."""
    positions = int(lengths.sum()) - len(lengths)
    packed = len(pack(lengths, numpy.arange(len(lengths)), seq_len))
    return positions / (packed * seq_len), positions / (len(lengths) * seq_len)


class ChatDataset:
    """Samples as the Stage module's keyword arguments (toolkit.runtime.data.BATCH_KEYS, and
    `segments` when packing), each [seq_len]. The loss is per token over the global batch
    (toolkit.runtime.data.per_token_denominator), as Megatron-LM's SFT."""

    per_token_loss = True

    def __init__(self, prefix: str | Path, seq_len: int, seed: int, packing: bool, eod: int):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        for s in (".bin", ".idx"):
            if not Path(f"{prefix}{MASK}{s}").is_file():
                raise MissingInputError(f"chat dataset '{prefix}' has no loss mask '{prefix}{MASK}{s}' (prepare it "
                                        "again with `toolkit data prepare`)")
        self.tokens, self.mask = IndexedDataset(str(prefix)), IndexedDataset(f"{prefix}{MASK}")
        lengths = self.tokens.sequence_lengths
        longest = int(lengths.max())
        if longest > seq_len + 1:
            raise SpecError(f"dataset '{prefix}' holds a conversation of {longest} tokens, longer than "
                            f"batch.seq_len + 1 = {seq_len + 1}: prepare it with `toolkit data prepare "
                            f"--seq-len {seq_len}` (truncate or drop)")
        order = numpy.random.RandomState(seed).permutation(len(lengths))
        self.samples = pack(lengths, order, seq_len) if packing else [[int(i)] for i in order]
        self.seq_len, self.packing, self.eod = seq_len, packing, eod
        self.positions = int(sum(int(n) - 1 for n in lengths))
        self.sample_positions = [sum(int(lengths[c]) - 1 for c in s) for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def tokens_in(self, first: int, count: int) -> int:
        """Positions holding a conversation in samples [first, first + count) of the run (what
        the run's tokens/s counts: padding is not training)."""
        return sum(self.sample_positions[i % len(self.samples)] for i in range(first, first + count))

    @property
    def fill(self) -> float:
        """Positions holding a conversation / all positions of an epoch (packing efficiency)."""
        return self.positions / (len(self.samples) * self.seq_len)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.seq_len
        tokens = numpy.full(s, self.eod, dtype=numpy.int64)
        labels = numpy.full(s, self.eod, dtype=numpy.int64)
        loss_mask = numpy.zeros(s, dtype=numpy.float32)
        positions = numpy.arange(s, dtype=numpy.int64)
        segments = numpy.zeros(s, dtype=numpy.int64)
        at = 0
        for k, c in enumerate(self.samples[i]):
            ids, mask = self.tokens[c].astype(numpy.int64), self.mask[c]
            n = len(ids) - 1
            tokens[at:at + n], labels[at:at + n], loss_mask[at:at + n] = ids[:-1], ids[1:], mask[1:]
            positions[at:at + n], segments[at:at + n] = numpy.arange(n), k
            at += n
        positions[at:] = numpy.arange(s - at)
        segments[at:] = len(self.samples[i])
        out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions}
        if self.packing:
            out["segments"] = segments
        return {k: torch.from_numpy(v) for k, v in out.items()}
