"""`toolkit data prepare INPUT --tokenizer DIR --out PREFIX`: text -> Megatron indexed dataset."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import app

data_app = typer.Typer(no_args_is_help=True, help="Training data: Megatron indexed datasets (.bin/.idx).")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def prepare_cmd(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT", help=".jsonl ({\"text\": ...} per line) or .txt "
                                                                     "(documents separated by blank lines)")],
    tokenizer: Annotated[Path, typer.Option("--tokenizer", help="Hugging Face tokenizer folder")],
    out: Annotated[Path, typer.Option("--out", help="output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.json")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace existing PREFIX files")] = False,
) -> None:
    """Tokenize documents (each followed by the tokenizer's EOS) for `--data PREFIX`."""
    from ..runtime.data import prepare

    info = prepare(input_path, tokenizer, out, overwrite=overwrite,
                   progress=lambda n: print(f"\r{n:,} documents", end="", flush=True))
    print(f"\rwrote {out}.bin/.idx/.json: {info.documents:,} documents, {info.tokens:,} tokens "
          f"(vocabulary {info.vocab_size:,}, EOS id {info.eod})")
