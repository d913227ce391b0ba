"""Experts with biases on megatron's local layer spec (GPT-OSS), which megatron-core 0.16.1
cannot backpropagate through as it stands.

Its MLP adds a routed expert's fc2 bias, weighted by the routing probability, in place to the
fc2 output (transformer/mlp.py: ``output += output_bias.unsqueeze(0) * per_token_scale...``).
On the local spec that output is what RowParallelLinear's reduction returned: at expert tensor
parallelism 1 (the only size megatron builds expert biases at) ``_ReduceFromModelParallelRegion``
hands its input back as-is, which autograd treats as a view of a custom Function's output and
refuses to change in place, so the first forward with gradients fails. ``OwnOutputRowParallelLinear``
returns that output as a tensor of its own (a copy; its backward passes the gradient through
unchanged), so megatron's own in-place add runs; the values are megatron's. TransformerEngine's
layers return their own tensors and are left as they are.
"""
from __future__ import annotations

from megatron.core.tensor_parallel import RowParallelLinear


class OwnOutputRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose output is never a view of its reduction's input."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output.clone(), bias


def expert_bias_spec(spec):
    """The MoE layers' spec with OwnOutputRowParallelLinear for every RowParallelLinear (the
    attention's output projection too: one copy of its output, no other change)."""
    from .spec_swap import swap_module

    return swap_module(spec, RowParallelLinear, OwnOutputRowParallelLinear)
