"""Model loading and saving for the Trainer under DeepSpeed, ZeRO-3 included.

ZeRO-3 pains this module removes:
- ``from_pretrained`` partitions weights while loading only when an ``HfDeepSpeedConfig``
  is alive (transformers keeps a weak reference to it); without one every rank builds the
  whole model in host memory first. ``load_model`` keeps the config alive on the model.
- ``Trainer.save_model`` falls back to writing EMPTY weights (plus a DeepSpeed checkpoint)
  when ``stage3_gather_16bit_weights_on_model_save`` is off. ``save_model`` gathers the full
  16-bit weights, writes them atomically, and checks every tensor has its full shape.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import atomic_output_dir
from ..emit.deepspeed import deepspeed_config as emit_deepspeed_config
from ..errors import ToolkitError
from ..mcore.cpu_compat import release_deepspeed_shm
from ..models import hf_config_dict
from ..models.registry import hf_config_object
from ..parallel.precision import PRECISION_DTYPES
from ..plan import Plan
from .arguments import SpecLike, hf_plan, start_deepspeed_comm
from .lora import with_adapters

if TYPE_CHECKING:
    from transformers import PreTrainedModel, Trainer, TrainingArguments

ATTENTION = {"auto": "sdpa", "flash": "sdpa", "unfused": "eager"}  # sdpa stores no s x s score matrix


class SaveError(ToolkitError):
    """The model could not be saved as full weights (nothing is left half-written)."""


def _zero3_config(plan: Plan, args: TrainingArguments | None) -> Any:
    """The HfDeepSpeedConfig transformers must see during construction: the TrainingArguments'
    own when given (re-pointed to, in case another was made since), else one for the spec's
    concrete DeepSpeed config."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, set_hf_deepspeed_config

    # zero.Init checks the batch invariant with deepspeed.comm's world size, which is 1 until
    # deepspeed.comm is up; on CPU (use_cpu) accelerate starts only torch.distributed.
    start_deepspeed_comm()
    release_deepspeed_shm()
    keep = getattr(args, "hf_deepspeed_config", None) if args is not None else None
    if keep is None:
        return HfDeepSpeedConfig(emit_deepspeed_config(plan))
    set_hf_deepspeed_config(keep)
    return keep


def load_model(spec: SpecLike, name_or_path: str | Path | None = None, *, args: TrainingArguments | None = None,
               **kwargs: Any) -> PreTrainedModel:
    """AutoModelForCausalLM for the spec: ``from_pretrained(name_or_path)``, or a freshly
    initialised model of the spec's architecture when ``name_or_path`` is None. dtype follows
    ``precision`` and attention ``attention.backend`` unless given in ``kwargs``. Under ZeRO-3
    the weights are partitioned as they load (each rank holds 1/dp of them); the
    HfDeepSpeedConfig that makes transformers do so stays alive with the model. Fresh weights
    are seeded with ``train.seed``."""
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    plan = hf_plan(spec)
    kwargs.setdefault("dtype", getattr(torch, PRECISION_DTYPES[plan.spec.precision]))
    kwargs.setdefault("attn_implementation", ATTENTION[plan.spec.attention.backend])
    keep = _zero3_config(plan, args) if plan.spec.zero.stage == 3 else None
    if name_or_path is None:
        set_seed(plan.spec.train.seed)  # the same fresh weights on every run of the spec
        config = hf_config_object(hf_config_dict(plan.shape))
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), **kwargs)
    model = with_adapters(model, plan)  # finetune.method lora: peft's get_peft_model (toolkit.hf.lora)
    if keep is not None:
        model._toolkit_hf_deepspeed_config = keep
        _require_partitioned(model)
    return model


def _require_partitioned(model: PreTrainedModel) -> None:
    whole = [n for n, p in model.named_parameters() if not hasattr(p, "ds_id")]
    if whole:
        raise ToolkitError(f"ZeRO-3 load left {len(whole)} parameters unpartitioned (first: {whole[0]}); "
                           "another DeepSpeed config replaced the spec's during loading")


