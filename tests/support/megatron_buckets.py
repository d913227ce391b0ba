"""torchrun helper (2 ranks, CPU, gloo): megatron-core's gradient buffers where megatron-core itself marks the
shared embedding (pp 2, tied embeddings) and the expert-parallel experts (ep 2), which one rank cannot build.

For each case the runtime's megatron-core model of this rank is wrapped as Megatron-LM's get_model wraps it
(Float16Module, then DistributedDataParallel with the distributed optimizer and overlap_grad_reduce) at a
few bucket sizes; rank 0 prints one JSON line per rank, case and size: the rank's pipeline stage, and per
buffer (dense, expert) the bucket count and the last bucket's elements (megatron-core's ``numel_unpadded``).
tests/toolkit/estimate/test_megatron_buckets.py compares them with data_time.megatron_buckets.

Then, for the pp 2 case, when megatron-core's parameter all-gathers start as Megatron-LM runs them without
interleaving (overlap_param_gather, align_param_gather False): one forward of the first micro-batch through
DistributedDataParallel, logging each module's forward pre-hook (the first one with parameters) and each
bucket group's start_param_sync, in order; one JSON line per rank with ``"gathers"``: the bucket groups, the
groups dispatched before the forward (after zero_grad_buffer, the step's start), and the log.
"""
from __future__ import annotations

import json

import torch

from toolkit.mcore import cpu_compat, distributed
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
        if "pp" in parallel:
            gather_log(chunk, plan, case)
    distributed.destroy()


def gather_log(chunk, plan, case: str) -> None:
    """The order in which megatron-core dispatches the parameter all-gathers of this rank's stage (module doc)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=True,
                                           overlap_param_gather=True, align_param_gather=False, bucket_size=SIZES[0])
    ddp = DistributedDataParallel(chunk.config, config, Float16Module(chunk.config, chunk))
    log: list[str] = []
    groups = list(ddp.bucket_groups)
    for i, group in enumerate(groups):
        def dispatch(*args, _start=group.start_param_sync, _i=i, **kwargs):
            log.append(f"dispatch {_i}")
            return _start(*args, **kwargs)
        group.start_param_sync = dispatch
    for name, module in chunk.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda m, args, _n=name: log.append(f"forward {_n}"), prepend=True)
    ddp.zero_grad_buffer()
    before = [i for i, g in enumerate(groups) if g.param_gather_dispatched]
    seq, hidden = plan.spec.batch.seq_len, plan.shape.hidden_size
    tokens = torch.zeros(1, seq, dtype=torch.long)
    positions = torch.arange(seq).unsqueeze(0)
    if not chunk.pre_process:
        chunk.set_input_tensor(torch.zeros(seq, 1, hidden, dtype=torch.bfloat16))
    with torch.no_grad():
        ddp(input_ids=tokens, position_ids=positions, attention_mask=cpu_compat.causal_mask(seq, tokens.device))
    out = {"case": case, "rank": torch.distributed.get_rank(),
           "stage": parallel_state.get_pipeline_model_parallel_rank(),
           "gathers": {"groups": len(groups), "before": before, "log": log}}
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, out)
    if torch.distributed.get_rank() == 0:
        print("\n".join(json.dumps(x) for x in every), flush=True)


if __name__ == "__main__":
    main()
