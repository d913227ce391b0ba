"""`toolkit data prepare INPUT --tokenizer DIR --out PREFIX`: text -> Megatron indexed dataset."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from . import app

data_app = typer.Typer(no_args_is_help=True, help="Training data: Megatron indexed datasets (.bin/.idx).")
app.add_typer(data_app, name="data")


class Overlong(str, Enum):
    """toolkit.runtime.chat_data.OVERLONG"""

    truncate = "truncate"
    drop = "drop"


@data_app.command("prepare")
def prepare_cmd(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT", help=".jsonl ({\"text\": ...} per line; or "
                                                                     "conversations: {\"messages\": [...]} or "
                                                                     "{\"prompt\", \"completion\"}) or .txt "
                                                                     "(documents separated by blank lines)")],
    tokenizer: Annotated[Path, typer.Option("--tokenizer", help="Hugging Face tokenizer folder")],
    out: Annotated[Path, typer.Option("--out", help="output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.json")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace existing PREFIX files")] = False,
    seq_len: Annotated[int | None, typer.Option("--seq-len", min=1, help="chat data: the training sequence length "
                                                "conversations must fit (seq_len + 1 tokens); default: no limit")] = None,
    overlong: Annotated[Overlong, typer.Option("--overlong", help="chat data: what happens to a conversation "
                                                                  "longer than --seq-len")] = Overlong.truncate,
) -> None:
    """Tokenize documents (each followed by the tokenizer's EOS) for `--data PREFIX`; a .jsonl of
    conversations ({"messages": [...]} or {"prompt", "completion"}) is rendered with the
    tokenizer's chat template, and PREFIX.mask.bin/.idx keeps the assistant tokens for the loss."""
    from ..runtime.data import CHAT, prepare

    info = prepare(input_path, tokenizer, out, overwrite=overwrite, seq_len=seq_len, overlong=overlong.value,
                   progress=lambda n: print(f"\r{n:,} documents", end="", flush=True))
    if info.kind != CHAT:
        print(f"\rwrote {out}.bin/.idx/.json: {info.documents:,} documents, {info.tokens:,} tokens "
              f"(vocabulary {info.vocab_size:,}, EOS id {info.eod})")
        return
    print(f"\rwrote {out}.bin/.idx/.json and {out}.mask.bin/.idx: {info.documents:,} conversations, "
          f"{info.tokens:,} tokens, {info.loss_tokens:,} assistant tokens in the loss; "
          f"over --seq-len: {info.truncated:,} truncated, {info.dropped:,} dropped")
    if info.fill_packed is not None:
        print(f"fill at seq_len {info.seq_len}: {info.fill_packed:.1%} of the positions hold a conversation packed "
              f"(data.packing), {info.fill_unpacked:.1%} one per sequence (the plan's tokens/s counts them)")
