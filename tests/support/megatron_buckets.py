"""torchrun helper (2 ranks, CPU, gloo): megatron-core's gradient buffers where megatron-core itself marks the
shared embedding (pp 2, tied embeddings) and the expert-parallel experts (ep 2), which one rank cannot build.

For each case the runtime's megatron-core model of this rank is wrapped as Megatron-LM's get_model wraps it
(Float16Module, then DistributedDataParallel with the distributed optimizer and overlap_grad_reduce) at a
few bucket sizes; rank 0 prints one JSON line per rank, case and size: the rank's pipeline stage, and per
buffer (dense, expert) the bucket count and the last bucket's elements (megatron-core's ``numel_unpadded``).
tests/toolkit/estimate/test_megatron_buckets.py compares them with data_time.megatron_buckets.
"""
from __future__ import annotations

import json

import torch

from toolkit.mcore import distributed
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

SIZES = (1000, 30000, 200000)
CASES = {"gemma3-tiny pp2": ("gemma3-tiny", {"pp": 2}), "mixtral-tiny ep2": ("mixtral-tiny", {"ep": 2})}


def spec(model: str, parallel: dict) -> dict:
    moe = {"moe": {"token_dispatcher": "allgather"}} if "mixtral" in model else {}
    return {"model": model, "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"}, "zero": {"stage": 1},
            "precision": "bf16", "parallel": parallel, "batch": {"micro": 1, "global": 2, "seq_len": 64},
            "train": {"steps": 2}, **moe}


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from toolkit.runtime.model import build_model_chunks

    torch.cuda.current_device = lambda: "cpu"  # the buffers' device: this CPU rank
    for case, (model, parallel) in CASES.items():
        plan = make_plan(TrainingSpec.from_dict(spec(model, parallel)))
        distributed.init_parallel(plan.layout)
        [chunk] = build_model_chunks(plan)
        for size in SIZES:
            ddp = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
                overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=size),
                Float16Module(chunk.config, chunk))
            out = {"case": case, "rank": torch.distributed.get_rank(), "size": size,
                   "stage": parallel_state.get_pipeline_model_parallel_rank()}
            for name, buffers in (("dense", ddp.buffers), ("expert", ddp.expert_parallel_buffers)):
                out[name] = [[len(b.buckets), b.buckets[-1].numel_unpadded] for b in buffers]
            every = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, out)  # rank 0 prints them: two ranks' lines can interleave
            if torch.distributed.get_rank() == 0:
                print("\n".join(json.dumps(x) for x in every), flush=True)
    distributed.destroy()


if __name__ == "__main__":
    main()
