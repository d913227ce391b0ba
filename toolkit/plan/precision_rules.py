"""Where the spec's FP8 (TransformerEngine's fp8 recipes through megatron-core) can run, as rules.

FP8 is a planning input for target megatron-lm (Megatron-LM builds TransformerEngine's layers and
enters their FP8 autocast from the generated flags); neither this toolkit's runtime nor the HF
Trainer's generated settings run it, and only GPUs with FP8 tensor cores (Hopper: H100, H200) can.
"""
from __future__ import annotations

from collections.abc import Iterator

from ..kernels import spec_kernels
from ..parallel.zero import sharded
from .rules import Context, Finding, error, rule

FP8_RUNTIMES = {
    "recipes": "this toolkit's runtime has never run TransformerEngine's FP8 layers (none here: no CUDA, no "
               "TransformerEngine), nor DeepSpeed's ZeRO over their FP8 weight copies and amax reductions",
    "hf": "toolkit.hf's Trainer runs transformers' modules, which have no TransformerEngine FP8 GEMMs (the "
          "generated settings set no FP8 mixed precision)",
}


@rule(scope="target")
def fp8_runs(c: Context) -> Iterator[Finding]:
    """``fp8`` is Megatron-LM's (--fp8-format, --fp8-recipe): the other targets say why they cannot."""
    if c.spec.fp8.on and c.spec.target in FP8_RUNTIMES:
        yield error(f"fp8.format={c.spec.fp8.format} with target {c.spec.target}: {FP8_RUNTIMES[c.spec.target]}; "
                    "Megatron-LM runs it (target: megatron-lm)")


@rule(scope="training")
def fp8_hardware(c: Context) -> Iterator[Finding]:
    """FP8 GEMMs need FP8 tensor cores (Hopper and newer) and TransformerEngine's layers."""
    if not c.spec.fp8.on:
        return
    if c.gpu.fp8_tflops <= 0:
        yield error(f"fp8.format={c.spec.fp8.format} on {c.gpu.name}: it has no FP8 tensor cores (FP8 peak 0 "
                    f"TFLOP/s against {c.gpu.bf16_tflops:,.0f} in bf16); FP8 needs Hopper or newer (h100-80gb: "
                    "1,979 TFLOP/s dense FP8)")
    if not spec_kernels(c.spec).transformer_engine:
        yield error(f"fp8.format={c.spec.fp8.format} needs TransformerEngine's layers (attention.backend flash or "
                    f"auto on a GPU; here {c.spec.attention.backend} builds megatron's local layers)")


@rule(scope="training")
def fp8_settings(c: Context) -> Iterator[Finding]:
    """megatron-core's and Megatron-LM's own checks of the FP8 settings, with their arithmetic."""
    f, lay = c.spec.fp8, c.layout
    if not f.on:
        return
    per_stage = c.shape.num_layers // lay.pp
    if f.bf16_layers > per_stage:  # TransformerConfig.__post_init__
        yield error(f"fp8.bf16_layers={f.bf16_layers} exceeds num_layers // pp = {c.shape.num_layers} // {lay.pp} "
                    f"= {per_stage} (megatron-core's limit per pipeline stage)")
    if f.param and not sharded(c.spec.zero.stage, "optimizer"):  # Megatron-LM arguments.py
        yield error(f"fp8.param with zero.stage={c.spec.zero.stage}: --fp8-param-gather needs Megatron-LM's "
                    "distributed optimizer (zero.stage >= 1)")
