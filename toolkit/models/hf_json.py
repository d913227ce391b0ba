"""An HF config.json read as JSON: the attribute view the families' ``from_hf`` read,
without importing transformers (and with it torch), so planning starts at once.

What transformers adds when it builds its config object is reproduced from data:
the config class's field defaults and attribute aliases (``hf_defaults.json``, generated
from the installed transformers by tools/sync_hf_defaults.py; a test fails when stale)
and its rope normalisation (``rope_parameters`` below, after transformers 5's
``RotaryEmbeddingConfigMixin``). tests/toolkit/models/test_hf_json.py checks that every named model
and every family's defaults give the same ModelShape as transformers' own config object.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import SpecError

DEFAULTS_FILE = Path(__file__).with_name("hf_defaults.json")
SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")  # these carry the pretraining length


@lru_cache(maxsize=1)
def class_defaults() -> dict[str, dict[str, Any]]:
    """model_type -> {"config_class", "default_theta", "aliases", "defaults"}."""
    return json.loads(DEFAULTS_FILE.read_text())


class HFConfig:
    """Read-only attributes over a config.json merged with its class defaults; an alias
    (``num_experts`` for ``num_local_experts``) reads the field it names."""

    def __init__(self, values: dict[str, Any], aliases: dict[str, str], config_class: str):
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_aliases", aliases)
        object.__setattr__(self, "config_class", config_class)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[self._aliases.get(name, name)]
        except KeyError:
            raise AttributeError(f"{self.config_class} has no '{name}'") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("HFConfig is read-only")


def rope_parameters(values: dict[str, Any], default_theta: float, fields: set[str]) -> dict[str, Any]:
    """transformers 5's normalised ``rope_parameters`` (flat form) from a config.json's
    ``rope_scaling`` / ``rope_parameters`` / ``rope_theta`` (legacy keys take precedence
    as in ``convert_rope_params_to_dict``, then ``standardize_rope_params``). A top-level
    ``original_max_position_embeddings`` counts only where it is a field of the class
    (Phi-3 style); elsewhere transformers has not set it yet when it normalises."""
    params = dict(values.get("rope_scaling") or values.get("rope_parameters") or {})
    params.setdefault("rope_theta", values.get("rope_theta", default_theta))
    if values.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", values["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in SCALED_ROPE_TYPES:
        if "original_max_position_embeddings" in fields:
            params["original_max_position_embeddings"] = values["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
    return params


# Gemma 3's rope per layer type: default_theta's keys -> the rope_parameters keys, and the legacy
# config.json key of each base (Gemma3TextConfig.convert_rope_params_to_dict)
LAYER_TYPE_ROPE = {"global": ("full_attention", "rope_theta"), "local": ("sliding_attention", "rope_local_base_freq")}


def layer_type_rope_parameters(values: dict[str, Any], default_theta: dict[str, float]) -> dict[str, Any]:
    """transformers 5's nested ``rope_parameters`` ({layer type: params}) of a config class with a
    rope base per attention kind: ``rope_scaling`` applies to the full-attention layers only."""
    given = values.get("rope_parameters") or {}
    params = {kind: dict(given.get(kind) or {"rope_type": "default"}) for kind, _ in LAYER_TYPE_ROPE.values()}
    if values.get("rope_scaling"):
        params["full_attention"].update(values["rope_scaling"])
    for key, (kind, legacy) in LAYER_TYPE_ROPE.items():
        params[kind].setdefault("rope_theta", values.get(legacy, default_theta[key]))
        params[kind].setdefault("rope_type", params[kind].get("type", "default"))
    return params


def hf_view(cfg: dict[str, Any]) -> HFConfig:
    """The config.json dict as the attributes transformers' config object would have."""
    from .family import config_type

    model_type = config_type(cfg.get("model_type"))
    if model_type is None:
        raise SpecError("HF config has no 'model_type'")
    known = class_defaults()
    if model_type not in known:
        raise SpecError(f"unsupported model_type '{model_type}'; supported: {', '.join(sorted(known))}")
    entry = known[model_type]
    aliases = entry["aliases"]
    defaults = {aliases.get(k, k): v for k, v in entry["defaults"].items()}  # as setattr stores them
    given = {aliases.get(k, k): v for k, v in cfg.items() if not k.startswith("_")}
    values = {**defaults, **given}
    theta = entry["default_theta"]
    values["rope_parameters"] = (layer_type_rope_parameters(values, theta) if isinstance(theta, dict)
                                 else rope_parameters(values, theta, set(defaults)))
    return HFConfig(values, aliases, entry["config_class"])
