"""spec -> Plan: derived sizes, every rule checked, memory and time estimated.

A Plan is immutable and is what every generator reads; nothing downstream re-derives it.
When a size does not come out (a rule's ``size_error``: a division with a remainder, a
size beyond the world or the model), the derived sizes mean nothing: such a plan carries
its errors and no memory or time estimate (``memory`` and ``time`` are None).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..backends.deepspeed import bucket_sizes
from ..backends.megatron import padded_vocab
from ..errors import PlanError
from ..estimate.data_time import buckets, zero3_traffic_seconds
from ..estimate.memory import (GiB, MemoryEstimate, estimate_memory, grad_reduce_bytes, peak_phase, spec_stage_params,
                               stage_params)
from ..estimate.time import TimeEstimate, estimate_time
from ..hardware import GPU, get_gpu
from ..models import ModelShape, active_params, load_model, total_params
from ..parallel.layout import BatchPlan, Layout, derive_batch, derive_layout
from ..spec import TrainingSpec
# register the runtime's, megatron's, FP8's and ZeRO++'s limits
from . import linear_attention_rules, precision_rules, runtime_rules, zeropp_rules  # noqa: F401
from .rules import RULES, Context, Finding, found

MEMORY_RULE = "memory"  # the id of the memory check (memory_finding), which runs after the estimate
ZERO3_OVERLAP_RULE = "zero3_overlap"  # the id of zero3_overlap_finding's warning, after the estimate
ZERO3_HIDDEN_WARN = 0.1  # zero3_overlap_finding warns when more than this share of the step is hidden
FUSED_EXPERTS_RULE = "hf_fused_experts"  # the id of fused_experts_finding's warning, after the estimate
FUSED_EXPERTS_WARN = 0.1  # it warns when gathering the fused experts takes more than this share of a GPU
ZERO3_SOURCE = ("DeepSpeed's own published ZeRO-3 runs hid little of theirs "
                "(docs/planner.md, \"DeepSpeed's own ZeRO-3 runs\")")


@dataclass(frozen=True)
class Plan:
    spec: TrainingSpec
    shape: ModelShape
    gpu: GPU
    layout: Layout
    batch: BatchPlan
    memory: MemoryEstimate | None  # None: the sizes do not come out (see the module docstring)
    time: TimeEstimate | None
    findings: tuple[Finding, ...]  # every rule's errors and warnings, with the rule's id and scope

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(f.message for f in self.findings if f.level == "error")

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(f.message for f in self.findings if f.level == "warning")

    @property
    def valid(self) -> bool:
        return not self.errors

    @property
    def estimated(self) -> bool:
        """Whether the sizes came out, so that dp, accumulation, memory and time mean something."""
        return self.memory is not None

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self.shape.vocab_size, self.layout.tp)

    def require_valid(self) -> Plan:
        if self.errors:
            raise PlanError(list(self.errors))
        return self

    def _memory_dict(self) -> dict | None:
        if self.memory is None:
            return None
        worst = self.memory.worst
        mem = worst.gib()
        mem.update(gpu=round(self.memory.gpu_gib, 3), worst_stage=worst.stage,
                   cpu_offloaded=round(worst.cpu_offloaded / GiB, 3),
                   classic_model_states_total=round(self.memory.classic_model_states / GiB, 1))
        return mem

    def as_dict(self) -> dict:
        """JSON form; without estimates, the derived sizes (dp, edp, grad_accum) are null too."""
        layout, batch = self.layout.as_dict(), self.batch.as_dict()
        if not self.estimated:
            layout.update(dp=None, edp=None)
            batch.update(grad_accum=None)
        return {
            "valid": self.valid,
            "errors": list(self.errors),
            "warnings": list(self.warnings),
            "model": {"name": self.spec.model, "architecture": self.shape.architecture,
                      "params": total_params(self.shape), "active_params": active_params(self.shape),
                      "padded_vocab": self.padded_vocab},
            "cluster": {"nodes": self.spec.cluster.nodes, "gpus_per_node": self.spec.cluster.gpus_per_node,
                        "gpu": self.gpu.name, "world": self.layout.world},
            "layout": layout,
            "batch": batch,
            "zero": self.spec.zero.model_dump(),
            "precision": self.spec.precision,
            "recompute": self.spec.recompute,
            "memory_gib": self._memory_dict(),
            "memory_gib_per_stage": [s.gib() for s in self.memory.stages] if self.memory else [],
            "fits": self.memory.fits(self.spec.estimate.headroom) if self.memory else None,
            "time": self.time.as_dict() if self.time else None,
        }


def memory_finding(plan_memory: MemoryEstimate | None, gpu: GPU, headroom: float) -> Finding | None:
    """The memory error of an estimate that does not fit (None: fits, or nothing estimated)."""
    if plan_memory is None or plan_memory.fits(headroom):
        return None
    w = plan_memory.worst
    g = w.gib()
    limit = gpu.memory_gib * (1 - headroom)
    return Finding("error", (
        f"needs {g['total']:.1f} GiB per GPU on pipeline stage {w.stage} > {limit:.1f} GiB usable on {gpu.name} "
        f"(params {g['params']:.1f} + grads {g['grads']:.1f} + optimizer {g['optimizer']:.1f} + "
        f"{peak_phase(g, '.1f')} + buffers {g['buffers']:.1f})"), rule=MEMORY_RULE, scope="training")


def zero3_hidden_seconds(spec: TrainingSpec, shape: ModelShape, layout: Layout, batch: BatchPlan, gpu: GPU,
                         time: TimeEstimate | None) -> tuple[float, float]:
    """(hidden, traffic): seconds a step of DeepSpeed ZeRO-3's gathers and reduce-scatters on its
    overlapped path (data_time.zero3_traffic_seconds) and the part of them the estimate hides behind
    compute; (0, 0) for any other path or without an estimate."""
    if time is None or spec.zero.stage != 3 or spec.zero.engine != "deepspeed":
        return 0.0, 0.0
    bucket = buckets(spec.target, spec.precision, spec.zero, layout, shape.hidden_size,
                     sizes=bucket_sizes(spec, shape))
    params = [spec_stage_params(spec, shape, layout, k) for k in range(layout.pp)]
    traffic = zero3_traffic_seconds(layout, gpu, params, spec.zero, spec.precision, grad_reduce_bytes(spec), bucket,
                                    batch.grad_accum)
    return max(0.0, traffic - time.seconds["dp"]), traffic


def zero3_overlap_finding(spec: TrainingSpec, shape: ModelShape, layout: Layout, batch: BatchPlan, gpu: GPU,
                          time: TimeEstimate | None) -> Finding | None:
    """A warning where the estimate hides more than ZERO3_HIDDEN_WARN of the step's DeepSpeed
    ZeRO-3 gathers and reduce-scatters behind compute (its overlapped path): DeepSpeed's own
    published ZeRO-3 runs hid little of theirs (docs/planner.md, "DeepSpeed's own ZeRO-3 runs"), so
    the step with none hidden is given beside the estimate."""
    hidden, traffic = zero3_hidden_seconds(spec, shape, layout, batch, gpu, time)
    if time is None or hidden <= ZERO3_HIDDEN_WARN * time.step_time_s:
        return None
    step = time.step_time_s
    return Finding("warning", (
        f"ZeRO-3: {hidden:.3g} s of the {traffic:.3g} s a step of parameter all-gathers and gradient reduce-scatters "
        f"are estimated hidden behind compute; {ZERO3_SOURCE}: with none hidden the step is {step + hidden:.3g} s, "
        f"not {step:.3g} s ({step / (step + hidden):.0%} of the estimated throughput)"),
        rule=ZERO3_OVERLAP_RULE, scope="training")


def spec_shape(spec: TrainingSpec, shape: ModelShape | None = None) -> ModelShape:
    """The model the spec trains: ``shape`` (a checkpoint's own architecture) or spec.model's,
    with spec.mtp.layers multi-token prediction modules when the spec sets them."""
    shape = shape or load_model(spec.model)
    return shape if spec.mtp.layers is None else replace(shape, mtp_layers=spec.mtp.layers)


def fused_experts_finding(spec: TrainingSpec, shape: ModelShape, layout: Layout, gpu: GPU) -> Finding | None:
    """A warning where the HF Trainer's DeepSpeed ZeRO-3 gathers a MoE layer's experts at once, as
    transformers 5 holds them (one module: estimate.hf_experts fused), and that gathered module with its
    gradient takes more than FUSED_EXPERTS_WARN of the GPU (the memory estimate's 4 bytes x the largest
    module, memory.stage_states). No other module of the model comes near it; the plan says why."""
    if not (spec.target == "hf" and shape.is_moe and spec.estimate.hf_experts == "fused" and spec.zero.stage == 3
            and spec.zero.engine == "deepspeed"):
        return None
    largest = max(spec_stage_params(spec, shape, layout, k).largest for k in range(layout.pp))
    apart = max(stage_params(shape, layout, k, "modules").largest for k in range(layout.pp))
    gathered = 4 * largest / GiB
    if largest <= apart or gathered <= FUSED_EXPERTS_WARN * gpu.memory_gib:
        return None
    return Finding("warning", (
        f"ZeRO-3 gathers a MoE layer's experts at once: transformers 5 holds them as one module of "
        f"{largest / 1e9:.3g} billion parameters, {gathered:.1f} GiB of the estimate with its gradient "
        f"({gathered / gpu.memory_gib:.0%} of {gpu.name}); with transformers 4.x's Linear per expert weight "
        f"(estimate.hf_experts: modules) the largest module is {apart / 1e9:.3g} billion"),
        rule=FUSED_EXPERTS_RULE, scope="training")


def make_plan(spec: TrainingSpec, shape: ModelShape | None = None) -> Plan:
    """Never raises for rule violations: they are collected in ``errors`` (and estimates are
    made only from sizes that come out). ``shape``
    replaces loading ``spec.model`` (a checkpoint that carries its own architecture)."""
    shape = spec_shape(spec, shape)
    gpu = get_gpu(spec.cluster.gpu)
    layout = derive_layout(spec, shape)
    batch = derive_batch(spec, layout)
    ctx = Context(spec, shape, layout, batch, gpu)
    findings: list[Finding] = [f for r in RULES for f in found(r, r(ctx))]
    memory = time = None
    if not any(f.sizes for f in findings):
        memory = estimate_memory(spec, shape, layout, batch, gpu.memory_gib)
        mem = memory_finding(memory, gpu, spec.estimate.headroom)
        if mem:
            findings.append(mem)
        experts = fused_experts_finding(spec, shape, layout, gpu)
        if experts:
            findings.append(experts)
        time = estimate_time(spec, shape, layout, batch, gpu)
        overlap = zero3_overlap_finding(spec, shape, layout, batch, gpu, time)
        if overlap:
            findings.append(overlap)
    return Plan(spec, shape, gpu, layout, batch, memory, time, tuple(findings))


def load_plan(path: str | Path) -> Plan:
    return make_plan(TrainingSpec.from_yaml(path))


__all__ = ["BatchPlan", "Layout", "MemoryEstimate", "Plan", "TimeEstimate", "load_plan", "make_plan"]
