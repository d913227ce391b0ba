"""Plan -> DeepSpeed config (dict, written as ds_config.json).

Two variants from one function: the launcher/runtime config (every value concrete) and
the HF Trainer config, with "auto" exactly where TrainingArguments owns the value (batch
sizes, accumulation, clipping, optimizer hyper-parameters, precision flags) and no
scheduler (the Trainer builds it from TrainingArguments).
"""
from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

from ..errors import unknown_key_message
from ..models import ModelShape
from ..spec import TrainingSpec
from .monitor import deepspeed_monitor_sections

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


def bucket_sizes(spec: TrainingSpec, shape: ModelShape) -> dict[str, int]:
    """Communication bucket sizes (elements), the HF integration's model-based values:
    reduce = h^2, stage-3 prefetch = 0.9 h^2, persistence threshold = 10 h."""
    h = shape.hidden_size
    return {"reduce_bucket_size": h * h, "allgather_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h), "stage3_param_persistence_threshold": 10 * h}


def _offload(device: str, nvme_path: str | None) -> dict[str, Any]:
    d: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        d["nvme_path"] = nvme_path
    return d


def zero_section(spec: TrainingSpec, shape: ModelShape, hf: bool = False) -> dict[str, Any]:
    z = spec.zero
    b = bucket_sizes(spec, shape)
    sec: dict[str, Any] = {"stage": z.stage}
    if z.stage == 0:
        return sec
    sec.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=AUTO if hf else b["reduce_bucket_size"])
    if z.stage in (1, 2):
        sec.update(allgather_partitions=True, allgather_bucket_size=b["allgather_bucket_size"], reduce_scatter=True)
    else:
        sec.update(stage3_prefetch_bucket_size=AUTO if hf else b["stage3_prefetch_bucket_size"],
                   stage3_param_persistence_threshold=AUTO if hf else b["stage3_param_persistence_threshold"],
                   stage3_max_live_parameters=int(1e9), stage3_max_reuse_distance=int(1e9),
                   stage3_gather_16bit_weights_on_model_save=True)
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


def deepspeed_config(plan, *, hf: bool = False) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------- key checking
@lru_cache(maxsize=1)
def deepspeed_top_level_keys() -> frozenset[str]:
    """Every top-level key DeepSpeedConfig reads, learned by letting it read a config that
    records each lookup (so the list follows the installed DeepSpeed, not a copy of it)."""
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS, DeepSpeedConfig

    seen: set[str] = set()

    class Keys(list):
        def __contains__(self, k):
            seen.add(k)
            return list.__contains__(self, k)

    class Recorder(dict):
        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def get(self, k, default=None):
            seen.add(k)
            return super().get(k, default)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def keys(self):
            return Keys(super().keys())

        def __copy__(self):
            return self

    DeepSpeedConfig(Recorder(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1))
    return frozenset(k for k in seen if isinstance(k, str)) - set(_REMOVED_TOP_LEVEL_CONFIG_KEYS)


@lru_cache(maxsize=1)
def _section_models() -> dict[str, type]:
    """Sections DeepSpeed parses with its own pydantic models (nested models are followed)."""
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config, "bfloat16": DeepSpeedBF16Config,
            "fp16": DeepSpeedFP16Config, "tensorboard": TensorBoardConfig, "wandb": WandbConfig,
            "csv_monitor": CSVConfig, "comet": CometConfig}


def _nested_model(annotation) -> type | None:
    """The pydantic model a field holds (directly or inside Optional/Union), if any."""
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_nested_model, typing.get_args(annotation)) if m is not None), None)


def _model_messages(model: type, data: dict[str, Any], where: str) -> list[str]:
    fields = {**model.model_fields, **{f.alias: f for f in model.model_fields.values() if f.alias}}
    msgs = []
    for key, value in data.items():
        if key not in fields:
            msgs.append(unknown_key_message(key, fields, where))
            continue
        sub = _nested_model(fields[key].annotation)
        if sub is not None and isinstance(value, dict):
            msgs += _model_messages(sub, value, f"{where}.{key}")
    return msgs


@lru_cache(maxsize=1)
def _optimizer_param_keys() -> frozenset[str]:
    """What DeepSpeed's AdamW accepts in optimizer.params: the arguments of the optimizer it
    builds (FusedAdam, DeepSpeedCPUAdam with offload, torch's AdamW with torch_adam) plus the
    switches it pops itself (engine.get_optimizer_configuration)."""
    import inspect

    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    names = {n for cls in (FusedAdam, DeepSpeedCPUAdam, torch.optim.AdamW)
             for n in inspect.signature(cls.__init__).parameters}
    return frozenset(names - {"self", "params", "model_params"}) | {"torch_adam", "adam_w_mode",
                                                                      "fp32_optimizer_states", "foreach"}


def _scheduler_param_keys(kind: str) -> frozenset[str] | None:
    import inspect

    from deepspeed.runtime import lr_schedules

    cls = getattr(lr_schedules, kind, None)
    if not isinstance(cls, type):
        return None
    return frozenset(inspect.signature(cls.__init__).parameters) - {"self", "optimizer"}


def _section_messages(name: str, value: Any) -> list[str]:
    if not isinstance(value, dict):
        return []
    if name in _section_models():
        return _model_messages(_section_models()[name], value, name)
    if name == "data_types":
        return [unknown_key_message(k, DATA_TYPE_KEYS, name) for k in value if k not in DATA_TYPE_KEYS]
    if name == "timers":
        return _timers_messages(value)
    if name not in ("optimizer", "scheduler"):
        return []
    msgs = [unknown_key_message(k, ("type", "params"), name) for k in value if k not in ("type", "params")]
    params = value.get("params")
    if not isinstance(params, dict):
        return msgs
    valid = _optimizer_param_keys() if name == "optimizer" else _scheduler_param_keys(str(value.get("type")))
    if valid is not None:
        msgs += [unknown_key_message(k, valid, f"{name}.params") for k in params if k not in valid]
    return msgs


DATA_TYPE_KEYS = ("grad_accum_dtype", "param_dtype", "buffer_dtype")  # deepspeed/runtime/constants.py


def _timers_messages(value: dict[str, Any]) -> list[str]:
    """DeepSpeed reads timers.throughput only (deepspeed/utils/config.py), with its own model."""
    from deepspeed.utils.config import TIMERS_THROUGHPUT, DeepSpeedThroughputTimerConfig

    msgs = [unknown_key_message(k, (TIMERS_THROUGHPUT,), "timers") for k in value if k != TIMERS_THROUGHPUT]
    if isinstance(value.get(TIMERS_THROUGHPUT), dict):
        msgs += _model_messages(DeepSpeedThroughputTimerConfig, value[TIMERS_THROUGHPUT], "timers.throughput")
    return msgs


def unknown_deepspeed_keys(cfg: dict[str, Any]) -> list[str]:
    """Messages for keys DeepSpeed would silently ignore (top level) or reject only when the
    engine starts (sections it parses with pydantic models, optimizer and scheduler
    parameters, data types), at every depth."""
    top = deepspeed_top_level_keys()
    msgs = [unknown_key_message(k, top) for k in cfg if k not in top]
    for name, value in cfg.items():
        if name in top:
            msgs += _section_messages(name, value)
    return msgs
