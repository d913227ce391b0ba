"""Layout-independent initial weights.

megatron-core draws each weight from the default RNG while it builds the modules, so the
draws depend on which modules a rank builds: a second pipeline stage, or an expert-parallel
rank holding experts 2 and 3, starts from other weights than the one-rank model. Here
every random weight is drawn again as a full (unsharded) tensor from a generator seeded
by (seed, its global name), with the init method megatron-core uses for it, and the rank
keeps its tensor-parallel part (megatron's own ``_initialize_affine_weight_cpu``, which
honours the gate/up stride of SwiGLU). Any (tp, pp, ep) layout then starts from the same
model, and the loss curves of two layouts can be compared step by step.

It runs on every device, after megatron's own initialisation (the full tensors are drawn on
the host from a CPU generator and the rank's part is copied to the weight's device; the
largest transient is one full weight in fp32): megatron seeds its GPU initialisation by
tensor-parallel rank only, so every pipeline stage would otherwise start from the same
layers. Deterministic weights (norms = 1, biases = 0) stay as megatron built them; the two 1-D
weights megatron draws (with init_method) are drawn again too: GPT-OSS's attention sinks
(``softmax_offset``, split over tp with the heads: drawn whole, the rank keeps its heads) and
the router's bias (``add_bias_linear``). Gated delta nets (Qwen3-Next) split in_proj, conv1d and
A_log over tp by parts (a rank holds its share of each part): they are drawn whole and each rank
keeps its share of every part (``redraw_parts``), with megatron's init for each (conv1d: torch's
Conv1d default; A_log: log of uniform(1, 16)). Under
ZeRO-3 each weight is gathered alone, drawn on data-parallel rank 0 and re-partitioned by
DeepSpeed (``GatheredParameters(modifier_rank=0)``).
"""
from __future__ import annotations

import contextlib
import re
import zlib
from collections.abc import Callable

import torch

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
# megatron-core's layers that take config.output_layer_init_method: attention's and the MLP's
# output projections, and a gated delta net's out_proj (megatron.core.ssm.gated_delta_net)
OUTPUT_INIT = ("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")


def global_name(chunk, name: str, ep_rank: int) -> str:
    """The parameter's name in the one-rank model: global layer and expert numbers; the
    last stage's copy of a tied embedding is named after the embedding it copies; a LoRA
    layer's base weight is named as without the adapter (toolkit.runtime.lora)."""
    name = name.replace(".base_layer.", ".")
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    m, layer = LAYER.match(name), None
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
    elif (m := MTP_LAYER.match(name)):  # all MTP modules on one stage: their numbers are global
        layer = chunk.mtp.layers[int(m.group(1))].transformer_layer
    e = EXPERT.search(name) if layer is not None else None
    if e:
        local = len(layer.mlp.experts.local_experts)
        name = name[:e.start()] + f".local_experts.{ep_rank * local + int(e.group(1))}." + name[e.end():]
    return name


def init_method(config, name: str) -> Callable[[torch.Tensor], None]:
    """megatron-core's choice: output projections use the depth-scaled method; LoRA's adapters
    peft's (A kaiming-uniform, B zero: the adapted model starts as the base)."""
    if ".lora_A." in name:
        from .lora import lora_a_init

        return lora_a_init
    if ".lora_B." in name:
        return torch.nn.init.zeros_
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
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            dim, shape = param.partition_dim, list(param.shape)
            shape[dim] *= tp_size
            _initialize_affine_weight_cpu(param, shape[0], shape[1], param.shape[dim], dim, init,
                                          stride=param.partition_stride, params_dtype=param.dtype,
                                          rank=tp_rank, world_size=tp_size, skip_set_tensor_parallel_attributes=True)
        else:  # the whole weight (as megatron draws it: an fp32 master, cast to the weight's dtype)
            full = torch.empty(param.shape, dtype=torch.float)
            init(full)
            with torch.no_grad():
                param.copy_(full.to(param.dtype))


RANDOM_1D = ("self_attention.core_attention.softmax_offset", "mlp.router.bias")  # 1-D, drawn by megatron
HEADS_SPLIT = "softmax_offset"  # one value per attention head: split over tp like the heads


def drawn(param: torch.nn.Parameter, name: str = "") -> bool:
    """Random weights are >= 2-D (norm weights and linear biases are 1-D), and RANDOM_1D."""
    from .state import local_shape

    return len(local_shape(param)) >= 2 or name.endswith(RANDOM_1D)


def redraw_parts(param: torch.nn.Parameter, parts: list[int], init: Callable, seed: int, tp_rank: int,
                 tp_size: int) -> None:
    """Draw the full tensor with `seed` and keep this rank's share of each part of its rows, one
    after the other (gated delta nets: toolkit.mcore.gated_delta_net.part_inits)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        full = torch.empty(sum(parts), *param.shape[1:], dtype=torch.float)
        init(full)
    mine = [part.chunk(tp_size)[tp_rank] for part in full.split(parts)]
    with torch.no_grad():
        param.copy_(torch.cat(mine).to(param.dtype))


def redraw_heads(param: torch.nn.Parameter, init: Callable, seed: int, tp_rank: int, tp_size: int) -> None:
    """A per-head vector drawn whole with `seed`; the rank keeps its heads' values."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        full = torch.empty(param.shape[0] * tp_size, dtype=torch.float)
        init(full)
    with torch.no_grad():
        param.copy_(full.chunk(tp_size)[tp_rank].to(param.dtype))


@contextlib.contextmanager
def _writable(param: torch.nn.Parameter):
    """Yields whether this rank writes the weight. ZeRO-3: the whole (tensor-parallel) weight
    is gathered while it is drawn, rank 0 of its data-parallel group writes it and DeepSpeed
    partitions the result again."""
    if not hasattr(param, "ds_id"):
        yield True
        return
    import deepspeed
    import torch.distributed as dist

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        yield dist.get_rank(group=param.ds_process_group) == 0


def _part_inits(chunk) -> dict:
    """The chunk's weights split over tp by parts (gated delta nets), else none."""
    if getattr(chunk.config, "experimental_attention_variant", None) != "gated_delta_net":
        return {}
    from ..mcore.gated_delta_net import part_inits

    return part_inits(chunk)


def init_layout_independent(chunks: list[torch.nn.Module], seed: int) -> None:
    """Redraw every random weight of this rank's chunks; see the module docstring."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    dense = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    expert = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    for chunk in chunks:
        parts = _part_inits(chunk)
        for name, param in chunk.named_parameters():
            split = parts.get(name.replace(".base_layer.", "."))  # a LoRA layer's base: its own name
            if split is None and not drawn(param, name):
                continue
            gname = global_name(chunk, name, ep_rank)
            tp_rank, tp_size = expert if ".experts." in name else dense
            if split is not None:
                with _writable(param) as mine:
                    if mine:
                        redraw_parts(param, *split, seed_of(seed, gname), tp_rank, tp_size)
                continue
            draw = redraw_heads if name.endswith(HEADS_SPLIT) else redraw
            with _writable(param) as mine:
                if mine:
                    draw(param, init_method(chunk.config, gname), seed_of(seed, gname), tp_rank, tp_size)
