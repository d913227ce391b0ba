"""spec -> TrainingArguments, and the DeepSpeed / accelerate settings the Trainer reads.

The Trainer's batch is per_device_train_batch_size x gradient_accumulation_steps x
world_size, which is what it writes into DeepSpeed's "auto" train_batch_size. The spec's
is micro x grad_accum x dp with dp = world / (tp*pp*cp); the Trainer has no Megatron
model parallelism, so tp = pp = cp = ep = 1 and dp = world. Every TrainingArguments field
in ``spec_arguments`` comes from the spec; an override that disagrees is an error naming the
spec key to change instead: HF would otherwise fill DeepSpeed's "auto" values from the
override and silently train a different run.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..emit.deepspeed import AUTO
from ..emit.deepspeed import deepspeed_config as emit_deepspeed_config
from ..emit.hf import accelerate_config as emit_accelerate_config
from ..errors import SpecError, unknown_key_message
from ..plan import Plan, make_plan
from ..plan.rules import hf_model_parallel
from ..quiet import DEEPSPEED_SHM_BUILT, without_lines
from ..spec import Optimizer, TrainingSpec

if TYPE_CHECKING:
    from transformers import TrainingArguments

SpecLike = TrainingSpec | Plan | dict | str | Path


class UnsupportedLayoutError(SpecError):
    """The spec asks for parallelism the HF Trainer does not have (tp, pp, cp, ep > 1)."""


class SpecMismatchError(SpecError):
    """TrainingArguments (or the launch) disagree with the spec; ``problems`` lists each one."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("TrainingArguments disagree with the spec: " + "; ".join(self.problems))


@dataclass(frozen=True)
class Owned:
    """A TrainingArguments value taken from the spec. ``strict``: overriding it with another
    value is an error; otherwise it is only a default."""

    value: Any
    spec_key: str
    strict: bool = True


def hf_plan(spec: SpecLike) -> Plan:
    """A valid plan the Trainer can run: every rule holds and the layout is pure data parallel."""
    if isinstance(spec, Plan):
        plan = spec
    elif isinstance(spec, TrainingSpec):
        plan = make_plan(spec)
    elif isinstance(spec, dict):
        plan = make_plan(TrainingSpec.from_dict(spec))
    else:
        plan = make_plan(TrainingSpec.from_yaml(spec))
    why = hf_model_parallel(plan.layout)  # also the plan's rule hf_data_parallel, for target hf
    if why:
        raise UnsupportedLayoutError(why)
    return plan.require_valid()


def lr_schedule(o: Optimizer, steps: int) -> tuple[str, dict[str, Any]]:
    """Megatron's schedule (linear warmup from 0 to lr, then decay to min_lr at train.steps,
    megatron.core.optimizer_param_scheduler) as an HF scheduler name and its kwargs."""
    if o.min_lr > o.lr:
        raise SpecError(f"optimizer.min_lr={o.min_lr} is larger than optimizer.lr={o.lr}")
    if o.decay != "constant" and o.warmup_steps >= steps:
        raise SpecError(f"optimizer.warmup_steps={o.warmup_steps} must be smaller than train.steps={steps}")
    if o.decay == "constant" or o.min_lr == o.lr:
        return ("constant_with_warmup" if o.warmup_steps else "constant"), {}
    if o.decay == "cosine":
        return "cosine_with_min_lr", {"min_lr_rate": o.min_lr / o.lr}
    return "polynomial", {"lr_end": o.min_lr, "power": 1.0}  # power 1: linear from lr to lr_end


