"""A Hugging Face model's loss on prepared chat data, as the runtime counts it: the mean
cross-entropy per assistant token (``toolkit data prepare``'s PREFIX.mask), each conversation
on its own (no packing: the runtime's packed attention never crosses a conversation, so the
sum is the same). What checks an exported model or adapter against the run that made it."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import MissingInputError, SpecError
from ..runtime.chat_data import MASK


def assistant_loss(model: torch.nn.Module, prefix: str | Path, conversations: Iterable[int]) -> tuple[float, int]:
    """(mean loss per assistant token, assistant tokens) of ``model`` (transformers or peft) over
    the conversations (indices into PREFIX) in float64 sums."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not Path(f"{prefix}{MASK}.idx").is_file():
        raise MissingInputError(f"no chat data at '{prefix}' (expected {prefix}.bin/.idx and {prefix}{MASK}.bin/.idx "
                                "from `toolkit data prepare` of conversations)")
    ids, masks = IndexedDataset(str(prefix)), IndexedDataset(f"{prefix}{MASK}")
    total = count = 0.0
    with torch.no_grad():
        for c in conversations:
            x, m = torch.from_numpy(ids[c].astype("int64")), torch.from_numpy(masks[c].astype("float64"))
            logits = model(input_ids=x[None, :-1]).logits[0].double()
            total += float((torch.nn.functional.cross_entropy(logits, x[1:], reduction="none") * m[1:]).sum())
            count += float(m[1:].sum())
    if not count:
        raise SpecError(f"the conversations chosen from '{prefix}' hold no assistant token")
    return total / count, int(count)
