"""The one place that lets megatron-core 0.16 run on CPU (gloo), applied only when no CUDA
device exists. Each change is tested in tests/toolkit/mcore/test_cpu_compat.py.

megatron-core assumes CUDA in a few unconditional calls:
  1. torch.cuda.current_device() as a device argument (rotary embedding, MoE router,
     pipeline p2p): answered with "cpu";
  2. torch.cuda.synchronize() in the dist_checkpointing writer: a no-op;
  3. the training RNG tracker stores CUDA RNG states: ``cpu_rng.CpuRNGStatesTracker``, the
     same tracker over the CPU generator, is installed instead (megatron's seeding then gives
     tensor-parallel ranks their own attention-dropout streams, as on a GPU);
  4. moe_utils reads te_general_gemm, which is undefined without TransformerEngine
     (NameError in the router): set to None so the plain matmul path runs.
  5. TransformerConfig fusions that need CUDA kernels are switched off (CPU_CONFIG).
  6. GPTModel with tied embeddings and pp > 1 moves the last stage's output-layer copy
     with ``weight.data.cuda()`` before the first/last-stage all-reduce: inside that one
     method, ``Tensor.cuda`` leaves the tensor where it is.
  7. Activation recompute (megatron's CheckpointFunction, selective and full) saves and
     restores the CUDA RNG state around the recomputed forward: with no CUDA generator its
     get/set are no-ops (the torch CPU RNG state and the tracker's states are saved and
     restored by the same code, so the recomputed forward draws the same dropout masks).
  8. Context parallelism: RotaryEmbedding slices its frequencies per cp rank with
     ``get_pos_emb_on_this_cp_rank``, which builds its index with ``pin_memory=True`` and
     ``.cuda()``: both are no-ops while it runs.
  9. Sliding-window attention (Mistral): megatron's local softmax builds the window mask
     with ``get_sliding_window_causal_mask`` on "cuda": it is built on the CPU.
  10. Multi-latent attention with the local spec (``local_mla``, its own section below).
  11. dist_checkpointing's writer hands its results back through a queue served by a
      multiprocessing Manager it *spawns* (a fresh interpreter that re-runs the caller's main
      module and imports torch to unpickle the results: ~2.5 s of CPU per rank, once per
      process, a sixth of a tiny CPU run). Every save here is synchronous (``dist_checkpointing
      .save`` without ``async_sharded_save``: the results are put and taken in this process),
      so a ``queue.Queue`` carries them (``in_process_save_queue``). Not an incompatibility,
      a cost: on a GPU megatron's own queue stays. A run with ``train.async_save`` writes in
      forked writers, whose results only a Manager's queue carries back: it gets one
      (toolkit.runtime.async_save.results_queue) and pays the spawn once.
  12. torchrun does not set LOCAL_SIZE, which DeepSpeed's own launcher sets to the ranks on
      the host; without it DeepSpeed's CPU accelerator counts NUMA nodes by running
      ``numactl --hardware`` (a subprocess) in every ``device_count()``, which ZeRO-3 calls on
      every gradient reduce-scatter (``__avg_scatter_grads``). ``local_size_from_torchrun``
      sets it from torchrun's LOCAL_WORLD_SIZE before DeepSpeed's communication starts.
  13. megatron's ``jit_fuser`` is ``torch.compile`` (torch >= 2.2), applied as a decorator to
      its fused functions when megatron is imported: 41 of them, whose decoration imports
      torch's inductor (1.6 s of CPU in every process that imports megatron.core), and a call
      builds C++ with inductor at the first step and for every new shape (a tiny GPT-OSS run's
      quick_gelu). ``eager_fusers``, called before megatron is imported, sets
      TORCHDYNAMO_DISABLE=1 (torch's own switch: ``torch.compile`` returns the function as it
      is), so they run eager, the same functions. A user's TORCHDYNAMO_DISABLE is kept. Called
      by the command line's CPU runs and verify's ranks (``toolkit convert`` sets the variable on
      any machine: a conversion calls none of them); in-process tests keep megatron's default
      (tests/toolkit/estimate/test_activations.py measures what its compiled GPT-OSS activation
      keeps for the backward: eager keeps 4% more per layer).
The causal mask is the remaining gap: megatron builds its default mask on "cuda", so
callers pass an explicit boolean mask (``causal_mask``).

DeepSpeed on CPU has one gap of its own (``release_deepspeed_shm``): its shared-memory
all-reduce creates a 66 MB /dev/shm segment per rank and never unlinks it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from ..kernels import eager_fusions

CPU_CONFIG = dict(use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False,
                  masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
                  bias_activation_fusion=False)

_applied = False
NO_CUDA_RNG_STATE = torch.empty(0, dtype=torch.uint8)


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Patch what megatron-core needs on CPU; returns whether anything was patched. Never on a GPU."""
    global _applied
    if not needed():
        return False
    if _applied:
        return True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core import tensor_parallel

    from . import cpu_rng

    cpu_rng.install()
    tensor_parallel.random._get_cuda_rng_state = lambda *a, **k: NO_CUDA_RNG_STATE
    tensor_parallel.random._set_cuda_rng_state = lambda *a, **k: None
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = tensors_stay_on_cpu(
        LanguageModule.setup_embeddings_and_output_layer)
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    sliced = tensors_stay_on_cpu(without_pinned_memory(rope_utils.get_pos_emb_on_this_cp_rank))
    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = sliced
    fused_softmax.get_sliding_window_causal_mask = on_cpu_device(fused_softmax.get_sliding_window_causal_mask)
    local_mla()
    in_process_save_queue()
    _applied = True
    return True


