"""A tiny registry model as a Hugging Face folder: transformers' own model class, randomly
initialised (seeded), with a byte-level chat tokenizer built locally (``chat_corpus``).

It stands in for a hub download where there is no network or no time: the README's fine-tuning
walkthrough (HF folder -> convert -> chat data -> LoRA run -> an adapter peft loads) starts from
one, and so do the recipes' tiny flavours in the tests. Only the registry's tiny flavours
(``toolkit models``: the names ending in ``-tiny``) are offered: a real model's weights are the
hub's, not random ones. A family whose hub checkpoints hold a multi-token prediction module that
transformers' class leaves out (Qwen3-Next's ``mtp.*``) gets it too (toolkit.runtime.tiny_mtp), so
the folder converts as a download does.
"""
from __future__ import annotations

from pathlib import Path

from ..atomic import atomic_output_dir
from ..errors import SpecError, closest
from ..models import named_models
from ..models.registry import hf_config_object
from . import chat_corpus

TEMPLATES = {"chatml": chat_corpus.CHATML, "llama3": chat_corpus.LLAMA3}


def tiny_names() -> list[str]:
    return [n for n in named_models() if n.endswith("-tiny")]


def _checked(name: str, template: str) -> None:
    names = tiny_names()
    if name not in names:
        hint = closest(name, names)
        raise SpecError(f"'{name}' is not a tiny model" + (f" (did you mean '{hint}'?)" if hint else "")
                        + f"; tiny models: {', '.join(names)}")
    if template not in TEMPLATES:
        hint = closest(template, TEMPLATES)
        raise SpecError(f"unknown chat template '{template}'" + (f" (did you mean '{hint}'?)" if hint else "")
                        + f"; templates: {', '.join(TEMPLATES)}")


def save_tiny_hf(name: str, out: str | Path, *, template: str = "chatml", seed: int = 0) -> Path:
    """Write ``name``'s model (transformers' class for its architecture, ``torch.manual_seed(seed)``
    then the class's own initialisation) and a tokenizer with ``template`` as its chat template
    into the folder ``out`` (which exists), with the model's MTP module when its hub checkpoints have
    one (drawn after the model, added to its safetensors file)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from .tiny_mtp import mtp_tensors

    _checked(name, template)
    cfg = {k: v for k, v in named_models()[name]["config"].items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(seed)
    config = hf_config_object(cfg)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    mtp = mtp_tensors(config)
    if mtp:  # a tiny model is one safetensors file (transformers shards at 5 GB)
        weights = Path(out) / "model.safetensors"
        save_file({**load_file(str(weights)), **mtp}, str(weights), metadata={"format": "pt"})
    chat_corpus.make_tokenizer(Path(out), TEMPLATES[template])
    return Path(out)


def write_tiny_hf(name: str, out: str | Path, *, template: str = "chatml", seed: int = 0,
                  overwrite: bool = False) -> Path:
    """``save_tiny_hf`` into a new folder ``out``, written whole or not at all."""
    _checked(name, template)
    with atomic_output_dir(out, overwrite) as tmp:
        save_tiny_hf(name, tmp, template=template, seed=seed)
    return Path(out)
