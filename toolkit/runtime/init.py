"""Layout-independent initial weights.

megatron-core draws each weight from the default RNG while it builds the modules, so the
draws depend on which modules a rank builds: a second pipeline stage, or an expert-parallel
rank holding experts 2 and 3, starts from other weights than the one-rank model. Here
every random weight is drawn again as a full (unsharded) tensor from a generator seeded
by (seed, its global name), with the init method megatron-core uses for it, and the rank
keeps its tensor-parallel part (megatron's own ``_initialize_affine_weight_cpu``, which
honours the gate/up stride of SwiGLU). Any (tp, pp, ep) layout then starts from the same
model, and the loss curves of two layouts can be compared step by step.

Deterministic weights (norms = 1, biases = 0) are left as built. Used with CPU
initialisation (``use_cpu_initialization``); on a GPU megatron's own initialisation runs.
"""
from __future__ import annotations

import re
import zlib
from collections.abc import Callable

import torch

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
OUTPUT_INIT = ("linear_proj.weight", "linear_fc2.weight")


def global_name(chunk, name: str, ep_rank: int) -> str:
    """The parameter's name in the one-rank model: global layer and expert numbers; the
    last stage's copy of a tied embedding is named after the embedding it copies."""
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    m = LAYER.match(name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
        e = EXPERT.search(name)
        if e:
            local = len(layer.mlp.experts.local_experts)
            name = name[:e.start()] + f".local_experts.{ep_rank * local + int(e.group(1))}." + name[e.end():]
    return name


def init_method(config, name: str) -> Callable[[torch.Tensor], None]:
    """megatron-core's choice: output projections use the depth-scaled method."""
    if name.startswith("embedding."):
        return config.embedding_init_method
    if name.endswith(OUTPUT_INIT):
        return config.output_layer_init_method
    return config.init_method


def seed_of(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def redraw(param: torch.nn.Parameter, init: Callable, seed: int, tp_rank: int, tp_size: int) -> None:
    """Draw the full tensor with `seed` and keep this rank's tensor-parallel part."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if getattr(param, "tensor_model_parallel", False):
            dim, shape = param.partition_dim, list(param.shape)
            shape[dim] *= tp_size
            _initialize_affine_weight_cpu(param, shape[0], shape[1], param.shape[dim], dim, init,
                                          stride=param.partition_stride, params_dtype=param.dtype,
                                          rank=tp_rank, world_size=tp_size, skip_set_tensor_parallel_attributes=True)
        else:
            full = torch.empty(param.shape, dtype=torch.float)
            init(full)
            with torch.no_grad():
                param.copy_(full)


def init_layout_independent(chunks: list[torch.nn.Module], seed: int) -> None:
    """Redraw every random (>= 2-D) weight of this rank's chunks; see the module docstring."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    dense = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    expert = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if param.dim() < 2:
                continue
            gname = global_name(chunk, name, ep_rank)
            tp_rank, tp_size = expert if ".experts." in name else dense
            redraw(param, init_method(chunk.config, gname), seed_of(seed, gname), tp_rank, tp_size)