def eager_fusers() -> bool:
    """Item 13: megatron's torch.compile'd fusions eager on CPU (True when set). Only before
    megatron is imported: its decorators have run by then, and nothing changes."""
    if not needed() or "megatron.core" in sys.modules:
        return False
    eager_fusions()
    return True


def local_size_from_torchrun() -> bool:
    """Item 12: LOCAL_SIZE as DeepSpeed's launcher sets it, from torchrun's LOCAL_WORLD_SIZE
    (CPU only; returns whether it was set). DeepSpeed then reads the host's rank count where it
    would run numactl, and its shared-memory all-reduce comes up as under its own launcher
    (``release_deepspeed_shm`` unlinks its segment)."""
    if not needed() or "LOCAL_SIZE" in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        return False
    os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    return True


def in_process_save_queue() -> None:
    """Item 11: megatron's synchronous torch_dist save puts its write results into
    ``filesystem_async._results_queue`` (``write_preloaded_data_multiproc``, run in this process
    by ``AsyncRequest.execute_sync``) and takes them out again (``retrieve_write_results``,
    ``get_nowait``): an in-process queue instead of the spawned Manager's."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


# ---------------------------------------------------------------------------- multi-latent attention
def local_mla() -> None:
    """Let megatron-core 0.16's MLASelfAttention build with the local (non-TE) layer spec.

    Two things stop it as shipped (Megatron-LM issue #1589):
      - MultiLatentAttention passes ``k_channels`` / ``v_channels`` to its core attention,
        which megatron's local DotProductAttention does not accept. It needs neither: its
        query/key head size comes from the tensors, its output size is kv_channels * heads
        (the caller sets kv_channels = v_head_dim) and the softmax scale is given. The
        wrapper drops them only in exactly that case and refuses any other.
      - without TransformerEngine, megatron.core.extensions.transformer_engine leaves
        ``TELinear`` a MagicMock *instance* and the module's HAVE_TE True, so
        ``isinstance(self.linear_proj, TELinear)`` raises TypeError: HAVE_TE is set False in
        multi_latent_attention only, where the TE classes are not importable anyway.
    """
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if isinstance(mla.TELinear, type):  # a real TransformerEngine: nothing to do
        return
    mla.HAVE_TE = False
    if getattr(DotProductAttention.__init__, "_drops_mla_channels", False):
        return
    original = DotProductAttention.__init__

    import inspect

    def init(self, config, *args, **kwargs):
        k_channels, v_channels = kwargs.pop("k_channels", None), kwargs.pop("v_channels", None)
        if k_channels is not None or v_channels is not None:
            scale = inspect.signature(original).bind_partial(self, config, *args, **kwargs).arguments.get(
                "softmax_scale")
            if scale is None or v_channels != config.kv_channels:
                raise ValueError(f"local DotProductAttention cannot honour k_channels={k_channels}, "
                                 f"v_channels={v_channels} (kv_channels={config.kv_channels}, "
                                 f"softmax_scale={scale})")
        init.original(self, config, *args, **kwargs)

    init.original = original
    init._drops_mla_channels = True
    DotProductAttention.__init__ = init


def tensors_stay_on_cpu(fn):
    """``fn`` with ``torch.Tensor.cuda`` returning the tensor itself while it runs."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    return wrapped


def without_pinned_memory(fn):
    """``fn`` with ``torch.tensor``'s pin_memory ignored while it runs (no pinned allocator)."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        real = torch.tensor
        torch.tensor = lambda *a, pin_memory=False, **k: real(*a, **k)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.tensor = real

    return wrapped


def on_cpu_device(fn):
    """``fn`` with ``torch.ones(..., device="cuda")`` allocating on the CPU while it runs."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        real = torch.ones
        torch.ones = lambda *a, device=None, **k: real(*a, device="cpu" if device == "cuda" else device, **k)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.ones = real

    return wrapped


def config_overrides(cuda: bool | None = None) -> dict:
    """TransformerConfig overrides for ranks without CUDA (``cuda``; default: this machine),
    empty on a GPU."""
    return {} if (not needed() if cuda is None else cuda) else dict(CPU_CONFIG)


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """megatron's convention: True = masked out, shape [1, 1, s, s]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


# ---------------------------------------------------------------------------- sequence parallel norms
class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm that accepts sequence parallelism. megatron-core's local spec uses
    WrappedTorchNorm, which refuses sequence_parallel=True because without TE/apex nothing
    marks the weight for the tensor-parallel gradient all-reduce. RMSNorm is per token,
    so the forward is the same on a sequence shard; the weight is marked
    ``sequence_parallel`` exactly as TE/apex norms do, and megatron's finalize_model_grads
    (or the runtime's gradient hook) all-reduces it over tp."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def swap_torch_norms(spec, new_cls):
    """A copy of a megatron ModuleSpec tree with WrappedTorchNorm replaced by `new_cls`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from .spec_swap import swap_module

    return swap_module(spec, WrappedTorchNorm, new_cls)


_shm_released: set[str] = set()  # the segments this process unlinked: one per start of deepspeed.comm (a port each)


def deepspeed_shm_segment(rank: int) -> Path:
    """The /dev/shm file DeepSpeed's CPU shared-memory all-reduce creates for ``rank``
    (deepspeed/ops/csrc/cpu/comm/shm.cpp: ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_
    <MASTER_PORT>_<rank>``)."""
    return Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                               f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_deepspeed_shm() -> bool:
    """Unlink this rank's DeepSpeed shared-memory all-reduce segment; returns whether it did.

    DeepSpeed's CPU communication op (deepspeed_shm_comm, used when the launcher's LOCAL_SIZE
    equals the world size, i.e. every rank on one host) maps a 66 MB segment per rank when
    deepspeed.comm comes up, and never unlinks it: every run would leave 66 MB per rank in
    /dev/shm until it fills. Once every rank has mapped every other rank's segment (all ranks
    are past deepspeed.comm's initialisation: a barrier), each rank unlinks its own name; the
    mappings stay valid until the processes exit. Call it on every rank, after deepspeed.comm
    is initialised; it does nothing on GPU, without the op, or for a segment it unlinked before."""
    from deepspeed import comm

    backend = comm.comm.cdb
    if backend is None or getattr(backend, "shm_comm_op", None) is None:
        return False
    import torch.distributed as dist

    if os.environ.get("LOCAL_SIZE") != str(dist.get_world_size()):
        return False
    segment = deepspeed_shm_segment(dist.get_rank())
    if str(segment) in _shm_released:
        return False
    dist.barrier()
    _shm_released.add(str(segment))
    if not segment.exists():
        return False
    segment.unlink()
    return True
