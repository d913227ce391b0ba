"""`toolkit tiny-model NAME OUT`: a tiny registry model as a Hugging Face folder."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import app


@app.command("tiny-model")
def tiny_model_cmd(
    name: Annotated[str, typer.Argument(help="a tiny model of `toolkit models` (llama-tiny, qwen3-moe-tiny, ...)")],
    out: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="the Hugging Face folder to write")],
    template: Annotated[str, typer.Option("--chat-template", help="the tokenizer's chat template: chatml | llama3")
                        ] = "chatml",
    seed: Annotated[int, typer.Option("--seed", help="torch.manual_seed before transformers initialises it")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace OUT_DIR if it exists")] = False,
) -> None:
    """A randomly initialised Hugging Face model folder (transformers' class, safetensors) with a
    chat tokenizer built locally: the stand-in for a hub download when trying the toolkit offline."""
    from ..quiet import quiet_deepspeed_detection, quiet_transformers_progress
    from ..runtime.tiny_hf import write_tiny_hf

    quiet_deepspeed_detection()
    quiet_transformers_progress()
    write_tiny_hf(name, out, template=template, seed=seed, overwrite=overwrite)
    print(f"wrote {out}: {name}, random weights (seed {seed}), {template} chat template")
