"""Model states of a LoRA run (spec ``finetune.method: lora``, toolkit.runtime.lora).

The base is frozen: each GPU holds its weights in the training dtype (16-bit, or fp32 for an
fp32 run), sharded only by ZeRO-3, and nothing else: no gradient, fp32 master or Adam moment
(DeepSpeed's optimizer is given the adapters only). The adapters are trained weights like any
other and cost what toolkit.estimate.memory.stage_states counts for them (ZeRO partitions their
gradients and optimizer states over data parallel). Adapters sit on decoder layers only (not
on MTP modules), so a stage counts its own decoder layers.
"""
from __future__ import annotations

from ..models import ModelShape
from ..models.params import lora_weights
from ..parallel.layout import Layout
from ..parallel.zero import shards
from ..spec import LoRA, TrainingSpec, Zero
from .memory import StageParams, _layer_kinds, _rank_params, layer_kind_keys, stage_states


def adapter_params(shape: ModelShape, layout: Layout, stage: int, lora: LoRA, shared_a: bool = True) -> StageParams:
    """The adapter elements one GPU of the stage holds (tp splits one half of each adapter);
    ``shared_a`` False: the HF Trainer's peft adapters (models.params.lora_weights)."""
    n, largest = 0.0, 0  # per kind of layer (MoE or dense MLP, gated delta net or attention): its targets differ
    for layer, count in _layer_kinds(layer_kind_keys(shape), layout.pipeline(shape.num_layers), stage):
        p = _rank_params(lora_weights(shape, layer, lora.rank, lora.targets, shared_a), layout)
        n, largest = n + count * p.dense, max(largest, p.largest)
    return StageParams(n, 0.0, largest)


def frozen_state_bytes(n: float, shard: int, zero: Zero, precision: str) -> tuple[float, float]:
    """(on the GPU, offloaded) bytes of n frozen parameters: the weights alone."""
    w = 4 if precision == "fp32" else 2
    held = w * n / shards(zero.stage, "params", shard)
    return (0.0, held) if zero.offload_param != "none" else (held, 0.0)


def lora_stage_states(base: StageParams, adapters: StageParams, layout: Layout, zero: Zero, precision: str,
                      copy: str = "kept") -> tuple[float, float, float, float, float]:
    """(params, grads, optimizer, offloaded, step_only) bytes of one GPU of the stage: the frozen
    base's weights plus the adapters' full training states."""
    dense = frozen_state_bytes(base.dense, layout.dp_cp, zero, precision)
    expert = frozen_state_bytes(base.expert, layout.edp, zero, precision)
    params, grads, opt, off, step_only = stage_states(adapters, layout, zero, precision, copy)
    return params + dense[0] + expert[0], grads, opt, off + dense[1] + expert[1], step_only


def shared_a(spec: TrainingSpec) -> bool:
    """Whether one A serves a fused projection's parts: the recipes' runtime adapts megatron-core's fused
    linear_qkv / linear_fc1 / in_proj; peft (target hf) has an A per transformers module (q, k, v, ...)."""
    return spec.target != "hf"


def spec_adapter_params(spec: TrainingSpec, shape: ModelShape, layout: Layout, stage: int) -> StageParams:
    """adapter_params of the spec's LoRA section, as its target builds the adapters."""
    return adapter_params(shape, layout, stage, spec.finetune.lora, shared_a(spec))


def model_states(base: StageParams, adapters: StageParams | None, layout: Layout, zero: Zero, precision: str,
                 copy: str = "kept") -> tuple[float, float, float, float, float]:
    """stage_states of every weight of ``base`` (``adapters`` None), or lora_stage_states of its frozen
    weights and the adapters' (memory.trained_states and the search's fixed terms both take this)."""
    if adapters is None:
        return stage_states(base, layout, zero, precision, copy)
    return lora_stage_states(base, adapters, layout, zero, precision, copy)
