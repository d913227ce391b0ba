"""Gradient reductions that megatron-core's finalize_model_grads does and DeepSpeed does not.

DeepSpeed averages every gradient over the data-parallel group (experts: over the expert
data-parallel group). Three things megatron-core adds are done here:

1. Tensor-parallel replicas that see different data: under sequence parallelism the norms
   and the router see a different slice of the sequence on each tp rank (megatron marks
   them ``sequence_parallel``); q/k layernorms see other heads on each tp rank. Their
   gradients are summed over the tp group (the same rule as megatron's
   ``_allreduce_non_tensor_model_parallel_grads``). With pp > 1 the runtime holds
   DeepSpeed's reduction until the pipeline flush, so they are summed there once per step
   on the accumulated gradients, in one flat all-reduce per kind (``allreduce_tp_deferred``).
   With pp = 1 DeepSpeed reduces (ZeRO-2/3: partitions) gradients in its own hooks during
   backward, overlapped with it, so the sum happens earlier, per micro-batch, in a hook on
   the parameter: it runs when the gradient is computed, before DeepSpeed's accumulate
   hooks. All tp ranks run the same graph, so the hooks fire in the same order on each.
2. Tied embeddings, or MTP modules (which embed the shifted tokens on the last stage), with
   pp > 1: the first and the last stage each hold a copy of the word embedding; their
   gradients are summed over megatron's embedding group after the pipeline flush, before
   DeepSpeed's data-parallel reduction (the runtime defers that one when pp > 1).
3. The last stage's copy is marked ``ds_pipe_replicated`` so DeepSpeed's gradient norm
   counts the tied weight once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist



def tp_reduction(name: str, param: torch.nn.Parameter, config) -> str | None:
    """How this tp-replicated parameter's gradient is combined over tp ("sum", "mean") or None.

    Never an expert's (``allreduce`` False: ep > 1). megatron-core marks a routed expert's fc2 bias
    ``sequence_parallel`` like any RowParallelLinear bias (GPT-OSS: expert biases exist at etp 1
    only), yet each rank's experts already saw every token routed to them (the dispatcher gathers
    over tp x ep) and the ranks of a tp group hold other experts: a sum over tp would add another
    expert's gradient to each bias (GPT-OSS at tp2 ep2 etp1 then left the data-parallel curve at
    step 2, its first gradient norm 5.867 against dp's 5.660)."""
    if getattr(param, "allreduce", True) is False:
        return None
    if getattr(param, "average_gradients_across_tp_domain", False):
        return "mean"
    if config.sequence_parallel and getattr(param, "sequence_parallel", False):
        return "sum"
    if config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name):
        return "sum"
    return None


def tp_replicas(chunks: list[torch.nn.Module]) -> list[tuple[torch.nn.Parameter, str]]:
    """(parameter, "sum" | "mean") of rule 1 ([] when tp = 1)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return []
    out = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            op = tp_reduction(name, param, chunk.config) if param.requires_grad else None
            if op is not None:
                out.append((param, op))
    return out


def register_tp_grad_hooks(replicas: list[tuple[torch.nn.Parameter, str]]) -> list:
    """Per-micro-batch hooks for rule 1 (pp = 1); returns the handles."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group() if replicas else None
    return [param.register_hook(_allreduce_hook(op, group)) for param, op in replicas]


def allreduce_tp_deferred(replicas: list[tuple[torch.nn.Parameter, str]], grad_of) -> None:
    """Rule 1 at the pipeline flush: each kind's accumulated gradients in one flat all-reduce
    over tp; ``grad_of(param)`` is where the engine accumulates the parameter's gradient."""
    from megatron.core import parallel_state as ps
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not replicas:
        return
    group, size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    for kind in ("sum", "mean"):
        grads = [g for p, op in replicas if op == kind and (g := grad_of(p)) is not None]
        if not grads:
            continue
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        if kind == "mean":
            flat /= size
        for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(new)


def _allreduce_hook(op: str, group):
    """Sum (then divide, for "mean": gloo has no AVG) over the tp group."""
    size = dist.get_world_size(group)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad / size if op == "mean" else grad

    return hook


def tied_embedding_weight(chunks: list[torch.nn.Module]) -> torch.nn.Parameter | None:
    """This rank's copy of a word embedding shared between first and last stage (pp > 1), if it trains."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group():
        return None
    chunk = chunks[0] if ps.is_pipeline_first_stage() else chunks[-1]
    shared = chunk.share_embeddings_and_output_weights or chunk.config.mtp_num_layers  # MTP embeds on the last stage
    weight = chunk.shared_embedding_or_output_weight() if shared else None
    return weight if weight is not None and weight.requires_grad else None  # frozen (LoRA's base): no gradient


def allreduce_tied_embedding_grad(weight: torch.nn.Parameter | None, grad: torch.Tensor | None) -> None:
    """Rule 2: sum the copies' gradients over the embedding group (in place)."""
    from megatron.core import parallel_state as ps

    if weight is not None and grad is not None:
        dist.all_reduce(grad, group=ps.get_embedding_group())


def mark_pipe_replicated(chunks: list[torch.nn.Module]) -> None:
    """Rule 3: megatron marks the last stage's copy ``shared``."""
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param, "shared", False):
                param.ds_pipe_replicated = True