def full_state_dict(trainer: Trainer) -> dict[str, Any] | None:
    """All ranks must call this. The model's full weights on rank 0 (None on the others),
    gathered from the ZeRO-3 partitions in the training dtype."""
    if trainer.is_deepspeed_enabled and trainer.deepspeed.zero_optimization_partition_weights():
        engine = trainer.deepspeed
        if not engine.zero_gather_16bit_weights_on_model_save():
            raise SaveError("zero_optimization.stage3_gather_16bit_weights_on_model_save is false in the DeepSpeed "
                            "config: the saved weights would be empty (remove the override from the spec)")
        return engine._zero3_consolidated_16bit_state_dict()
    if not trainer.args.should_save:
        return None
    return {k: v.detach().cpu().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def save_model(trainer: Trainer, output_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write the trained model as a transformers folder (config + safetensors, full weights)
    that ``from_pretrained`` reloads (a LoRA run: peft's adapter folder, for
    ``PeftModel.from_pretrained(base, folder)``). All ranks must call it; rank 0 writes to a temporary
    folder renamed at the end, then checks every tensor has its full shape."""
    import torch.distributed as dist

    state = full_state_dict(trainer)
    out = Path(output_dir)
    if trainer.args.should_save:
        model = trainer.accelerator.unwrap_model(trainer.model)
        with atomic_output_dir(out, overwrite) as tmp:
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            if trainer.processing_class is not None:
                trainer.processing_class.save_pretrained(tmp)
            check_saved_shapes(tmp, checkpoint_shapes(model, expected_shapes(model)))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


def leave_process_group() -> None:
    """Every rank, once done with the process group (after save_model, say), before the interpreter
    exits: a barrier, then the default group and its subgroups destroyed. A rank that exits with its
    gloo groups alive while another rank still holds their connections aborts now and then in torch's
    C++ teardown ("terminate called without an active exception", SIGABRT, exit -6: once in the README
    test's accelerate launch of examples/hf_trainer_finetune.py, after it had trained and saved; the
    runtime's ranks leave theirs the same way, toolkit.cli.train.leave_process_groups). The same abort
    came once more with the barrier and destroy alone (one of three clean-clone runs, 2026-11-28). A
    dropped Trainer and its DeepSpeed engine can keep group handles alive through reference cycles
    until the interpreter's own teardown, so they are collected first, while every rank is alive; that
    this removes the abort is a guess, too rare to show in a test. Nothing when no group is up."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()  # the dropped Trainer / engine cycles and the group handles they hold
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def expected_shapes(model: PreTrainedModel) -> dict[str, tuple[int, ...]]:
    """Full parameter shapes, also under ZeRO-3 (where ``p.shape`` is an empty placeholder); a
    peft model (finetune.method lora) saves its adapters only, under peft's own keys."""
    peft = sys.modules.get("peft")  # imported by toolkit.hf.lora when the spec asked for adapters
    if peft is not None and isinstance(model, peft.PeftModel):
        from peft import get_peft_model_state_dict

        return {n: tuple(t.shape) for n, t in get_peft_model_state_dict(model).items()}
    return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}


def checkpoint_shapes(model: PreTrainedModel, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The tensors ``save_pretrained`` writes for parameters of these shapes: transformers 5 reverts
    the conversions it applies when loading (its own ``revert_weight_conversion``, run on meta
    tensors), so a MoE layer's fused experts are written one tensor per expert weight, under the
    names the hub's checkpoints use (Mixtral's block_sparse_moe.experts.{e}.w1, ...). A peft model's
    adapters are written under peft's keys, unconverted."""
    import torch

    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        return shapes
    from transformers.core_model_loading import revert_weight_conversion

    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    return {name: tuple(t.shape) for name, t in revert_weight_conversion(model, meta).items()}


def saved_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every safetensors file in a saved folder (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


def check_saved_shapes(folder: str | Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Raise SaveError unless every parameter was written with its full shape."""
    got = saved_shapes(folder)
    bad = [f"{k}: saved {got.get(k)}, expected {s}" for k, s in expected.items() if got.get(k) != s]
    if bad:
        raise SaveError(f"{len(bad)} of {len(expected)} weights were not saved in full ({bad[0]}, ...)"
                        if len(bad) > 1 else f"weight not saved in full: {bad[0]}")


