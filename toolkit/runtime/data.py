"""Training data as Megatron indexed datasets (PREFIX.bin / PREFIX.idx).

``prepare`` tokenizes a .jsonl (one {"text": ...} per line) or .txt file (documents
separated by blank lines) with a Hugging Face tokenizer and writes the dataset with
megatron-core's IndexedDatasetBuilder, each document followed by the tokenizer's EOS,
plus PREFIX.json (tokenizer, vocabulary size, counts) that the runtime checks against the
model. ``build_dataset`` opens it as megatron-core's GPTDataset over one epoch (shuffled
samples of seq_len + 1 tokens, indices cached on rank 0); sample i of the run is sample
i mod epoch, so the order does not depend on how many steps a run asks for (a resumed run
with a larger train.steps continues the same sequence). ``sample_ids`` hands each rank
its part of a global batch the way Megatron-LM's sampler does, so step k always sees the
same samples whatever the data-parallel size.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import publish
from ..errors import InputFileError, MissingInputError, OutputExistsError, SpecError

if TYPE_CHECKING:
    import torch

SUFFIXES = (".bin", ".idx", ".json")
DOCUMENT_SUFFIXES = (".jsonl", ".txt")
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")  # the Stage module's keyword arguments
TEXT, CHAT = "text", "chat"


@dataclass(frozen=True)
class DatasetInfo:
    tokenizer: str
    vocab_size: int
    eod: int
    documents: int
    tokens: int
    kind: str = TEXT  # CHAT: conversations with a loss mask (toolkit.runtime.chat_data)
    loss_tokens: int | None = None  # chat: assistant tokens among the labels
    truncated: int = 0  # chat: conversations cut to seq_len + 1 tokens
    dropped: int = 0  # chat: conversations left out (too long)
    seq_len: int | None = None  # chat: the --seq-len they were fitted to (None: none was)
    longest: int | None = None  # chat: tokens of the longest conversation
    fill_packed: float | None = None  # chat at seq_len: share of positions holding a conversation, packed
    fill_unpacked: float | None = None  # ... one conversation per sequence


def read_documents(path: Path) -> Iterator[str]:
    """Documents of a .jsonl ("text" field) or .txt file (blank-line separated)."""
    if path.suffix == ".jsonl":
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise InputFileError(f"{path}:{n}: expected a JSON object with a 'text' field") from None
    elif path.suffix == ".txt":
        for doc in path.read_text().split("\n\n"):
            if doc.strip():
                yield doc.strip()
    else:
        raise _not_documents(path)


def _not_documents(path: Path) -> InputFileError:
    return InputFileError(f"'{path}': expected a .jsonl or .txt file")


def copy_prepared(shipped: Path, tokenizer: Path, out_prefix: Path) -> None:
    """``shipped``.bin/.idx/.json (what ``prepare`` writes, its tokenizer named relative to the
    shipped files' folder) to OUT_PREFIX.*, the json naming ``tokenizer``'s absolute path, as
    ``prepare`` would: all written, or none."""
    info = json.loads(Path(f"{shipped}.json").read_text())
    info["tokenizer"] = str(tokenizer.resolve())
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_prefix.name}.partial-", dir=out_prefix.parent))
    try:
        for s in (".bin", ".idx"):
            shutil.copyfile(f"{shipped}{s}", tmp / f"d{s}")
        (tmp / "d.json").write_text(json.dumps(info, indent=2) + "\n")
        for s in SUFFIXES:
            publish(tmp / f"d{s}", str(out_prefix) + s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(path: str | Path):
    if not Path(path).is_dir():
        raise MissingInputError(f"tokenizer folder '{path}' does not exist")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.eos_token_id is None:
        raise InputFileError(f"tokenizer '{path}' has no EOS token to end documents with")
    return tok


def prepare(input_path: str | Path, tokenizer: str | Path, out_prefix: str | Path, *, overwrite: bool = False,
            progress: Callable[[int], None] | None = None, seq_len: int | None = None,
            overlong: str = "truncate") -> DatasetInfo:
    """Tokenize `input_path` into OUT_PREFIX.bin/.idx/.json (all written, or none): documents
    (each followed by EOS), or conversations with the chat template when the .jsonl holds
    them (then also OUT_PREFIX.mask.bin/.idx; `seq_len` and `overlong`: toolkit.runtime.chat_data).
    `progress(done)` is called every 1000 documents. The arguments are checked before torch,
    transformers and megatron-core are imported (seconds)."""
    from .chat_data import MASK, is_chat_file

    src, prefix = Path(input_path), Path(out_prefix)
    if not src.is_file():
        raise MissingInputError(f"input '{src}' does not exist")
    if src.suffix not in DOCUMENT_SUFFIXES:
        raise _not_documents(src)
    if not Path(tokenizer).is_dir():
        raise MissingInputError(f"tokenizer folder '{tokenizer}' does not exist")
    chat = is_chat_file(src)
    suffixes = SUFFIXES + ((MASK + ".bin", MASK + ".idx") if chat else ())
    existing = [str(prefix) + s for s in suffixes if Path(str(prefix) + s).exists()]
    if existing and not overwrite:
        raise OutputExistsError(f"'{existing[0]}' already exists (pass --overwrite to replace it)")
    import numpy

    tok = load_tokenizer(tokenizer)
    vocab = len(tok)
    dtype = numpy.uint16 if vocab < 2**16 else numpy.int32
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.partial-", dir=prefix.parent))
    try:
        base = DatasetInfo(str(Path(tokenizer).resolve()), vocab, tok.eos_token_id, 0, 0)
        info = (_write_chat(src, tok, base, tmp / "d", dtype, seq_len, overlong, progress) if chat
                else _write_text(src, tok, base, tmp / "d", dtype, progress))
        (tmp / "d.json").write_text(json.dumps(asdict(info), indent=2) + "\n")
        for s in suffixes:
            publish(tmp / f"d{s}", str(prefix) + s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _write_text(src: Path, tok, base: DatasetInfo, out: Path, dtype, progress) -> DatasetInfo:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{out}.bin", dtype=dtype)
    docs = tokens = 0
    for docs, text in enumerate(read_documents(src), 1):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        builder.add_item(torch.tensor(ids))
        builder.end_document()
        tokens += len(ids)
        if progress and docs % 1000 == 0:
            progress(docs)
    if docs == 0:
        raise InputFileError(f"'{src}' holds no documents")
    builder.finalize(f"{out}.idx")
    return replace(base, documents=docs, tokens=tokens)


def _write_chat(src: Path, tok, base: DatasetInfo, out: Path, dtype, seq_len, overlong, progress) -> DatasetInfo:
    from .chat_data import write_chat

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from .chat_dataset import fills

    r = write_chat(src, tok, base.tokenizer, out, dtype, seq_len=seq_len, overlong=overlong, progress=progress)
    written = IndexedDataset(str(out))  # (its lengths are a view of its memory map: kept open while read)
    packed, unpacked = fills(written.sequence_lengths, seq_len) if seq_len else (None, None)
    return replace(base, documents=r.conversations, tokens=r.tokens, kind=CHAT, loss_tokens=r.loss_tokens,
                   truncated=r.truncated, dropped=r.dropped, seq_len=seq_len, longest=r.longest,
                   fill_packed=packed, fill_unpacked=unpacked)


def dataset_info(prefix: str | Path) -> DatasetInfo | None:
    p = Path(str(prefix) + ".json")
    return DatasetInfo(**json.loads(p.read_text())) if p.is_file() else None


def recorded_fill(prefix: str | Path | None, seq_len: int, packing: bool) -> float | None:
    """The fill `toolkit data prepare --seq-len` recorded for chat data at this seq_len (packed
    or not), or None (text data fills every position; another seq_len was not measured)."""
    info = dataset_info(prefix) if prefix else None
    if info is None or info.kind != CHAT or info.seq_len != seq_len:
        return None
    return info.fill_packed if packing else info.fill_unpacked


def check_dataset(prefix: str | Path, vocab_size: int) -> None:
    """Fail before training when the files are missing or the tokens do not fit the model."""
    for s in (".bin", ".idx"):
        if not Path(str(prefix) + s).is_file():
            raise MissingInputError(f"dataset '{prefix}{s}' does not exist (make it with `toolkit data prepare`)")
    info = dataset_info(prefix)
    if info is not None and info.vocab_size > vocab_size:
        raise SpecError(f"dataset '{prefix}' was tokenized with {info.vocab_size} token ids "
                        f"({info.tokenizer}); the model's vocabulary has {vocab_size}")


class _Tokens:
    """What GPTDataset asks of a tokenizer: the EOD id, the vocabulary size, and the
    identifiers it writes into its index-cache description."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = {"class": "TokenIds", "vocab_size": vocab_size, "eod": eod}


def build_dataset(prefix: str | Path, seq_len: int, seed: int, vocab_size: int, cache_dir: str | Path):
    """megatron-core's GPTDataset: one shuffled epoch of the whole file (rank 0 builds the
    index cache, the others read it)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    info = dataset_info(prefix)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_len, blend=([str(prefix)], None), split="100,0,0",
        path_to_cache=str(cache_dir), tokenizer=_Tokens(vocab_size, info.eod if info else 0),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()[0]


def sample_ids(first: int, micro: int, global_batch: int, dp: int, dp_rank: int) -> list[list[int]]:
    """Sample indices of this data-parallel rank's micro-batches in the global batch
    [first, first + global) (first = samples consumed before it): micro-batch k of rank d
    holds first + k * micro * dp + d * micro ... + micro (Megatron-LM's pretraining sampler)."""
    base = first
    return [[base + k * micro * dp + dp_rank * micro + j for j in range(micro)]
            for k in range(global_batch // (micro * dp))]


def collate(dataset, ids: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch as the Stage module's keyword arguments (BATCH_KEYS, and packed chat
    data's segments), each [b, s]."""
    import torch

    samples = [dataset[i % len(dataset)] for i in ids]
    return {k: torch.stack([s[k] for s in samples]).to(device) for k in samples[0]}


def per_token_denominator(micro_batches: list[dict]) -> torch.Tensor:
    """The loss denominator of per-token normalisation (toolkit.runtime.engine.mean_token_loss):
    the unmasked tokens of the global batch (this rank's micro-batches, summed over the
    data-parallel ranks: one all-reduce of one number per step, before the forward passes) /
    (micro-batches per rank x dp x cp). Megatron-LM divides the summed gradients by the
    same count after the backward passes (calculate_per_token_loss); dividing each
    micro-batch's loss by it before is the same sum."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    count = sum(mb["loss_mask"].sum(dtype=torch.float64) for mb in micro_batches)
    dist.all_reduce(count, group=ps.get_data_parallel_group())
    ranks = ps.get_data_parallel_world_size() * ps.get_context_parallel_world_size()
    return (count.clamp(min=1) / (len(micro_batches) * ranks)).to(torch.float32)
