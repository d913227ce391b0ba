"""Not a test module: the live bridge (toolkit.bridge) checked in ONE multi-rank launch.

    python -m torch.distributed.run --nproc_per_node 4 tests/support/bridge_worker.py JOBS.json

Each job {"hf": HF folder, "layout": {tp, pp, ep, ...}, "out": folder}, on the job's grid:
build the model from the HF folder (plan_for + build_model; transformer_config and layer_specs
must describe what was built: sizes, and each chunk's layer count), load_hf, then megatron-core's
logits of the sample tokens (converters.parity_worker.forward, through every pipeline stage)
to OUT/logits.pt; then every weight is changed (x 1.5 + 0.125, the same on every replica) so
that the export is not the file it was loaded from, and the live model is
- saved by megatron-core's own dist_checkpointing.save (torch_dist) to OUT/mcore, which rank 0
  exports with the converters' megatron_to_hf to OUT/converted;
- exported by export_hf(dst=0) (rank 0 keeps every tensor), the same in buckets of 64 KiB, and
  export_hf(dst="all") (each rank keeps a byte checksum of each tensor), and saved by save_hf to
  OUT/bridge.
Rank 0 writes OUT/result.json: names in export order, the converters' names, the names whose
bytes differ from the converters' (export and save), and whether every rank's dst="all" bytes
matched rank 0's. A job with "zero3": run_zero3_job; with "example": run_example_job.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

BUCKET = 1 << 16  # bytes: a bucketed export of the tiny models groups several tensors (and leaves the large alone)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _differ(a: dict, b: dict) -> list[str]:
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or a[n].dtype != b[n].dtype
                  or a[n].shape != b[n].shape or _bytes(a[n]) != _bytes(b[n]))


def _read_folder(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def run_job(job: dict) -> None:
    import hashlib

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import converters
    from converters.parity import sample_tokens
    from converters.parity_worker import forward, sharding_metadata
    from toolkit import bridge
    from toolkit.mcore import distributed
    from toolkit.parallel.layout import Layout

    hf, out = Path(job["hf"]), Path(job["out"])
    distributed.init_parallel(Layout(**job["layout"]))
    plan = bridge.plan_for(hf)
    chunks = bridge.build_model(plan)
    config = bridge.transformer_config(plan)
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "num_moe_experts", "tensor_model_parallel_size", "pipeline_model_parallel_size", "params_dtype")
    built_as_said = all(getattr(config, f) == getattr(chunks[0].config, f) for f in fields) and \
        [len(s.layer_specs) for s in bridge.layer_specs(plan, config)] == [len(c.decoder.layers) for c in chunks]
    bridge.load_hf(chunks, hf)
    shape = bridge.LiveModel(chunks, hf).shape
    logits = forward(chunks, sample_tokens(shape.vocab_size), chunks[0].config)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(logits[..., :shape.vocab_size].contiguous(), out / "logits.pt")
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.mul_(1.5).add_(0.125)
    (out / "mcore").mkdir(exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({f"model{i}": c.sharded_state_dict(metadata=sharding_metadata()) for i, c in enumerate(chunks)},
                            str(out / "mcore"))
    exported = {n: t for n, t in bridge.export_hf(chunks, hf, dst=0) if t is not None}
    bucketed = {n: t.clone() for n, t in bridge.export_hf(chunks, hf, dst=0, bucket_bytes=BUCKET) if t is not None}
    sums = [(n, hashlib.sha1(_bytes(t)).hexdigest()) for n, t in bridge.export_hf(chunks, hf, dst="all")]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sums)
    bridge.save_hf(chunks, hf, out / "bridge")
    if dist.get_rank() == 0:
        converters.megatron_to_hf(out / "mcore", out / "converted", hf_config=hf)
        conv = _read_folder(out / "converted")
        mine = [(n, hashlib.sha1(_bytes(t)).hexdigest()) for n, t in exported.items()]
        result = {"built_as_said": built_as_said, "order": list(exported), "bucket_order": list(bucketed),
                  "bucket_differs": _differ(bucketed, exported), "converted": sorted(conv), "export_differs": _differ(exported, conv),
                  "save_differs": _differ(_read_folder(out / "bridge"), conv),
                  "all_ranks_equal": all(s == mine for s in every),
                  "changed_from_file": _differ(exported, _read_folder(hf)) == sorted(exported)}
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    del chunks
    distributed.release_model_parallel()


def run_zero3_job(job: dict) -> None:
    """{"zero3": true, ...}: the model built as the runtime builds it under ZeRO-3 (inside
    deepspeed.zero.Init, every parameter partitioned over data parallel), load_hf into the
    partitions, export_hf gathering them: the export must be the HF file, byte for byte."""
    from toolkit import bridge
    from toolkit.mcore import distributed
    from toolkit.parallel.layout import Layout
    from toolkit.plan import make_plan
    from toolkit.runtime.model import build_model_chunks

    hf, out = Path(job["hf"]), Path(job["out"])
    distributed.init_parallel(Layout(**job["layout"]))
    plan = bridge.plan_for(hf)
    plan = make_plan(plan.spec.with_overrides({"zero.stage": 3}), shape=plan.shape)
    chunks = build_model_chunks(plan)
    params = [p for c in chunks for p in c.parameters()]
    partitioned = all(hasattr(p, "ds_id") and p.numel() < p.ds_numel for p in params if p.ds_numel > 1)
    bridge.load_hf(chunks, hf)
    exported = {n: t for n, t in bridge.export_hf(chunks, hf, dst=0) if t is not None}
    if dist.get_rank() == 0:
        result = {"partitioned": partitioned, "order": list(exported),
                  "export_differs": _differ(exported, _read_folder(hf))}
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    del chunks, params
    distributed.release_model_parallel()


def run_example_job(job: dict) -> None:
    """{"example": true, "out"}: examples/bridge_rl_loop.py's main on this launch's ranks (ZeRO-3
    over all of them); rank 0 writes OUT/result.json: its exit code and the line it printed."""
    import contextlib
    import io

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # importable by the spawned process
    import bridge_rl_loop

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = bridge_rl_loop.main(["--out", str(Path(job["out"]) / "run")])
    if dist.get_rank() == 0:
        (Path(job["out"]) / "result.json").write_text(json.dumps({"code": code, "printed": printed.getvalue()}))
    dist.barrier()


def main(argv: list[str]) -> None:
    from toolkit.mcore import distributed

    jobs = json.loads(Path(argv[0]).read_text())
    distributed.init_process_group()
    try:
        for job in jobs:
            (run_example_job if job.get("example") else run_zero3_job if job.get("zero3") else run_job)(job)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
