"""Named models and HF configs -> ModelShape.

Named models are data: the real HF config.json values of public checkpoints
(registry.json), plus each family's tiny test flavours (registered in its file,
toolkit/models/families/). A config becomes a ModelShape through its family
(toolkit.models.family).
"""
from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import SpecError, UnknownNameError, closest
from .family import config_type, families, family_of, tiny_models
from .shape import ModelShape


@lru_cache(maxsize=1)
def named_models() -> dict[str, dict[str, Any]]:
    """name -> {"hf_repo": ..., "config": {...config.json...}}: registry.json, then the families' tiny flavours."""
    text = resources.files("toolkit.models").joinpath("registry.json").read_text()
    return {**json.loads(text), **tiny_models()}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json from a file or a model folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise SpecError(f"no HF config at '{path}' (expected a config.json or a folder holding one)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"'{p}' is not valid JSON: {e}") from None


def hf_config_object(cfg: dict[str, Any]):
    """The transformers config class for a config.json dict (fills defaults, normalises rope);
    for building HF models and writing complete config.json files, not for planning."""
    from transformers import AutoConfig

    d = {k: v for k, v in cfg.items() if not k.startswith("_")}
    if "model_type" not in d:
        raise SpecError("HF config has no 'model_type'")
    return AutoConfig.for_model(config_type(d.pop("model_type")), **d)


def shape_from_hf(cfg: dict[str, Any]) -> ModelShape:
    """The shape of a config.json dict, read as JSON (no transformers import: see hf_json)."""
    from .hf_json import hf_view

    arch = architecture_of(cfg)
    fam = family_of(arch)
    try:
        shape = fam.from_hf(hf_view(cfg))
    except AttributeError as e:
        raise SpecError(f"HF config of {arch} lacks a field: {e}") from None
    return replace(shape, hf_config=dict(cfg))


def architecture_of(cfg: dict[str, Any]) -> str:
    """The config's one architecture; a config written by ``LlamaConfig(...).save_pretrained()``
    names none, and its ``model_type`` then says which: each family registers one causal-LM
    architecture under its model_type ("llama" -> LlamaForCausalLM)."""
    archs = cfg.get("architectures") or []
    if len(archs) == 1:
        return archs[0]
    if archs:
        raise SpecError(f"HF config names {len(archs)} architectures {archs}; keep the causal LM's one in "
                        "'architectures'")
    by_type = {f.name: f.architectures for f in families() if len(f.architectures) == 1}
    model_type = cfg.get("model_type")
    if model_type in by_type:
        return by_type[model_type][0]
    known = ", ".join(sorted(by_type))
    example = by_type[sorted(by_type)[0]][0]
    raise SpecError(f"HF config names no architecture and its model_type {model_type!r} is not one of {known}; "
                    f"set 'architectures' (e.g. [\"{example}\"])")


def hf_config_dict(shape: ModelShape) -> dict[str, Any]:
    """config.json for a shape: the original when known, else rebuilt by its family."""
    if shape.hf_config:
        return dict(shape.hf_config)
    fam = family_of(shape.architecture)
    d = fam.to_hf(shape)
    full = hf_config_object(d).to_dict()
    full["architectures"] = [shape.architecture]
    return full


def load_model(name_or_path: str) -> ModelShape:
    """A registry name (``llama3-70b``) or a path to config.json / a model folder."""
    models = named_models()
    if name_or_path in models:
        return shape_from_hf(models[name_or_path]["config"])
    if Path(name_or_path).exists():
        return shape_from_hf(read_hf_config(name_or_path))
    hint = closest(name_or_path, list(models))
    raise UnknownNameError(
        f"unknown model '{name_or_path}'" + (f" (did you mean '{hint}'?)" if hint else "")
        + " and no such path; `toolkit models` lists the names")
