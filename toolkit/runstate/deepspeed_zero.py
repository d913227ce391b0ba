"""The runtime's training checkpoint -> DeepSpeed's own ZeRO checkpoint, the files DeepSpeed's
tools read: ``zero_to_fp32.py`` (which looks for ``*_model_states.pt`` and
``*_optim_states.pt``) and ``ds_to_universal``::

  OUT/latest                                      "global_step<N>"
  OUT/zero_to_fp32.py                             DeepSpeed's script, as its engine leaves it
  OUT/global_step<N>/mp_rank_00_model_states.pt   the module (megatron-core names), counters, scheduler
  OUT/global_step<N>/zero_pp_rank_0_mp_rank_00_optim_states.pt   fp32 masters and Adam moments

The files are DeepSpeed's engine's, not ours: the checkpoint goes to DeepSpeed's universal
layout (toolkit.runstate.universal), a one-process DeepSpeed engine (ZeRO stage 1 or 2 as the
run had, else 1) on megatron-core's GPTModel at tp = pp = ep = 1 (the universal names) loads it
(``load_universal``) and saves it with ``engine.save_checkpoint``. So the layout is one
data-parallel rank (DeepSpeed's tools read it at any) and the conversion holds the whole model
with its fp32 masters and moments in this process's memory: 16 bytes per parameter plus the
module's weights (a 70B model: about 1.2 TB; convert on a machine that has it, or use the
universal format, which streams).
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import InputFileError
from .runtime_ckpt import RunCheckpoint

MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def runtime_to_deepspeed(ck: RunCheckpoint, out_root: Path, progress=None) -> Path:
    """Write DeepSpeed's ZeRO checkpoint of `ck` into `out_root`; returns its global_step folder."""
    from . import universal

    plan = _plan(ck)
    with tempfile.TemporaryDirectory(prefix=".universal-", dir=out_root.parent) as mid:
        folder = universal.runtime_to_universal(ck, Path(mid), progress)
        with _one_process_world():
            _save_with_deepspeed(plan, Path(mid), out_root, folder.name)
    return out_root / folder.name


def _plan(ck: RunCheckpoint):
    """The run's spec (RUN/spec.yaml beside the checkpoints, else one from the checkpoint's
    model) on one CPU rank, at ZeRO stage 1 or 2."""
    from ..plan import make_plan
    from ..spec import TrainingSpec

    stage = ck.state.get("zero_stage", 1)
    run_spec = ck.folder.parent.parent / "spec.yaml"
    base = TrainingSpec.from_yaml(run_spec).to_dict() if run_spec.is_file() else {"precision": "fp32"}
    keep = {k: base[k] for k in ("precision", "optimizer", "train", "batch") if k in base}
    spec = TrainingSpec.from_dict({
        **keep, "model": str(ck.model / "hf"), "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"},
        "zero": {"stage": stage if stage in (1, 2) else 1}, "recompute": "none"})
    spec = spec.with_overrides({"batch.global": spec.batch.micro})  # one rank: the batch does not matter here
    return make_plan(spec)


@contextlib.contextmanager
def _one_process_world() -> Iterator[None]:
    """A process group of this process alone (whatever a launcher set in the environment),
    torn down after."""
    import torch.distributed as dist

    from ..mcore.distributed import destroy, init_process_group
    from ..mcore.rendezvous import one_process_env

    if dist.is_initialized():
        raise InputFileError("--to deepspeed runs as its own command (one process), not inside a training run")
    one = {**one_process_env(), "LOCAL_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in one}
    os.environ.update(one)
    try:
        init_process_group()
        yield
    finally:
        destroy()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _save_with_deepspeed(plan, universal_root: Path, out_root: Path, tag: str) -> None:
    """On the CPU (a conversion), DeepSpeed's notices behind --verbose: its accelerator choice and
    "MPU is not provided" (there is none at tp 1)."""
    from ..quiet import is_verbose, quiet_run

    quiet_run(cpu=True, transformer_engine=False)
    from ..mcore.cpu_compat import eager_fusers

    eager_fusers()
    import deepspeed
    from deepspeed.utils import logger

    from ..mcore.distributed import init_parallel, start_deepspeed_comm
    from ..runtime.engine import lr_scheduler, param_groups, runtime_config
    from ..runtime.model import build_model_chunks

    if not is_verbose():
        logger.setLevel(logging.ERROR)
    start_deepspeed_comm("gloo")  # (its /dev/shm segment released: every conversion had left 66 MB there)
    init_parallel(plan.layout, plan.spec.train.seed)
    gpt = build_model_chunks(plan)[0]
    gpt.register_state_dict_post_hook(_drop_empty_extra_state)
    cfg = runtime_config(plan)
    cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=gpt, model_parameters=param_groups(gpt, plan.spec.optimizer.weight_decay,
                                                                               False),
                                      lr_scheduler=lr_scheduler(plan), config=cfg)
    try:
        engine.load_checkpoint(str(universal_root))
        engine.save_checkpoint(str(out_root), tag=tag)
    finally:
        engine.destroy()


def _drop_empty_extra_state(module, state_dict, prefix, local_metadata) -> None:
    """megatron-core's linear layers put ``_extra_state: None`` in their state_dict, which
    DeepSpeed's ds_to_universal (0.19.8) cannot convert (``None.float()``)."""
    for k in [k for k, v in state_dict.items() if k.endswith("._extra_state") and v is None]:
        del state_dict[k]
