"""torchrun helper of the conversion tests, one launch for two kinds of job.

A job with "megatron_dir" is a parity job: converters.parity_worker.run_job, exactly what
`toolkit verify` runs (megatron-core loads the checkpoint and records its logits).

Any other job: megatron-core itself writes checkpoints for the export tests.

Rank 0 writes its thread count after each job to JOBS.threads.json.

For each job (one HF config, one layout): build a random GPTModel (toolkit.runtime), make
its norms and biases non-trivial, record its logits, then save it twice the way
Megatron does: ``dist_checkpointing.save(model.sharded_state_dict(), dir)`` (torch_dist)
and each rank's ``state_dict()`` in the legacy folder layout (no args).

    python -m torch.distributed.run --nproc_per_node N tests/support/convert_megatron_writer.py JOBS.json
"""
from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist


def perturb(chunks) -> None:
    """Norms 1 + noise ((1 + w) norms: w = noise), biases, the shared-expert gate and the router's
    expert bias (a buffer) noise, seeded by name and stage so tp replicas agree."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            centre = 0.0 if chunk.config.layernorm_zero_centered_gamma else 1.0
            for name, p in [*chunk.named_parameters(), *chunk.named_buffers()]:
                if "norm" not in name and not name.endswith(("bias", "gate_weight")):
                    continue
                g = torch.Generator().manual_seed(zlib.crc32(f"{pp}/{v}/{name}".encode()))
                noise = torch.randn(p.shape, generator=g)
                p.copy_(centre + 0.1 * noise if "norm" in name else 0.05 * noise)


def save_legacy(chunks, out: Path, layout) -> None:
    from megatron.core import parallel_state as ps

    from converters.formats.torch_legacy import model_key, rank_dir
    from converters.parity_worker import rank_of_this_process

    if ps.get_expert_data_parallel_rank() != 0:  # as Megatron-LM: one file per (tp, pp, ep) rank
        return
    d = out / rank_dir(*rank_of_this_process(), layout.pp, layout.ep)
    d.mkdir(parents=True)
    state = {model_key(v, len(chunks)): c.state_dict() for v, c in enumerate(chunks)}
    torch.save({"checkpoint_version": 3.0, "iteration": 1, **state}, d / "model_optim_rng.pt")


def run(job: dict) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from toolkit.parallel.layout import Layout
    from converters.parity import sample_tokens
    from converters.parity_worker import build, forward
    from toolkit.mcore.distributed import release_model_parallel
    from toolkit.models import read_hf_config, shape_from_hf

    shape = replace(shape_from_hf(read_hf_config(job["hf_config"])), mtp_layers=job.get("mtp_layers", 0))
    layout = Layout(**job["layout"])
    torch.manual_seed(1234)
    chunks, _ = build(shape, layout)
    perturb(chunks)
    out = Path(job["out"])
    logits = forward(chunks, sample_tokens(shape.vocab_size), chunks[0].config)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(logits[..., :shape.vocab_size].contiguous(), out / "logits.pt")
    from converters.parity_worker import sharding_metadata

    sharded = chunks[0].sharded_state_dict(metadata=sharding_metadata()) if len(chunks) == 1 else \
        {f"model{v}": c.sharded_state_dict(metadata=sharding_metadata()) for v, c in enumerate(chunks)}
    (out / "dist").mkdir(exist_ok=True)
    dist_checkpointing.save(sharded, str(out / "dist"))
    save_legacy(chunks, out / "legacy", layout)
    dist.barrier()
    del chunks
    release_model_parallel()


def main(argv: list[str]) -> None:
    from toolkit.mcore import distributed

    distributed.init_process_group()
    try:
        from converters.parity_worker import run_job

        threads = []  # this process's threads after each job: megatron's gloo groups must not pile up
        for job in json.loads(Path(argv[0]).read_text()):
            run_job(job) if "megatron_dir" in job else run(job)
            threads.append(len(os.listdir("/proc/self/task")))
        if dist.get_rank() == 0:
            Path(argv[0]).with_suffix(".threads.json").write_text(json.dumps(threads))
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
