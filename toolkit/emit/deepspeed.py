"""Plan -> DeepSpeed config (dict, written as ds_config.json).

Two variants from one function: the launcher/runtime config (every value concrete) and
the HF Trainer config, with "auto" exactly where TrainingArguments owns the value (batch
sizes, accumulation, clipping, optimizer hyper-parameters, precision flags) and no
scheduler (the Trainer builds it from TrainingArguments).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from ..backends.deepspeed import MAX_LIVE_PARAMETERS, MAX_REUSE_DISTANCE, bucket_sizes
from ..models import ModelShape
from ..parallel.zero import sharded
from ..spec import TrainingSpec
from .monitor import deepspeed_monitor_sections

if TYPE_CHECKING:  # annotations only: the emitters read a Plan, they never make one
    from ..plan import Plan

AUTO = "auto"
# DeepSpeed's throughput timer (its "RunningAvgSamplesPerSec" log line) synchronises the device
# at the start of every forward and at the end of every engine.step() by default: twice per
# micro-batch when the training loop calls forward/backward/step per micro-batch, as DeepSpeed's
# own examples and the HF Trainer do. Unsynchronised, it keeps the log line for users' own loops
# and times on the host: a step's end still waits for the device once (the optimizer's overflow
# and gradient-norm checks read the device), so per-step times stay close, and nothing waits per
# micro-batch. The toolkit's runtime measures throughput itself and switches the timer off
# (toolkit.runtime.engine.runtime_config).
THROUGHPUT_TIMER = {"throughput": {"enabled": True, "synchronized": False}}


def _offload(device: str, nvme_path: str | None) -> dict[str, Any]:
    d: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        d["nvme_path"] = nvme_path
    return d


def zero_section(spec: TrainingSpec, shape: ModelShape, hf: bool = False) -> dict[str, Any]:
    z = spec.zero
    b = bucket_sizes(spec, shape)
    sec: dict[str, Any] = {"stage": z.stage}
    if not sharded(z.stage, "optimizer"):
        return sec
    sec.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=AUTO if hf else b["reduce_bucket_size"])
    if not sharded(z.stage, "params"):  # ZeRO-1/2: each rank's updated partition gathered after the step
        sec.update(allgather_partitions=True, allgather_bucket_size=b["allgather_bucket_size"], reduce_scatter=True)
    else:
        sec.update(stage3_prefetch_bucket_size=AUTO if hf else b["stage3_prefetch_bucket_size"],
                   stage3_param_persistence_threshold=AUTO if hf else b["stage3_param_persistence_threshold"],
                   stage3_max_live_parameters=MAX_LIVE_PARAMETERS, stage3_max_reuse_distance=MAX_REUSE_DISTANCE,
                   stage3_gather_16bit_weights_on_model_save=True)
        if z.hpz_partition_size > 1:  # ZeRO++'s secondary partition (hpZ)
            sec["zero_hpz_partition_size"] = z.hpz_partition_size
    if z.offload_optimizer != "none":
        sec["offload_optimizer"] = _offload(z.offload_optimizer, z.nvme_path)
    if z.offload_param != "none":
        sec["offload_param"] = _offload(z.offload_param, z.nvme_path)
    return sec


def precision_section(spec: TrainingSpec, hf: bool = False) -> dict[str, Any]:
    """16-bit weights; gradients accumulate in fp32 over the micro-batches as Megatron-LM's
    do (DeepSpeed's default is the weights' dtype). DeepSpeed supports fp32 accumulation of
    16-bit gradients with ZeRO only (the plan's rules refuse 16-bit without ZeRO)."""
    on = AUTO if hf else True
    accum = {"data_types": {"grad_accum_dtype": "fp32"}} if spec.zero.stage >= 1 else {}
    if spec.precision == "bf16":
        return {"bf16": {"enabled": on}, **accum}
    if spec.precision == "fp16":
        return {"fp16": {"enabled": on, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                         "hysteresis": 2, "min_loss_scale": 1}, **accum}
    return {}


def optimizer_section(spec: TrainingSpec, hf: bool = False) -> dict[str, Any]:
    o = spec.optimizer
    if o.impl != "deepspeed":
        return {}
    params = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if hf:
        params = {k: AUTO for k in params}
    return {"optimizer": {"type": "AdamW", "params": params}}


def scheduler_section(spec: TrainingSpec) -> dict[str, Any]:
    """Warm-up then decay to min_lr over train.steps (Megatron's schedule) in DeepSpeed's terms.

    DeepSpeed's schedulers differ from Megatron's in two ways nobody can configure away:
    they warm up for at least 2 steps (warmup_num_steps is raised to 2 and must be >= 1),
    and they apply each value one step later. Its WarmupDecayLR decays to 0 at
    total_num_steps, so that point is moved to where the line reaches min_lr at train.steps.
    The toolkit's own runtime applies Megatron's exact schedule instead (tests compare both
    with megatron-core's OptimizerParamScheduler).
    """
    o, steps = spec.optimizer, spec.train.steps
    warmup = max(1, o.warmup_steps)
    warm = {"warmup_num_steps": warmup, "warmup_type": "linear"}
    ratio = o.min_lr / o.lr
    if o.decay == "cosine":
        return {"scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": steps, "warmup_min_ratio": 0.0 if o.warmup_steps else 1.0,
            "cos_min_ratio": ratio, **warm}}}
    if o.decay == "linear" and ratio < 1:
        w = max(2, warmup)  # DeepSpeed's own floor on warm-up steps
        end = (steps - ratio * w) / (1 - ratio)  # lr(steps) = lr * (end - steps) / (end - w) = min_lr
        return {"scheduler": {"type": "WarmupDecayLR", "params": {
            "total_num_steps": end, "warmup_min_lr": 0.0, "warmup_max_lr": o.lr, **warm}}}
    return {"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0 if o.warmup_steps else o.lr, "warmup_max_lr": o.lr, **warm}}}


def deepspeed_config(plan: Plan, *, hf: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of a plan. ``hf=True``: the HF Trainer variant."""
    spec, shape, batch = plan.spec, plan.shape, plan.batch
    auto = (lambda v: AUTO) if hf else (lambda v: v)
    cfg: dict[str, Any] = {
        "train_batch_size": auto(batch.global_),
        "train_micro_batch_size_per_gpu": auto(batch.micro),
        "gradient_accumulation_steps": auto(batch.grad_accum),
        "gradient_clipping": auto(spec.optimizer.clip_grad),
        "steps_per_print": spec.train.log_interval,
        "wall_clock_breakdown": False,
        "timers": THROUGHPUT_TIMER,
        "zero_optimization": zero_section(spec, shape, hf),
        **precision_section(spec, hf),
        **optimizer_section(spec, hf),
    }
    if not hf and spec.optimizer.impl == "deepspeed":
        cfg.update(scheduler_section(spec))
    cfg.update(deepspeed_monitor_sections(spec))
    return deep_merge(cfg, spec.deepspeed)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out
