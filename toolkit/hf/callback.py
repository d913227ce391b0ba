"""A Trainer callback that states the plan at start, re-checks that the run is the spec's,
and on GPU compares the measured peak memory with the plan's estimate.

The estimate's ``buffers`` term (CUDA context, NCCL, fragmentation) is not allocated through
PyTorch's caching allocator, so ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` are both compared with model states + activations; the gap between
the two measured peaks is the allocator's own fragmentation.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ..estimate.memory import GiB, peak_phase
from ..mcore.cpu_compat import release_deepspeed_shm
from ..plan import Plan
from .arguments import SpecLike, SpecMismatchError, check_training_arguments, hf_plan

log = logging.getLogger("toolkit.hf")


def plan_summary(plan: Plan) -> str:
    """One paragraph: layout, batch arithmetic, ZeRO, and the per-GPU memory estimate."""
    lay, b, z, w = plan.layout, plan.batch, plan.spec.zero, plan.memory.worst
    g = w.gib()
    offload = f", {w.cpu_offloaded / GiB:.3f} GiB offloaded to host" if w.cpu_offloaded else ""
    return (f"plan: {plan.spec.model} on {lay.world} x {plan.gpu.name}, data parallel dp={lay.dp}; "
            f"global batch {b.global_} = micro {b.micro} x accumulation {b.grad_accum} x dp {lay.dp}, seq_len "
            f"{b.seq_len}; ZeRO-{z.stage} (offload optimizer={z.offload_optimizer}, param={z.offload_param}), "
            f"{plan.spec.precision}; estimated memory per GPU: params {g['params']:.3f} + grads {g['grads']:.3f} + "
            f"optimizer {g['optimizer']:.3f} + {peak_phase(g, '.3f')} + buffers {g['buffers']:.3f} = "
            f"{g['total']:.3f} GiB{offload}")


def memory_report(plan: Plan, peak_allocated: float, peak_reserved: float) -> dict[str, float]:
    """Measured peaks (bytes) beside the estimate, in GiB, with measured / estimated ratios."""
    w = plan.memory.worst
    est = w.model_states + w.activations
    return {"measured_allocated_gib": peak_allocated / GiB, "measured_reserved_gib": peak_reserved / GiB,
            "estimated_gib": est / GiB, "estimated_with_buffers_gib": w.total / GiB,
            "allocated_over_estimate": peak_allocated / est, "reserved_over_estimate": peak_reserved / est}


def batch_conflicts(plan: Plan, ds_config: dict[str, Any]) -> list[str]:
    """Batch values of a resolved DeepSpeed config that are not the spec's."""
    b = plan.batch
    want = {"train_batch_size": b.global_, "train_micro_batch_size_per_gpu": b.micro,
            "gradient_accumulation_steps": b.grad_accum}
    return [f"DeepSpeed {k}={ds_config.get(k)} but the spec gives {v} (global {b.global_} = micro {b.micro} x "
            f"accumulation {b.grad_accum} x dp {plan.layout.dp})" for k, v in want.items() if ds_config.get(k) != v]


def engine_batch_conflicts(plan: Plan) -> list[str]:
    """Checks the config accelerate hands to deepspeed.initialize ("auto" values filled)."""
    from accelerate.state import AcceleratorState

    plugin = getattr(AcceleratorState(), "deepspeed_plugin", None)
    if plugin is None:
        return ["the Trainer is not running DeepSpeed (use TrainingArguments from toolkit.hf.training_arguments)"]
    return batch_conflicts(plan, plugin.deepspeed_config)


class PlanCallback(TrainerCallback):
    """Reports through ``report`` (default: the ``toolkit.hf`` logger at INFO) on the main
    process. At train begin: the plan, and a SpecMismatchError if the TrainingArguments or the
    DeepSpeed config the Trainer resolved disagree with the spec. On GPU, after the first
    optimizer step and at the end: measured vs estimated memory (kept in ``self.memory``)."""

    def __init__(self, spec: SpecLike, report: Callable[[str], None] | None = None):
        self.plan = hf_plan(spec)
        self.report = report or log.info
        self.memory: dict[str, float] | None = None

    def on_train_begin(self, args, state, control, **kwargs: Any):
        release_deepspeed_shm()  # deepspeed.comm is up by now (the Trainer built its engine)
        problems = engine_batch_conflicts(self.plan)
        if problems:
            raise SpecMismatchError(problems)
        check_training_arguments(self.plan, args)
        if state.is_world_process_zero:
            self.report(plan_summary(self.plan))

    def on_step_end(self, args, state, control, **kwargs: Any):
        if state.global_step == 1:
            self._measure(state)

    def on_train_end(self, args, state, control, **kwargs: Any):
        self._measure(state)

    def _measure(self, state) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        self.memory = memory_report(self.plan, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        if state.is_world_process_zero:
            m = self.memory
            self.report(f"memory at step {state.global_step}: peak allocated {m['measured_allocated_gib']:.3f} GiB, "
                        f"reserved {m['measured_reserved_gib']:.3f} GiB; estimated {m['estimated_gib']:.3f} GiB "
                        f"(+ buffers {m['estimated_with_buffers_gib']:.3f}); allocated / estimate "
                        f"{m['allocated_over_estimate']:.2f}")
