"""Chat data for supervised fine-tuning: JSONL conversations -> two Megatron indexed datasets.

Each line is {"messages": [{"role", "content"}, ...]} (as transformers' chat templates take
them) or {"prompt", "completion"}. A conversation is tokenised with the model's own chat
template (toolkit.runtime.chat_template) and stored as one document of PREFIX.bin/.idx (its
token ids) and one of PREFIX.mask.bin/.idx (1 on the assistant's tokens, uint8), both written
by megatron-core's IndexedDatasetBuilder, so document i of one is document i of the other.

A conversation of L tokens trains on L - 1 positions (inputs ids[:-1], labels ids[1:]), so it
fits a sequence of seq_len when L <= seq_len + 1. Longer ones follow `overlong`: truncate keeps
the first seq_len + 1 tokens (dropped after all when no assistant token is left among the
labels), drop leaves them out; both are counted in the report. A line that is not a
conversation, or that the template refuses, stops the preparation with FILE:LINE.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputFileError
from .chat_template import check_template, messages_of, tokenize_many

MASK = ".mask"  # PREFIX.mask.bin/.idx: the loss mask beside PREFIX.bin/.idx
OVERLONG = ("truncate", "drop")
CHUNK = 512  # conversations rendered and tokenised per batched call
SHAPES = '{"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "completion": ...}'


@dataclass(frozen=True)
class ChatReport:
    conversations: int  # written
    tokens: int
    loss_tokens: int  # assistant tokens among the labels (what the loss sees)
    truncated: int
    dropped: int
    longest: int  # tokens of the longest conversation written


def is_chat_file(path: Path) -> bool:
    """A .jsonl whose first record is a conversation (the text path takes {"text"})."""
    if path.suffix != ".jsonl":
        return False
    with path.open() as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(record, dict) and ("messages" in record or "prompt" in record)
    return False


def read_conversations(path: Path) -> Iterator[tuple[int, list[dict]]]:
    """(line number, messages) of every non-empty line; a bad line raises with FILE:LINE."""
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                msgs = messages_of(json.loads(line))
            except json.JSONDecodeError as e:
                raise InputFileError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if msgs is None:
                raise InputFileError(f"{path}:{n}: expected {SHAPES} with string roles and contents")
            yield n, msgs


def fit(ids: list[int], mask: list[int], seq_len: int | None, overlong: str
        ) -> tuple[list[int], list[int], str | None]:
    """The conversation as stored, and what happened to it: None (fits), "truncated" or
    "dropped"."""
    if seq_len is None or len(ids) <= seq_len + 1:
        return ids, mask, None
    if overlong == "drop":
        return [], [], "dropped"
    ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
    return (ids, mask, "truncated") if any(mask[1:]) else ([], [], "dropped")


def chunks(items: Iterator, size: int) -> Iterator[list]:
    """Lists of `size` items; when reading raises (a bad line), the lines read before it come
    first, so the first bad line of the file is the one reported."""
    chunk: list = []
    try:
        for item in items:
            chunk.append(item)
            if len(chunk) == size:
                yield chunk
                chunk = []
    except InputFileError:
        if chunk:
            yield chunk
        raise
    if chunk:
        yield chunk


def tokenized(src: Path, tok, chunk: list[tuple[int, list[dict]]]) -> list[tuple[list[int], list[int]]]:
    """The chunk's conversations through the template, batched; when the batch fails, one at a
    time, to name the line the template refuses."""
    try:
        return tokenize_many(tok, [msgs for _, msgs in chunk])
    except Exception:  # noqa: BLE001  the template's own refusal (raise_exception), or ours: find the line
        return [one(src, tok, n, msgs) for n, msgs in chunk]


def one(src: Path, tok, n: int, msgs: list[dict]) -> tuple[list[int], list[int]]:
    try:
        return tokenize_many(tok, [msgs])[0]
    except Exception as e:  # noqa: BLE001  whatever the template raised, said with its line
        raise InputFileError(f"{src}:{n}: the chat template refused this conversation: {e}") from None


def write_chat(src: Path, tok, tokenizer_dir: str, tokens_path: Path, dtype, *, seq_len: int | None,
               overlong: str, progress: Callable[[int], None] | None = None) -> ChatReport:
    """Tokenise `src` into tokens_path (.bin/.idx) and its loss mask (.mask.bin/.idx);
    tokens_path is a prefix inside the caller's temporary folder."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if overlong not in OVERLONG:
        raise InputFileError(f"overlong policy '{overlong}': expected one of {', '.join(OVERLONG)}")
    check_template(tok, tokenizer_dir)
    ids_out = IndexedDatasetBuilder(f"{tokens_path}.bin", dtype=dtype)
    mask_out = IndexedDatasetBuilder(f"{tokens_path}{MASK}.bin", dtype=numpy.uint8)
    counts = {"truncated": 0, "dropped": 0}
    done = tokens = loss_tokens = longest = 0
    for chunk in chunks(read_conversations(src), CHUNK):
        for n, (ids, mask) in zip([n for n, _ in chunk], tokenized(src, tok, chunk)):
            if not any(mask[1:]):
                raise InputFileError(f"{src}:{n}: no assistant tokens to train on (the conversation needs an "
                                     "assistant message after the first token)")
            ids, mask, fate = fit(ids, mask, seq_len, overlong)
            if fate:
                counts[fate] += 1
            if not ids:
                continue
            ids_out.add_item(torch.tensor(ids))
            ids_out.end_document()
            mask_out.add_item(torch.tensor(mask, dtype=torch.uint8))
            mask_out.end_document()
            done, tokens, longest = done + 1, tokens + len(ids), max(longest, len(ids))
            loss_tokens += sum(mask[1:])
            if progress and done % 1000 == 0:
                progress(done)
    if done == 0:
        raise InputFileError(f"'{src}' holds no conversation that fits (dropped {counts['dropped']})")
    ids_out.finalize(f"{tokens_path}.idx")
    mask_out.finalize(f"{tokens_path}{MASK}.idx")
    return ChatReport(done, tokens, loss_tokens, counts["truncated"], counts["dropped"], longest)
