"""Conversations -> token ids and an assistant-token mask, with the model's own chat template.

Two ways to the mask, both from transformers' rendering (``tokenizer.apply_chat_template``):
  - the template marks the assistant's text with ``{% generation %}`` blocks: transformers'
    own mask (``return_assistant_tokens_mask=True``);
  - otherwise the mask is derived from the template by rendering prefixes: for assistant
    message i, ``render(messages[:i], add_generation_prompt=True)`` ends where the reply
    starts (for a first message, its rendering with a sentinel reply, up to the sentinel) and ``render(messages[:i + 1])`` ends where it ends (less the whitespace the
    template puts between turns, which a {% generation %} block leaves out too); the
    characters between are the assistant's, and every token overlapping them is kept
    (transformers' rule for its own mask). A template that does not render a conversation
    prefix by prefix (one that rewrites earlier turns) cannot be read this way: refused.
tests/toolkit/runtime/test_chat_data.py checks that both agree on real templates.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import InputFileError

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
ASSISTANT = "assistant"


def has_generation_blocks(tok) -> bool:
    template = tok.chat_template
    return isinstance(template, str) and bool(GENERATION_BLOCK.search(template))


def check_template(tok, where: str) -> None:
    if not tok.chat_template:
        raise InputFileError(f"tokenizer '{where}' has no chat template to render conversations with")


def tokenize_conversation(tok, messages: list[dict[str, Any]], derive: bool | None = None
                          ) -> tuple[list[int], list[int]]:
    """(token ids, mask with 1 on assistant tokens) of one conversation as the template
    renders it. `derive`: force the prefix derivation (True) or transformers' mask (False);
    None picks transformers' mask when the template has {% generation %} blocks."""
    return tokenize_many(tok, [messages], derive)[0]


def tokenize_many(tok, conversations: list[list[dict[str, Any]]], derive: bool | None = None
                  ) -> list[tuple[list[int], list[int]]]:
    """tokenize_conversation of several conversations: each kind of rendering is one batched
    apply_chat_template call and the tokenisation one batched call (the tokenizer's threads),
    which is what makes a file fast; the results are those of one conversation at a time."""
    if derive is None:
        derive = not has_generation_blocks(tok)
    if not derive:
        out = tok.apply_chat_template(conversations, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return [(list(ids), list(mask)) for ids, mask in zip(out["input_ids"], out["assistant_masks"])]
    texts = render(tok, conversations)
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    replies = [(k, i) for k, msgs in enumerate(conversations) for i, m in enumerate(msgs) if m.get("role") == ASSISTANT]
    befores = iter(render(tok, [conversations[k][:i] for k, i in replies if i], add_generation_prompt=True))
    uptos = iter(render(tok, [conversations[k][:i + 1] for k, i in replies]))
    spans: list[list[tuple[int, int]]] = [[] for _ in conversations]
    for k, i in replies:
        before = next(befores) if i else opening(tok, conversations[k][0])
        span = reply_span(texts[k], before, next(uptos))
        if span is not None:
            spans[k].append(span)
    return [(list(ids), spans_to_mask(off, s)) for ids, off, s in zip(enc["input_ids"], enc["offset_mapping"], spans)]


def render(tok, conversations: list[list[dict[str, Any]]], **kwargs) -> list[str]:
    return list(tok.apply_chat_template(conversations, tokenize=False, **kwargs)) if conversations else []


def reply_span(text: str, before: str, upto: str) -> tuple[int, int] | None:
    """The characters [start, end) of the reply in `text` (the whole rendering), given the
    renderings that end where it starts (`before`) and where its turn ends (`upto`)."""
    if not (text.startswith(before) and text.startswith(upto) and len(upto) >= len(before)):
        raise InputFileError("the chat template does not render this conversation prefix by prefix, so the "
                             "assistant tokens cannot be derived from it; give the template {% generation %} "
                             "blocks (transformers' assistant mask)")
    end = len(before) + len(upto[len(before):].rstrip())
    return (len(before), end) if end > len(before) else None


def opening(tok, first: dict[str, Any]) -> str:
    """What the template renders before the reply of a conversation's first message (an
    assistant's: there is no shorter conversation to render with the generation prompt): the
    rendering of that message with a sentinel reply, up to the sentinel."""
    sentinel = "\ue000reply\ue000"  # a private-use character: in no template, no reply
    text = tok.apply_chat_template([{**first, "content": sentinel}], tokenize=False)
    return text[:text.index(sentinel)] if sentinel in text else ""


def spans_to_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a span (spans and offsets in order)."""
    mask, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def messages_of(record: Any) -> list[dict[str, Any]] | None:
    """The conversation of one JSONL record: {"messages": [...]} as chat templates take it,
    or {"prompt", "completion"} (strings: one user and one assistant turn; lists of
    messages: joined). None when the record is neither."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        msgs = record["messages"]
    elif "prompt" in record and "completion" in record:
        p, c = record["prompt"], record["completion"]
        p = [{"role": "user", "content": p}] if isinstance(p, str) else p
        c = [{"role": ASSISTANT, "content": c}] if isinstance(c, str) else c
        msgs = p + c if isinstance(p, list) and isinstance(c, list) else None
    else:
        return None
    ok = isinstance(msgs, list) and msgs and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)
    return msgs if ok else None
