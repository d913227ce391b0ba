"""Not a test module: the reference an export is compared with, run as an item of
tests/support/runtime_worker.py ("export_reference": RUN_DIR).

It loads a run's final weights (the torch_dist `model/` of its last checkpoint) into
megatron-core's own GPTModel, the whole model on every rank (tp = pp = ep = 1: dist_checkpointing
reshards whatever layout trained them; "reference_sets" may ask for another, e.g. tp 2) the way
`--load MODEL_DIR` starts a run from bare weights,
and rank 0 saves its logits on fixed tokens to OUT/logits.pt, for comparison with the exported
Hugging Face model (tests/recipes/test_recipes.py: assert_export_matches).
"""
from pathlib import Path

import torch

SEQ = 16


def reference_logits(item: dict, world: int) -> dict:
    import torch.distributed as dist

    from toolkit.mcore import cpu_compat
    from toolkit.mcore.distributed import init_parallel
    from toolkit.plan import make_plan
    from toolkit.runtime import checkpoint, state
    from toolkit.runtime.model import build_model_chunks
    from toolkit.spec import TrainingSpec

    run = Path(item["export_reference"])
    spec = TrainingSpec.from_yaml(run / "spec.yaml").with_overrides(
        {"parallel": {}, "cluster.nodes": 1, "cluster.gpus_per_node": world, "zero.stage": 0,
         "mtp.layers": 0, **item.get("reference_sets", {})})  # the main model's logits (megatron computes MTP
    # outputs only towards a loss); "reference_sets": another layout to compute them at (e.g. parallel.tp)
    plan = make_plan(spec).require_valid()
    init_parallel(plan.layout)
    chunks = build_model_chunks(plan)
    checkpoint.load_weights(plan, state.catalog(plan, chunks), checkpoint.resolve(run) / checkpoint.MODEL)
    chunks[0].eval()
    tokens = torch.randint(0, plan.shape.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        logits = chunks[0](tokens, positions, cpu_compat.causal_mask(SEQ))
        if plan.layout.tp > 1:  # the output layer is vocab-parallel
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
    if dist.get_rank() == 0:
        Path(item["out"]).mkdir(parents=True, exist_ok=True)
        torch.save({"tokens": tokens, "logits": logits[..., :plan.shape.vocab_size].float()},
                   Path(item["out"]) / "logits.pt")
    dist.barrier()
    return {}