def spec_arguments(plan: Plan) -> dict[str, Owned]:
    """TrainingArguments field -> value from the spec (and the spec key it comes from)."""
    s, b, o = plan.spec, plan.batch, plan.spec.optimizer
    sched, sched_kwargs = lr_schedule(o, s.train.steps)
    return {
        "per_device_train_batch_size": Owned(b.micro, "batch.micro"),
        "gradient_accumulation_steps": Owned(b.grad_accum, "batch.global / (batch.micro x dp)"),
        "auto_find_batch_size": Owned(False, "batch.micro"),
        "max_steps": Owned(s.train.steps, "train.steps"),
        "learning_rate": Owned(o.lr, "optimizer.lr"),
        "weight_decay": Owned(o.weight_decay, "optimizer.weight_decay"),
        "adam_beta1": Owned(o.betas[0], "optimizer.betas[0]"),
        "adam_beta2": Owned(o.betas[1], "optimizer.betas[1]"),
        "adam_epsilon": Owned(o.eps, "optimizer.eps"),
        "max_grad_norm": Owned(o.clip_grad, "optimizer.clip_grad"),
        "optim": Owned("adamw_torch", "optimizer.type"),
        "lr_scheduler_type": Owned(sched, "optimizer.decay"),
        "lr_scheduler_kwargs": Owned(sched_kwargs, "optimizer.decay / optimizer.min_lr"),
        "warmup_steps": Owned(o.warmup_steps, "optimizer.warmup_steps"),
        "bf16": Owned(s.precision == "bf16", "precision"),
        "fp16": Owned(s.precision == "fp16", "precision"),
        "activation_checkpointing": Owned(s.recompute == "full", "recompute"),
        "deepspeed": Owned(emit_deepspeed_config(plan, hf=True), "zero / precision / optimizer / deepspeed"),
        "seed": Owned(s.train.seed, "train.seed", strict=False),
        "logging_steps": Owned(s.train.log_interval, "train.log_interval", strict=False),
        "save_steps": Owned(s.train.save_interval, "train.save_interval", strict=False),
        "use_cpu": Owned(plan.gpu.name == "cpu", "cluster.gpu", strict=False),
    }


def _norm(v: Any) -> Any:
    v = getattr(v, "value", v)  # SchedulerType / OptimizerNames enums
    return {} if v is None else v


def batch_line(plan: Plan, micro: int, accum: int, world: int) -> str:
    b = plan.batch
    return (f"DeepSpeed's train_batch_size would be {micro} x {accum} x {world} = {micro * accum * world}, the spec's "
            f"global batch is {b.global_} = micro {b.micro} x accumulation {b.grad_accum} x dp {plan.layout.dp}")


def field_conflicts(plan: Plan, values: dict[str, Any]) -> list[str]:
    """One message per field in ``values`` that disagrees with a strict spec value."""
    owned, b, world = spec_arguments(plan), plan.batch, plan.layout.dp
    out = []
    for name, v in values.items():
        o = owned.get(name)
        if o is None or not o.strict or _norm(v) == _norm(o.value):
            continue
        msg = f"{name}={_norm(v)!r} but the spec gives {_norm(o.value)!r} ({o.spec_key})"
        if name == "deepspeed":
            diff = config_diff(o.value, v) if isinstance(v, dict) else [f"got {v!r}"]
            msg = (f"deepspeed differs from the config generated from the spec ({'; '.join(diff)}); put extra "
                   "DeepSpeed keys in the spec's deepspeed: section")
        elif name == "per_device_train_batch_size":
            msg += ": " + batch_line(plan, v, b.grad_accum, world)
        elif name == "gradient_accumulation_steps":
            msg += ": " + batch_line(plan, b.micro, v, world)
        out.append(msg)
    return out


def world_conflict(plan: Plan, world: int) -> list[str]:
    lay, c = plan.layout, plan.spec.cluster
    if world == lay.dp:
        return []
    return [f"this run has {world} processes but the spec's cluster is {c.nodes} x {c.gpus_per_node} = {lay.world} "
            f"ranks (dp {lay.dp}): {batch_line(plan, plan.batch.micro, plan.batch.grad_accum, world)}; launch "
            f"{lay.world} processes or change cluster.*"]


RUN_CHANGING_EXTRAS = {"optimizer", "scheduler"}
LOGGING_ONLY = {"steps_per_print"}  # accelerate's DeepSpeedPlugin sets it to inf to silence DeepSpeed


def config_diff(expected: dict[str, Any], actual: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys where ``actual`` differs from ``expected``: "auto" in expected matches
    anything; keys only in ``actual`` count when they change the run (a DeepSpeed optimizer or
    scheduler the spec does not have), not bookkeeping HF/accelerate add."""
    out = []
    extras = {k for k in set(actual) - set(expected) if prefix or k in RUN_CHANGING_EXTRAS}
    for k in sorted((set(expected) | extras) - LOGGING_ONLY):
        e, a, key = expected.get(k), actual.get(k), f"{prefix}{k}"
        if isinstance(e, dict) and isinstance(a, dict):
            out += config_diff(e, a, key + ".")
        elif e != AUTO and e != a:
            out.append(f"{key}: spec {e!r}, found {a!r}")
    return out


def accelerate_file_conflicts(plan: Plan) -> list[str]:
    """Under `accelerate launch`, the DeepSpeed file its YAML names must be the spec's."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or not Path(path).is_file():
        return []
    diff = config_diff(emit_deepspeed_config(plan, hf=True), json.loads(Path(path).read_text()))
    return [f"the accelerate config's DeepSpeed file {path} is not the spec's ({'; '.join(diff)}); regenerate it "
            f"with `toolkit config SPEC --out DIR`"] if diff else []


def _training_arguments_fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments) if f.init}


