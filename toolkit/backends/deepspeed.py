"""DeepSpeed's own facts that the planner, the emitters and the runtime all read: the keys its
config reads (learned from the installed DeepSpeed, so the check follows its version) and the
communication bucket sizes the generated config gives it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..errors import unknown_key_message
from ..models import ModelShape
from ..spec import TrainingSpec


# ZeRO-3's stage3_max_live_parameters and stage3_max_reuse_distance in the generated config
# (DeepSpeed's defaults): the planner's time estimate reads the reuse distance too.
MAX_LIVE_PARAMETERS = MAX_REUSE_DISTANCE = int(1e9)
# engine.allreduce_gradients' buffer (deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE, elements): how
# DeepSpeed splits the all-reduce of its non-ZeRO and BF16_Optimizer paths; no config key sets it
MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000


# zero_optimization keys of the spec's ``deepspeed`` section that bucket_sizes reads: the names the generated JSON
# uses (DeepSpeed's stage3_ aliases for ZeRO-3's)
BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")  # at least 1 element
SIZE_KEYS = (*BUCKET_KEYS, "stage3_param_persistence_threshold", "stage3_max_reuse_distance")
# DeepSpeedZeroConfig's defaults for them (checked against the installed DeepSpeed in the tests): what DeepSpeed
# runs with where a key is absent or "auto", which its config models drop (config_utils.DeepSpeedConfigModel)
DEEPSPEED_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                      "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
                      "stage3_max_reuse_distance": 1_000_000_000}
# the keys transformers' HF integration fills from the model where they are "auto" (HfTrainerDeepSpeedConfig
# .trainer_config_finalize: hidden_size_based_keys), with hidden_bucket_sizes' values
HF_FILLED = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
# DeepSpeedZeroConfig's field names whose stage3_ alias the generated ZeRO-3 section sets: DeepSpeed refuses a
# section with both names ("Extra inputs are not permitted"; checked against its fields in the tests)
STAGE3_ALIASES = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
                  "param_persistence_threshold": "stage3_param_persistence_threshold",
                  "max_live_parameters": "stage3_max_live_parameters",
                  "max_reuse_distance": "stage3_max_reuse_distance",
                  "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}


def bucket_sizes(spec: TrainingSpec, shape: ModelShape) -> dict[str, int]:
    """Communication bucket sizes (elements) and ZeRO-3's reuse distance, as the generated config gives
    them to DeepSpeed: the HF integration's model-based values (reduce = h^2, stage-3 prefetch = 0.9 h^2,
    persistence threshold = 10 h) and DeepSpeed's reuse distance, each replaced by what the spec's
    ``deepspeed.zero_optimization`` sets (merged over the generated JSON, so DeepSpeed runs with it)."""
    return spec_bucket_sizes(spec.deepspeed, shape.hidden_size, spec.target)


def spec_bucket_sizes(extra: dict[str, Any], h: int, target: str) -> dict[str, int]:
    """bucket_sizes from a spec's ``deepspeed`` section, the model's hidden size and the target: a number
    replaces the generated value; "auto" is the model-based value where the HF Trainer fills it in (target hf,
    HF_FILLED) and DeepSpeed's default elsewhere, since DeepSpeed drops it; a value of another kind, or a bucket
    or prefetch size below 1, is refused (rule deepspeed_zero_overrides) and leaves the generated one here."""
    sizes = {**hidden_bucket_sizes(h), "stage3_max_reuse_distance": MAX_REUSE_DISTANCE}
    zero = extra.get("zero_optimization")
    if isinstance(zero, dict):
        for key in SIZE_KEYS:
            value = zero.get(key)
            if value == "auto":
                sizes[key] = sizes[key] if target == "hf" and key in HF_FILLED else DEEPSPEED_DEFAULTS[key]
            elif is_number(value) and (value >= 1 or key not in BUCKET_KEYS):
                sizes[key] = int(value)
    return sizes


def zero_override_problems(extra: dict[str, Any], stage: int) -> list[str]:
    """What DeepSpeed would refuse at launch in the spec's ``deepspeed.zero_optimization`` merged over the
    generated section: a bucket size that is neither a number nor "auto" (YAML reads 5e8, without a dot, as
    a string), and with ZeRO-3 a field name whose stage3_ alias the generated section already sets; and
    what the estimate does not model: bucket or prefetch sizes below 1 (DeepSpeed's per-parameter paths)."""
    zero = extra.get("zero_optimization")
    if not isinstance(zero, dict):
        return []
    out = [f"deepspeed.zero_optimization.{k}={v!r} is not a number (DeepSpeed refuses it at launch; YAML reads "
           "5e8 without a dot as a string: write 5.0e8 or 500000000)"
           for k, v in zero.items() if k in SIZE_KEYS and v != "auto" and not is_number(v)]
    out += [f"deepspeed.zero_optimization.{k}={v!r}: DeepSpeed then reduces or gathers each parameter on its own "
             "(a prefetch of 0 turns prefetching off), which the estimate does not model; give a size of at least 1"
             for k, v in zero.items() if k in BUCKET_KEYS and is_number(v) and v < 1]
    if stage == 3:
        out += [f"deepspeed.zero_optimization.{k}: the generated ZeRO-3 section sets {alias}, DeepSpeed's other "
                f"name for it, and DeepSpeed refuses both at once; write {alias}"
                for k, alias in STAGE3_ALIASES.items() if k in zero]
    return out


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def hidden_bucket_sizes(h: int) -> dict[str, int]:
    """bucket_sizes of a model of hidden size ``h`` (they depend on nothing else)."""
    return {"reduce_bucket_size": h * h, "allgather_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h), "stage3_param_persistence_threshold": 10 * h}


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
