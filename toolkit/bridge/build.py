"""megatron-core's TransformerConfig, layer specs and GPTModel chunks of an HF model on the
process groups already set up, built by the runtime's own builder (toolkit.mcore.model) from
the plan the converters make for a layout (converters.layout.conversion_plan): what the
training runtime builds for that model and layout, fusions as this machine allows."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..models import ModelShape
from .live import current_layout, hf_shape


def plan_for(hf: str | Path | dict | ModelShape, precision: str = "fp32", grouped_gemm: bool = False,
             token_dispatcher: str | None = None, **split: Any):
    """The toolkit's Plan of the HF model at the live layout (megatron-core's parallel_state,
    which must be initialised; ``split``: the uneven pipeline split, Layout's
    ``first_stage_layers`` ... ``loss_in_split``, when the groups were made for one).
    ``token_dispatcher``: megatron's MoE dispatcher (default: alltoall on GPUs, allgather on
    CPU, where alltoall cannot run)."""
    from dataclasses import replace

    from megatron.core import parallel_state as ps

    from converters.layout import conversion_plan, validate_layout

    shape = hf_shape(hf)
    layout = replace(current_layout(), vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1, **split)
    validate_layout(shape, layout)  # the rules of a model at a layout, as the converters check them
    dispatcher = token_dispatcher or ("alltoall" if torch.cuda.is_available() else "allgather")
    return conversion_plan(shape, layout, precision=precision, grouped_gemm=grouped_gemm, token_dispatcher=dispatcher)


def transformer_config(plan, **overrides: Any):
    """megatron-core's (MLA)TransformerConfig of the plan, as the runtime builds it."""
    from ..mcore.model import transformer_config as build

    return build(plan, **overrides)


def layer_specs(plan, config) -> list:
    """The decoder block spec of each of this rank's virtual pipeline chunks."""
    from ..mcore.model import block_spec

    vpp = plan.layout.vpp
    return [block_spec(plan, config, v if vpp > 1 else None) for v in range(vpp)]


def build_model(plan, **overrides: Any) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline chunk), randomly initialised
    (fill them with ``load_hf``)."""
    from ..mcore.model import build_model_chunks

    return build_model_chunks(plan, **overrides)