def training_arguments(spec: SpecLike, output_dir: str | Path, **overrides: Any) -> TrainingArguments:
    """TrainingArguments for ``spec``: batch, accumulation, steps, precision, optimizer,
    schedule and the DeepSpeed config all from the spec. ``overrides`` set any other field
    (report_to, save_strategy, ...); one that disagrees with the spec, a world size other
    than the spec's, or an accelerate DeepSpeed file other than the spec's raises
    SpecMismatchError listing every problem with its numbers, before anything is built."""
    from transformers import TrainingArguments

    from ..mcore.rendezvous import check_master_port

    plan = hf_plan(spec)
    fields = _training_arguments_fields()
    problems = [unknown_key_message(k, fields, "TrainingArguments") for k in overrides if k not in fields]
    problems += field_conflicts(plan, overrides)
    problems += world_conflict(plan, int(os.environ.get("WORLD_SIZE", "1")))
    problems += accelerate_file_conflicts(plan)
    if problems:
        raise SpecMismatchError(problems)
    values = {k: o.value for k, o in spec_arguments(plan).items()} | overrides
    check_master_port()  # the process group comes up here (accelerate's PartialState)
    args = TrainingArguments(output_dir=str(output_dir), **values)
    check_training_arguments(plan, args)
    import torch.distributed as dist

    if dist.is_initialized():
        start_deepspeed_comm()
    return args


def start_deepspeed_comm() -> None:
    """deepspeed.comm over the process group accelerate started (on CPU, ``use_cpu``, accelerate
    starts only torch.distributed; deepspeed.initialize or zero.Init would bring deepspeed.comm
    up later, the same way). Its CPU shared-memory op prints a line as it loads: dropped here
    (toolkit.quiet)."""
    import deepspeed
    import torch.distributed as dist

    if not deepspeed.comm.is_initialized():
        with without_lines(DEEPSPEED_SHM_BUILT):
            deepspeed.init_distributed(dist_backend=dist.get_backend() if dist.is_initialized() else None)


def resolved_deepspeed_config(args: TrainingArguments) -> dict[str, Any] | None:
    """The DeepSpeed config the Trainer will hand to DeepSpeed ("auto" values filled)."""
    hf = getattr(args, "hf_deepspeed_config", None)
    if hf is None and getattr(args, "deepspeed_plugin", None) is not None:
        hf = args.deepspeed_plugin.hf_ds_config
    return None if hf is None else hf.config


def check_training_arguments(spec: SpecLike, args: TrainingArguments) -> None:
    """Raise SpecMismatchError when TrainingArguments built by hand (or by us) would train
    something other than the spec: fields, world size, and the resolved DeepSpeed config."""
    plan = hf_plan(spec)
    owned = spec_arguments(plan)
    problems = field_conflicts(plan, {k: getattr(args, k) for k in owned if k != "deepspeed"})
    problems += world_conflict(plan, args.world_size)
    cfg = resolved_deepspeed_config(args)
    if cfg is None:
        problems.append("no DeepSpeed config (pass deepspeed=toolkit.hf.deepspeed_config(spec))")
    else:
        problems += [f"deepspeed {d}" for d in config_diff(owned["deepspeed"].value, cfg)]
        tbs = cfg.get("train_batch_size")
        if tbs not in (AUTO, plan.batch.global_):
            problems.append(f"deepspeed train_batch_size={tbs} but the spec's global batch is {plan.batch.global_}")
    if problems:
        raise SpecMismatchError(problems)


def deepspeed_config(spec: SpecLike) -> dict[str, Any]:
    """The HF Trainer variant of the spec's DeepSpeed config: "auto" exactly where
    TrainingArguments owns the value, no scheduler. For TrainingArguments built by hand;
    ``check_training_arguments`` then confirms they agree with the spec."""
    return emit_deepspeed_config(hf_plan(spec), hf=True)


def accelerate_config(spec: SpecLike, ds_config_path: str | Path) -> dict[str, Any]:
    """accelerate's `--config_file` settings, naming the HF DeepSpeed config at ``ds_config_path``
    (`toolkit config` writes both: accelerate_config.yaml and ds_config_hf.json)."""
    return emit_accelerate_config(hf_plan(spec), Path(ds_config_path).resolve())
