"""One rank of ``converters.verify``: build megatron-core's GPTModel at the checkpoint's
layout (toolkit.runtime), load the checkpoint the way Megatron-LM does (legacy: this
rank's ``model_optim_rng.pt`` with strict load_state_dict; torch_dist:
dist_checkpointing.load of the model's own sharded state dict), run the tokens through
every pipeline stage and save the logits.

    python -m torch.distributed.run --nproc_per_node N -m converters.parity_worker JOBS.json
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.mcore import cpu_compat, distributed
from toolkit.mcore.model import build_model_chunks
from toolkit.parallel.layout import Layout

from .layout import conversion_plan
from .parity import SEQ_LEN, sample_tokens


def build(shape, layout, seq_len: int = SEQ_LEN):
    """fp32 model chunks of this rank (parallel_state set up for the layout; MoE layers with
    SequentialMLP experts and the allgather token dispatcher, which run on CPU)."""
    plan = conversion_plan(shape, layout, precision="fp32", seq_len=seq_len, token_dispatcher="allgather")
    distributed.init_parallel(plan.layout)
    return build_model_chunks(plan), plan


@contextlib.contextmanager
def main_logits_only(chunks):
    """GPTModel computes its MTP outputs only towards a loss (it needs labels): the forward
    below asks for the main model's logits, so the MTP block sits this one out."""
    saved = [(m, m.mtp_process, m.config.mtp_num_layers) for m in chunks]
    for m in chunks:
        m.mtp_process, m.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        for m, process, layers in saved:
            m.mtp_process, m.config.mtp_num_layers = process, layers


def rank_of_this_process() -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())


_GROUPED = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def sequential_names(sd: dict) -> dict:
    """Grouped-GEMM expert names (TEGroupedMLP: ``experts.linear_fc1.weight{e}`` and, with
    biases, ``bias{e}``, one ``_extra_state`` per module) as SequentialMLP's
    (``experts.local_experts.{e}.linear_fc1.weight``): the same [out, in] matrix per expert. TransformerEngine, which the grouped
    module needs, does not run on CPU, so a grouped checkpoint is checked through this."""
    out = {}
    for name, value in sd.items():
        m = _GROUPED.search(name)
        if m:
            stem = name[:m.start()]
            expert = f"{stem}.mlp.experts.local_experts.{m.group(3)}.{m.group(1)}"
            out[f"{expert}.{m.group(2)}"] = value
            out[f"{expert}._extra_state"] = None
        elif not re.search(r"\.mlp\.experts\.linear_fc[12]\._extra_state$", name):
            out[name] = value
    return out


def load_legacy(chunks, ck) -> None:
    from .formats.torch_legacy import chunk_models, load_rank_file

    path = ck.rank_files[rank_of_this_process()]
    for model, sd in zip(chunks, chunk_models(load_rank_file(path), path)):
        model.load_state_dict(sequential_names(sd) if ck.grouped_gemm else sd, strict=True)


def sharding_metadata() -> dict:
    """What Megatron-LM passes to sharded_state_dict (GPTModel needs dp_cp_group to tie an
    MTP stage's embedding copy to the first stage's)."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    return ensure_metadata_has_dp_cp_group(None)


def load_dist(chunks, directory: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()  # as Megatron-LM does at start-up: common.pt holds an argparse.Namespace
    sharded = {f"model{i}": m.sharded_state_dict(metadata=sharding_metadata()) for i, m in enumerate(chunks)}
    # validated as strictly as megatron can: every shard accessed once, no key missing or unexpected
    state = dist_checkpointing.load(sharded, str(directory), validate_access_integrity=True, strict="raise_all")
    for i, m in enumerate(chunks):
        m.load_state_dict(state[f"model{i}"], strict=True)


def forward(chunks, tokens: torch.Tensor, config) -> torch.Tensor | None:
    """Run chunk 0 of stage 0, chunk 0 of stage 1, ..., chunk 1 of stage 0, ...; returns the
    full-vocabulary logits [batch, seq, padded vocab] on the last stage, else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    pp, me = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    b, s = tokens.shape
    pos = torch.arange(s).expand(b, s)
    mask = cpu_compat.causal_mask(s)
    hidden_shape = (s // config.tensor_model_parallel_size if config.sequence_parallel else s, b, config.hidden_size)
    total, out = pp * len(chunks), None
    for c in range(total):
        if c % pp != me:
            continue
        model = chunks[c // pp].eval()
        if c > 0:
            hidden = torch.empty(hidden_shape)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        with torch.no_grad(), main_logits_only(chunks):
            out = model(input_ids=tokens, position_ids=pos, attention_mask=mask)
        if c < total - 1:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            out = None
    return None if out is None else gather_from_tensor_model_parallel_region(out)


def run_job(job: dict) -> None:
    from toolkit.models import read_hf_config

    from .formats.megatron import open_megatron

    ck = open_megatron(job["megatron_dir"], read_hf_config(job["hf_config"]) if job.get("hf_config") else None)
    layout = ck.layout
    if job.get("layout"):  # torch_dist only: megatron reshards at load
        layout = Layout(**job["layout"])
    chunks, _ = build(ck.shape, layout)
    if ck.fmt == "torch":
        load_legacy(chunks, ck)
    else:
        load_dist(chunks, ck.source.dir)
    logits = forward(chunks, sample_tokens(ck.shape.vocab_size), chunks[0].config)
    from megatron.core import parallel_state as ps

    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(logits[..., :ck.shape.vocab_size].contiguous(), job["out"])
    dist.barrier()
    del chunks
    distributed.release_model_parallel()  # the next job's grid: no gloo threads left behind


def main(argv: list[str]) -> None:
    cpu_compat.eager_fusers()  # before megatron is imported (CPU only)
    jobs = json.loads(Path(argv[0]).read_text())
    distributed.init_process_group()
    try:
        for job in jobs:
            run_job(job)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
