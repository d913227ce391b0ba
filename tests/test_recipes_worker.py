"""Not a test module: a one-rank helper that tests/test_recipes.py launches with torchrun.

It loads a run's final weights (the torch_dist `model/` of its last checkpoint) into
megatron-core's own GPTModel at tp = pp = 1 (dist_checkpointing reshards whatever layout
trained them) the way `--load MODEL_DIR` starts a run from bare weights, and saves its
logits on fixed tokens, for comparison with the exported Hugging Face model.

    python -m torch.distributed.run --nproc_per_node 1 tests/test_recipes_worker.py RUN_DIR OUT.pt
"""
import sys
from pathlib import Path

import torch

SEQ = 16


def main(run: Path, out: Path) -> None:
    from toolkit.plan import make_plan
    from toolkit.runtime import checkpoint, cpu_compat, state
    from toolkit.runtime.distributed import Grid, init_parallel
    from toolkit.runtime.model import build_model_chunks
    from toolkit.spec import TrainingSpec

    spec = TrainingSpec.from_yaml(run / "spec.yaml").with_overrides(
        {"parallel": {}, "cluster.gpus_per_node": 1, "zero.stage": 0,
         "mtp.layers": 0})  # the main model's logits (megatron computes MTP outputs only towards a loss)
    plan = make_plan(spec).require_valid()
    init_parallel(Grid.of(plan.layout))
    chunks = build_model_chunks(plan)
    checkpoint.load_weights(plan, state.catalog(plan, chunks), checkpoint.resolve(run) / checkpoint.MODEL)
    chunks[0].eval()
    tokens = torch.randint(0, plan.shape.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        logits = chunks[0](tokens, positions, cpu_compat.causal_mask(SEQ))
    torch.save({"tokens": tokens, "logits": logits[..., :plan.shape.vocab_size].float()}, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
