"""Modules of ours, built from megatron-core's, for model features its GPT layer specs lack
(Gemma 3), and the spec rewrite that puts them in place of megatron's.

- ``post_normed(linear, norm)``: megatron's row-parallel linear (attention's linear_proj, the
  MLP's linear_fc2) with a norm on its output, before the residual add: Gemma's
  post_attention_layernorm / post_feedforward_layernorm. The norm's weight is
  ``<linear>.post_layernorm.weight``, Megatron-Bridge's name for it.
- ``ZeroCenteredRMSNorm``: torch's RMSNorm applying (1 + w), what megatron's
  ``layernorm_zero_centered_gamma`` asks of TransformerEngine's norms; the local spec's
  WrappedTorchNorm refuses that setting, so on CPU this one takes its place.
- ``LocalRopeSelfAttention``: megatron's SelfAttention whose sliding-window layers rotate with
  their own rope base (Gemma's rope_local_base_freq); GPTModel computes one rotary embedding
  for all layers, the global layers keep it.
- ``scale_embeddings``: the word embeddings multiplied by a constant cast to their dtype
  (Gemma3TextScaledWordEmbedding), as a forward hook on GPTModel's embedding.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.utils import get_pg_size

from .cpu_compat import SequenceParallelRMSNorm
from .spec_swap import swap_module


class ZeroCenteredRMSNorm(SequenceParallelRMSNorm):
    """RMSNorm with weight w applied as (1 + w), w initialised to 0 (HF's Gemma3RMSNorm: the
    norm in fp32, times (1 + w) in fp32, cast back to the input's dtype)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config, hidden_size, eps=eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.rms_norm(x.float(), self.normalized_shape, None, self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


@lru_cache(maxsize=None)
def post_normed(linear: type, norm: type) -> type:
    """``linear`` (returning (output, bias)) followed by ``norm`` on its output."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs: Any) -> None:
        linear.__init__(self, input_size, output_size, config=config, **kwargs)
        self.post_layernorm = norm(config=config, hidden_size=output_size, eps=config.layernorm_epsilon)

    def forward(self, x, *args: Any, **kwargs: Any):
        out, bias = linear.forward(self, x, *args, **kwargs)
        return self.post_layernorm(out), bias

    return type(f"{linear.__name__}PostNorm", (linear,), {"__init__": __init__, "forward": forward,
                                                         "__module__": __name__})


class LocalRopeSelfAttention(SelfAttention):
    """SelfAttention whose layer, where ``local_layers`` marks it (by 1-indexed global layer
    number), rotates with rope of base ``local_rope_base`` instead of the model's rope."""

    def __init__(self, *args: Any, local_rope_base: float, local_layers: tuple[bool, ...], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.local_rope = None
        if local_layers[self.layer_number - 1]:
            self.local_rope = RotaryEmbedding(
                kv_channels=self.config.kv_channels, rotary_percent=1.0,
                rotary_interleaved=self.config.rotary_interleaved, rotary_base=local_rope_base,
                use_cpu_initialization=self.config.use_cpu_initialization, cp_group=self.pg_collection.cp)

    def forward(self, hidden_states, attention_mask, *args: Any, **kwargs: Any):
        emb, packed = kwargs.get("rotary_pos_emb"), kwargs.get("packed_seq_params")
        if self.local_rope is not None and emb is not None:
            thd = packed is not None and packed.qkv_format == "thd"
            cp = get_pg_size(self.pg_collection.cp)
            # the model's embedding holds this context-parallel rank's share of the sequence
            kwargs["rotary_pos_emb"] = self.local_rope(emb.size(0) * (1 if thd else cp), packed_seq=thd)
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


def model_spec(spec: Any, shape, te: bool) -> Any:
    """megatron's decoder block spec with the shape's features megatron's GPT specs lack."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if te:
        from megatron.core.extensions.transformer_engine import TENorm, TERowParallelLinear

        row, norm = TERowParallelLinear, TENorm
    else:
        row, norm = RowParallelLinear, ZeroCenteredRMSNorm if shape.zero_centered_norm else SequenceParallelRMSNorm
        if shape.zero_centered_norm:
            spec = swap_module(spec, WrappedTorchNorm, ZeroCenteredRMSNorm)
            spec = swap_module(spec, SequenceParallelRMSNorm, ZeroCenteredRMSNorm)
    if shape.post_norms:
        spec = swap_module(spec, row, post_normed(row, norm))
    if shape.local_rope_theta is not None:
        local = tuple(shape.is_window_layer(i) for i in range(shape.num_layers))
        spec = swap_module(spec, SelfAttention, LocalRopeSelfAttention,
                           {"local_rope_base": shape.local_rope_theta, "local_layers": local})
    return spec


def scale_embeddings(model: torch.nn.Module, scale: float) -> None:
    """Multiply GPTModel's embedding output by ``scale`` cast to its dtype, as transformers'
    Gemma3TextScaledWordEmbedding does (an fp32 buffer cast to the weight's dtype)."""
    factor = torch.tensor(scale, dtype=torch.float32)

    def hook(_module, _args, output):
        return output * factor.to(output.dtype)

    model.embedding.register_forward_hook(hook)



def mark_unmarked_tensor_parallel(model: torch.nn.Module) -> int:
    """Give the tensor-parallel attributes to the two kinds of parameter megatron-core 0.16.1
    builds different on each rank of a tp group but leaves unmarked (GPT-OSS has both): the
    learnable ``softmax_offset`` (attention sinks: one value per head of this rank) and a routed
    expert's fc2 bias (experts at etp 1 are whole, other experts on each tp rank; megatron marks
    their weights and fc1 bias, not that bias). Gradient-norm code counts an unmarked parameter
    once per tp group, as a replica (DeepSpeed's ``is_model_parallel_parameter``, megatron's
    ``param_is_not_tensor_parallel_duplicate``), so at tp > 1 the norm left out the other ranks'
    sinks and expert biases (GPT-OSS tp2 ep2: 5.503 against dp's 5.660) and clipping scaled the
    step differently. (Expert biases exist at etp 1 only: a plan rule.) Returns how many it marked."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    marked = [p for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", False)
              and (n.endswith("core_attention.softmax_offset") or getattr(p, "allreduce", True) is False)]
    for p in marked:
        set_tensor_model_parallel_attributes(p, True, 0, 1)
    return len(marked)
