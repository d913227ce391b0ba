"""Not a test module: tests/support/runtime_worker.py runs it for items with "dropout_probe" (see
tests/toolkit/runtime/test_syncs_and_dropout.py). On every rank of the plan's grid, seeded as the runtime
seeds (toolkit.mcore.distributed.seed_streams), it records:
  - the seeds: torch's initial seed, and the first draws of megatron's 'model-parallel-rng'
    stream (read from its state in megatron's tracker);
  - with "forward": the dropout masks of one forward of the runtime's model (toolkit.runtime.
    model, megatron's local layers) built with attention_dropout and hidden_dropout 0.5, in the
    order megatron draws them: each is the Bernoulli noise a CPU dropout draws (aten.bernoulli_),
    4-d for attention probabilities [b, heads/tp, s, s], 3-d for hidden states [s(/tp), b, h].
Rank 0 writes OUT/worker.json with every rank's record.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

P = 0.5  # both dropouts: masks of ~half zeros, any two independent draws differ


class DropoutNoise(TorchDispatchMode):
    """The noise tensors of the dropouts run inside (CPU dropout: input * bernoulli_(1 - p) / (1 - p))."""

    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.masks.append(args[0].detach().bool().clone())
        return out


def stream_draws(n: int = 4) -> list[float]:
    """The next draws of megatron's 'model-parallel-rng' stream, read from a copy of its state
    (the stream itself does not advance)."""
    from megatron.core import tensor_parallel

    state = tensor_parallel.get_cuda_rng_tracker().get_states()["model-parallel-rng"]
    g = torch.Generator()
    g.set_state(state)
    return torch.rand(n, generator=g).tolist()


def forward_masks(plan) -> list[torch.Tensor]:
    """One training-mode forward of the runtime's model on fixed tokens (the same on every rank)."""
    from toolkit.mcore import cpu_compat
    from toolkit.runtime.model import build_model_chunks

    [model] = build_model_chunks(plan, zero=False, attention_dropout=P, hidden_dropout=P)
    s, vocab = plan.batch.seq_len, plan.shape.vocab_size
    tokens = torch.randint(0, vocab, (2, s), generator=torch.Generator().manual_seed(3))
    with DropoutNoise() as noise:
        model(tokens, torch.arange(s).expand(2, s), cpu_compat.causal_mask(s), labels=tokens)
    return noise.masks


def probe(plan, item: dict) -> dict:
    from megatron.core import parallel_state as ps

    from toolkit.mcore.distributed import init_parallel, release_model_parallel

    init_parallel(plan.layout, plan.spec.train.seed)
    mine = {"rank": dist.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "initial_seed": torch.initial_seed(),
            "model_parallel_draws": stream_draws()}
    if item.get("forward"):
        masks = forward_masks(plan)
        mine["masks"] = [{"shape": list(m.shape), "bits": bytes(np.packbits(m.flatten().numpy())).hex()}
                         for m in masks]
    release_model_parallel()
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, mine)
    if dist.get_rank() == 0:
        Path(item["out"]).mkdir(parents=True, exist_ok=True)
        (Path(item["out"]) / "worker.json").write_text(json.dumps({"ranks": records}) + "\n")
    return {}
