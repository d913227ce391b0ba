"""LoRA on megatron-core's tensor-parallel linear layers (spec ``finetune: {method: lora}``).

Each target layer ``W`` (a ColumnParallelLinear or RowParallelLinear of a decoder layer)
becomes ``W x + (alpha / rank) B A dropout(x)`` with A [rank, in] and B [out, rank], B
starting at zero; every other weight is frozen, so DeepSpeed's optimizer gets the adapters
only (no fp32 master, gradient or Adam moment of the base). The adapter is split as peft's
``LoraParallelLinear`` splits it, with megatron-core's own layers for the parallel half:
  - column-parallel W (linear_qkv, linear_fc1; a gated delta net's in_proj): A is a plain
    replicated Linear, B a ColumnParallelLinear (this rank's rows of W's output; with sequence
    parallelism B all-gathers the [s/tp, b, rank] input as W does its own);
  - row-parallel W (linear_proj, linear_fc2; a gated delta net's out_proj): A is a
    RowParallelLinear over W's input columns (its reduction, or reduce-scatter with sequence
    parallelism, is over rank elements only), B a plain replicated Linear.
Under sequence parallelism the replicated half sees this rank's slice of the sequence, so it
is marked ``sequence_parallel`` and its gradient is summed over tp (toolkit.runtime.grads, as
for megatron's norms). ``sharded_state_dict`` keeps the base weight's megatron key
(``...linear_qkv.weight``) and adds ``...linear_qkv.lora_A.weight`` / ``lora_B.weight`` as
global tensors (gate/up split of SwiGLU's fc1 as megatron's MLP does for the weight; a gated
delta net's in_proj B one key per part, q, k, v, z, b, a, as GatedDeltaNet.sharded_state_dict
stores the weight, since a tp rank holds its share of every part), so checkpoints load at any
layout and converted weights load into the base.

Why not peft's LoraParallelLinear (peft 0.21.2, megatron-core 0.16.1), which this mirrors:
``LoraConfig(megatron_config=..., megatron_core="megatron.core")`` fails in
``dispatch_megatron`` (KeyError 'fan_in_fan_out': the kwargs it reads are no longer passed);
constructed directly, ``update_layer`` fails (KeyError on ``lora_bias``, never set for it),
and its forward multiplies megatron's ``(output, bias)`` tuple by the scaling (TypeError).
It also sets ``params_dtype = float32`` on the TransformerConfig it is given (the model's
own, shared by every layer), has no ``sharded_state_dict`` (megatron would checkpoint the
base as ``...linear_qkv.base_layer.weight``, replicated, at every tp rank), and leaves the
sequence-parallel gradients of its replicated half unreduced.
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..errors import SpecError

TARGET = re.compile(r"^decoder\.layers\.\d+\.(self_attention|mlp)\.(\w+)$")
ADAPTER = re.compile(r"\.lora_[AB]\.")


def is_adapter(name: str) -> bool:
    """Whether a parameter name (any prefix) is an adapter's."""
    return ADAPTER.search(name) is not None


