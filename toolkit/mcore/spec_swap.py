"""Replace one module class by another throughout a megatron-core ModuleSpec tree."""
from __future__ import annotations

import dataclasses
from typing import Any


def swap_module(spec: Any, old: type, new: type, params: dict[str, Any] | None = None) -> Any:
    """A copy of `spec` (ModuleSpec, submodules dataclass, list, or class) with every `old` class
    replaced by `new` (a ModuleSpec of `old` also given `params`, keyword arguments of `new`);
    everything else is shared, not copied. megatron's layer specs name modules as classes
    (``core_attention=DotProductAttention``) or as ModuleSpec(module=...)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is old:
        return new
    if isinstance(spec, ModuleSpec):
        extra = params if params and spec.module is old else {}
        return dataclasses.replace(spec, module=swap_module(spec.module, old, new), params={**spec.params, **extra},
                                   submodules=swap_module(spec.submodules, old, new, params))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: swap_module(getattr(spec, f.name), old, new, params)
                                            for f in dataclasses.fields(spec) if f.init})
    if isinstance(spec, list):
        return [swap_module(s, old, new, params) for s in spec]
    return spec
