"""Model families, registered once, each by its own file in toolkit/models/families/.

A ``Family`` is everything the toolkit knows of one HF ``model_type``: its config.json <-> a
ModelShape (whose fields are the architecture's features, read generically by the planner,
the emitters, the converters and the runtime), its weight table (toolkit.models.weights), the
HF tensors that copy others, what megatron-core would compute differently (refused, with the
numbers), the Megatron-LM flags that identify it in a checkpoint without its HF config, and
its tiny test flavours. No other module names a family.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..errors import SpecError, UnsupportedModelError
from . import weights
from .shape import ModelShape
from .weights import Table, has_mtp


@dataclass(frozen=True, eq=False)  # one object per family: compared and hashed by identity
class Family:
    name: str  # the HF model_type
    architectures: tuple[str, ...]
    from_hf: Callable[[Any], ModelShape]  # config.json attributes (hf_json.HFConfig) -> ModelShape
    to_hf: Callable[[ModelShape], dict[str, Any]]  # ModelShape -> config.json fields
    weights: Callable[[ModelShape], Table]  # megatron name -> mapping of HF tensors
    # HF tensors that are copies of others (megatron keeps one): {alias: the HF name it copies}
    aliases: Callable[[ModelShape], dict[str, str]] | None = None
    # what megatron-core would compute differently from transformers: (shape, config attributes) -> reasons
    problems: Callable[[ModelShape, Any], list[str]] | None = None
    # Megatron-LM checkpoint flags (megatron_features) that identify the architecture without its HF
    # config; a flag the family may have either way is None
    megatron_signature: dict[str, bool | None] | None = None
    tiny: dict[str, dict[str, Any]] = field(default_factory=dict)  # test flavours: name -> config.json
    # other model_type names a config.json of this family's config class carries (a model's own
    # remote-code config under its own name, e.g. a DeepSeek-V3 architecture published as another type)
    config_types: tuple[str, ...] = ()
    # HF tensors that store several of the table's tensors, one part per expert (GPT-OSS's 3-D
    # experts): shape -> [(stored name, the table's per-expert names ("{}" = expert), transposed)]
    # (converters.packed reads and writes them)
    packed: Callable[[ModelShape], list[tuple[str, tuple[str, ...], bool]]] | None = None
    # where transformers' forward runs a layer's modules in another order than megatron-core's
    # (params.hf_layer_weights): "qk_norm": "each" = q_proj, q_norm, k_proj, k_norm, v_proj (else the norms
    # after v_proj); "shared_experts": "first" = the shared expert's MLP before the router, its gate after
    # the routed experts (else the shared experts after them)
    hf_forward: dict[str, str] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {}  # HF architecture -> its family


def register(family: Family) -> Family:
    for arch in family.architectures:
        FAMILIES[arch] = family
    return family


class UnsupportedArchitectureError(SpecError):
    """An HF architecture no registered family converts or plans."""


@lru_cache(maxsize=1)
def load_families() -> None:
    from .families import llama, qwen2, qwen3, mixtral, deepseek, glm4_moe, gemma3, gpt_oss, qwen3_next  # noqa: F401, I001  (they register themselves)


def families() -> list[Family]:
    load_families()
    return list(dict.fromkeys(FAMILIES.values()))


def config_type(model_type: str | None) -> str | None:
    """The model_type whose config class reads a config.json of this model_type: itself, or the
    family that names it among its ``config_types``."""
    return next((fam.name for fam in families() if model_type in fam.config_types), model_type)


def family_of(architecture: str) -> Family:
    load_families()
    if architecture not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture '{architecture}'; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[architecture]


def supported() -> list[str]:
    load_families()
    return sorted(FAMILIES)


def check_supported(architecture: str) -> None:
    if architecture not in supported():
        raise UnsupportedArchitectureError(
            f"unsupported architecture '{architecture}' for conversion; supported: {', '.join(supported())}")


def check_convertible(shape: ModelShape) -> None:
    """Raise UnsupportedModelError with every reason megatron-core would compute another model."""
    check_supported(shape.architecture)
    fn = family_of(shape.architecture).problems
    if fn is None or not shape.hf_config:
        return
    from .hf_json import hf_view

    problems = fn(shape, hf_view(shape.hf_config))
    if problems:
        raise UnsupportedModelError(f"{shape.architecture} cannot be converted exactly: " + "; ".join(problems))


def table_for(shape: ModelShape) -> Table:
    check_convertible(shape)
    return family_of(shape.architecture).weights(shape)


def aliases_for(shape: ModelShape) -> dict[str, str]:
    fn = family_of(shape.architecture).aliases
    return fn(shape) if fn else {}


def with_mtp(shape: ModelShape, names, hf: bool) -> ModelShape:
    """The shape with as many MTP modules as the weights hold (toolkit.models.weights.with_mtp);
    an architecture without a family is left as it is (the caller refuses it)."""
    load_families()
    family = FAMILIES.get(shape.architecture)
    return weights.with_mtp(shape, family.weights(shape), names, hf) if family else shape


def supports_mtp(shape: ModelShape) -> bool:
    """Whether the model's family has multi-token prediction modules (its weight table names them)."""
    return has_mtp(family_of(shape.architecture).weights(shape))


def architecture_from_megatron(features: dict[str, bool]) -> str | None:
    """The architecture whose Megatron-LM signature these checkpoint features are (None: none is)."""
    def fits(signature: dict[str, bool | None]) -> bool:
        return signature.keys() == features.keys() and all(v is None or v == features[k] for k, v in signature.items())

    matches = [arch for fam in families() for arch in fam.architectures[:1]
               if fam.megatron_signature is not None and fits(fam.megatron_signature)]
    return matches[0] if len(matches) == 1 else None


def tiny_models() -> dict[str, dict[str, Any]]:
    """Every family's test flavours, as named-model entries (name -> {"hf_repo", "config"})."""
    return {name: {"hf_repo": None, "config": cfg} for fam in families() for name, cfg in fam.tiny.items()}