def lora_a_init(weight: torch.Tensor) -> None:
    """peft's default for A (``init_lora_weights=True``): kaiming-uniform with a = sqrt(5), as
    torch.nn.Linear draws its weight; drawn on the whole [rank, in] tensor."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class LoRALinear(torch.nn.Module):
    """A megatron Column/RowParallelLinear plus its adapter (module docstring). Returns what
    the base returns, (output, bias)."""

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float, dropout: float, swiglu: bool = False,
                 parts: tuple[tuple[str, int], ...] = ()):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.base_layer = base
        self.scaling = alpha / rank
        self.swiglu = swiglu  # linear_fc1 of a gated MLP: B's rows are [gate; up] per tp rank
        self.parts = parts  # a gated delta net's in_proj: B's rows are (part name, rows) one after the other per rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        config, dtype = base.config, base.weight.dtype
        self.row = isinstance(base, RowParallelLinear)
        if self.row:
            self.lora_A = RowParallelLinear(base.input_size, rank, config=config, init_method=lora_a_init, bias=False,
                                            input_is_parallel=True, skip_bias_add=True)
            self.lora_B = torch.nn.Linear(rank, base.output_size, bias=False, dtype=dtype)
            replicated = self.lora_B
        else:
            self.lora_A = torch.nn.Linear(base.input_size, rank, bias=False, dtype=dtype)
            self.lora_B = ColumnParallelLinear(rank, base.output_size, config=config, init_method=torch.nn.init.zeros_,
                                               bias=False, gather_output=base.gather_output)
            replicated = self.lora_A
        with torch.no_grad():
            self.lora_B.weight.zero_()
        replicated.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        out, bias = self.base_layer(x, *args, **kwargs)
        a = self.lora_A(self.dropout(x))
        b = self.lora_B(a[0] if self.row else a)
        b = b if self.row else b[0]
        return out + self.scaling * b.to(out.dtype), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The base's entries under its own keys, the adapter's as global tensors (module docstring)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = self.base_layer.sharded_state_dict(prefix, sharded_offsets, metadata)
        parallel, plain = ("lora_A", "lora_B") if self.row else ("lora_B", "lora_A")
        sd.update(getattr(self, parallel).sharded_state_dict(f"{prefix}{parallel}.", sharded_offsets, metadata))
        sd.update(make_sharded_tensors_for_checkpoint({"weight": getattr(self, plain).weight}, f"{prefix}{plain}.",
                                                      {}, sharded_offsets, tp_group=self.base_layer.tp_group,
                                                      dp_cp_group=metadata["dp_cp_group"]))  # both, or neither is read
        key = f"{prefix}lora_B.weight"
        if self.swiglu:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets, singleton)
        if self.parts:
            from megatron.core.ssm.gated_delta_net import _split_tensor_factory

            names, rows = zip(*self.parts)
            sd[key] = _split_tensor_factory(sd[key], list(rows), list(names), 0)
        return sd


class LoRATargetError(SpecError):
    """The targets name no layer of the model, or a layer megatron-core's local spec does not
    build (TransformerEngine's fused ones)."""


def apply_lora(chunks: list[torch.nn.Module], lora) -> int:
    """Replace every target layer of every decoder layer of these chunks by a LoRALinear and
    freeze everything else; returns how many layers got an adapter. ``lora``: spec.finetune.lora."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    wrapped = layers = 0
    for chunk in chunks:
        layers += len(chunk.decoder.layers) if hasattr(chunk, "decoder") else 0
        targets = [(name, m) for name, m in chunk.named_modules()
                   if (t := TARGET.match(name)) and t.group(2) in lora.targets]
        for name, module in targets:
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                raise LoRATargetError(f"LoRA needs megatron-core's local layers: '{name}' is a "
                                      f"{type(module).__name__} (set attention.backend=unfused)")
            parent_name, _, attr = name.rpartition(".")
            parent = chunk.get_submodule(parent_name)
            swiglu = attr == "linear_fc1" and chunk.config.gated_linear_unit
            setattr(parent, attr, LoRALinear(module, lora.rank, lora.alpha, lora.dropout, swiglu,
                                             _in_proj_parts(parent) if attr == "in_proj" else ()))
            wrapped += 1
        for pname, param in chunk.named_parameters():
            param.requires_grad_(is_adapter(pname))
        if chunk.pre_process and chunk.config.recompute_granularity == "full":
            chunk.embedding.register_forward_hook(_needs_grad)
    if layers and not wrapped:
        raise LoRATargetError(f"finetune.lora.targets {list(lora.targets)} name no layer of this model (multi-latent "
                              "attention has no linear_qkv; a gated delta net has in_proj and out_proj, no "
                              "linear_qkv or linear_proj; MoE layers' MLPs are experts, which get no adapters)")
    return wrapped


def _in_proj_parts(delta_net) -> tuple[tuple[str, int], ...]:
    """(part, this rank's rows) of a gated delta net's in_proj, in its row order, named as
    GatedDeltaNet.sharded_state_dict names the weight's parts (toolkit.models.families.qwen3_next.
    DeltaNetInProj, the converters' table, reads them by these names)."""
    from ..models.families.qwen3_next import DeltaNetInProj

    tp, qk, v, heads = delta_net.tp_size, delta_net.qk_dim, delta_net.v_dim, delta_net.num_value_heads
    return tuple(zip(DeltaNetInProj.part_names, (qk // tp, qk // tp, v // tp, v // tp, heads // tp, heads // tp)))


def _needs_grad(module, inputs, output: torch.Tensor) -> torch.Tensor:
    """The frozen embedding's output marked as requiring a gradient: megatron's full recompute
    runs each layer in a reentrant checkpoint (tensor_parallel.checkpoint), whose output needs a
    gradient only if one of its inputs does; the adapters inside are not inputs, so without this
    nothing before the loss would (transformers' enable_input_require_grads, for the same reason)."""
    return output.requires_grad_(True)
