"""torchrun helper (2 ranks, CPU, gloo): does DeepSpeed ZeRO-3 prefetch a transformers Llama's parameters,
with and without gradient checkpointing, once its trace is recorded?

For each checkpointing mode (none, reentrant, non-reentrant), a tiny LlamaForCausalLM built under
``deepspeed.zero.Init`` runs 4 steps; every sub-module fetch
(``PartitionedParameterCoordinator.fetch_sub_module``) is counted by the state its non-persistent
parameters are found in: NOT_AVAILABLE (gathered on demand and waited for: exposed on a GPU), INFLIGHT
(prefetched, still gathering) or AVAILABLE (prefetched and done, or kept for reuse); trace invalidations
are counted too, and every all-gather DeepSpeed issues and gradient bucket it sends, with the sizes of
their tensors (what data_time.tensor_calls counts). The bucket sizes are the toolkit's for the model's
width (backends.deepspeed.hidden_bucket_sizes: a prefetch bucket smaller than one MLP Linear, as 0.9 h^2
is for Llama-3-70B against its 235M-element MLP weights) and a reuse distance of 1.2 layers (DeepSpeed's
1e9 elements is 1.2 of Llama-3-70B's layers), so that parameters are released and gathered again as at
scale. Rank 0 prints one JSON line per mode with the partitioned parameters in order, and one per mode
and step.
"""
from __future__ import annotations

import collections
import json
import os

os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))  # DeepSpeed's CPU accelerator

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.zero import partitioned_param_coordinator as ppc  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from toolkit.backends.deepspeed import hidden_bucket_sizes  # noqa: E402
from toolkit.hf.model import leave_process_group  # noqa: E402
from toolkit.mcore.cpu_compat import release_deepspeed_shm  # noqa: E402

HIDDEN, FFN, LAYERS, VOCAB, SEQ = 128, 384, 4, 512, 64
COUNTS: collections.Counter = collections.Counter()
GROUPS: list = []  # each all-gather call's parameters not yet available (numel, in DeepSpeed's order)
REDUCED: list = []  # each gradient bucket's parameters (numel, in the order they were added)
_fetch = ppc.PartitionedParameterCoordinator.fetch_sub_module
_invalidate = ppc.PartitionedParameterCoordinator._invalidate_trace


def fetch_sub_module(self, sub_module, forward):
    for p in sub_module.parameters(recurse=False):
        if not getattr(p, "ds_persist", False):
            COUNTS[f"{'forward' if forward else 'backward'} {p.ds_status.name}"] += 1
    return _fetch(self, sub_module, forward)


def invalidate_trace(self):
    COUNTS["invalidated"] += 1
    return _invalidate(self)


_gather = ppc.PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_


def all_gather_params(self, params, forward, quantize=False):
    """One all-gather collective (all_gather_coalesced) for the parameters not yet available, if any."""
    if any(p.ds_status.name == "NOT_AVAILABLE" for p in params):
        COUNTS[f"{'forward' if forward else 'backward'} gathers"] += 1
        GROUPS.append([p.ds_numel for p in params if p.ds_status.name == "NOT_AVAILABLE"])
    return _gather(self, params, forward, quantize)


_Stage3 = deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3
_reduce = _Stage3._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads


def reduce_ipg_grads(self, communication_data_type):
    """One gradient bucket sent (reduce-scatter), if it holds any."""
    params = self.ipg_buckets[communication_data_type].params
    if params:
        REDUCED.append([p.ds_numel for p in params])
    return _reduce(self, communication_data_type)


_Stage3._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads = reduce_ipg_grads
ppc.PartitionedParameterCoordinator.fetch_sub_module = fetch_sub_module
ppc.PartitionedParameterCoordinator._invalidate_trace = invalidate_trace
ppc.PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_ = all_gather_params


def run(mode: str, rank: int) -> None:
    layer = HIDDEN * (HIDDEN + 2 * HIDDEN // 2 + HIDDEN) + 3 * HIDDEN * FFN
    b = hidden_bucket_sizes(HIDDEN)
    zero = {"stage": 3, "overlap_comm": True, "reduce_bucket_size": b["reduce_bucket_size"],
            "stage3_prefetch_bucket_size": b["stage3_prefetch_bucket_size"],
            "stage3_param_persistence_threshold": b["stage3_param_persistence_threshold"],
            "stage3_max_reuse_distance": int(1.2 * layer)}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(cfg)
    if mode != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    release_deepspeed_shm()  # DeepSpeed's CPU all-reduce segment, which it never unlinks
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(rank))
    if rank == 0:  # the partitioned parameters in forward order (registration order here), for tensor_calls
        print(json.dumps({"mode": mode, "tensors": [p.ds_numel for p in model.parameters() if not p.ds_persist],
                          "prefetch": zero["stage3_prefetch_bucket_size"], "reduce": zero["reduce_bucket_size"]}),
              flush=True)
    for step in range(4):
        COUNTS.clear()
        GROUPS.clear()
        REDUCED.clear()
        engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)
        engine.step()
        if rank == 0:
            print(json.dumps({"mode": mode, "step": step, **COUNTS, "groups": GROUPS, "reduced": REDUCED}), flush=True)
    engine.destroy()


def main() -> None:
    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    for mode in ("none", "reentrant", "non-reentrant"):
        run(mode, rank)
    leave_process_group()  # the engines collected, a barrier, the groups destroyed: gloo's teardown abort


if __name__ == "__main__":
    main()
