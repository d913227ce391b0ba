"""Published layouts (toolkit.search.references) against the planner: our estimate of each published
layout, our top pick for the same model, GPUs and batch, and why they differ.

Each reference is the source's layout in our spec's terms: Megatron's distributed optimizer is
ZeRO-1, FSDP's FULL_SHARD ZeRO-3 and SHARD_GRAD_OP ZeRO-2 with zero.engine fsdp (planned without
FSDP_FREE's finding: no target here runs FSDP). A Megatron-Bridge run (``Published.megatron_bridge``) is planned as target
megatron-lm without the findings of BRIDGE_FREE, the limits of Megatron-LM's command line that
Megatron-Bridge, building megatron-core's config in Python, does not have; where one of them
refused the model, the search (which has no Megatron-Bridge target) is not run for the row. A
torchtitan run is planned as target hf without TORCHTITAN_FREE's findings (its per-op checkpointing is
recompute op, which no target here runs).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..estimate.memory import GiB, usable_bytes
from ..models import ModelShape, load_model
from ..plan import Plan, make_plan
from ..spec import TrainingSpec
from .partial import zero_choices
from .references import PUBLISHED, Published, Software
from .search import SearchResult, search

__all__ = ["BRIDGE_FREE", "FSDP_FREE", "PUBLISHED", "Comparison", "Published", "bridge_only", "compare", "estimate",
           "explain_difference", "software_axes", "time_terms"]

TOP = 10  # the ranking target: the published layout among the planner's first TOP for its job
BRIDGE_FREE = ("megatron_lm_flags",)  # rules of Megatron-LM's flags that do not bind a Megatron-Bridge run
# torchtitan's rows are estimated as target hf (its eager kernels) with zero.engine fsdp; its own per-op
# selective checkpointing is recompute op, which every target refuses (none runs it)
TORCHTITAN_FREE = ("op_recompute",)
# a run sharded by PyTorch FSDP (zero.engine fsdp) is estimated as FSDP ran it, which no target here runs
FSDP_FREE = ("fsdp_runs",)


def reference_shape(case: Published) -> ModelShape:
    return case.shape() if case.shape else load_model(case.spec["model"])


def published_tokens_per_gpu(case: Published, plan: Plan) -> float | None:
    """The source's tokens/s/GPU; a published FLOP/s figure is converted with our model FLOPs per token."""
    if case.tokens_per_gpu is not None:
        return case.tokens_per_gpu
    if case.tflops_per_gpu is not None and plan.time is not None:
        return case.tflops_per_gpu / (plan.time.model_flops / plan.batch.tokens)
    return None


def estimate(case: Published) -> Plan:
    """make_plan of the published layout (a Megatron-Bridge run's without BRIDGE_FREE's findings, a
    torchtitan run's without TORCHTITAN_FREE's, an FSDP run's without FSDP_FREE's)."""
    plan = make_plan(TrainingSpec.from_dict(case.spec), reference_shape(case))
    free = BRIDGE_FREE if case.megatron_bridge else TORCHTITAN_FREE if case.origin == "torchtitan" else ()
    if plan.spec.zero.engine == "fsdp":
        free += FSDP_FREE
    if not free:
        return plan
    return replace(plan, findings=tuple(f for f in plan.findings if f.rule not in free))


def bridge_only(case: Published, plan: Plan) -> str:
    """Why the search cannot run for a Megatron-Bridge row ("" if it can): the Megatron-LM flag
    limit that refuses the model, which every layout of target megatron-lm shares."""
    if not case.megatron_bridge:
        return ""
    full = make_plan(plan.spec, plan.shape)
    refused = [f.message for f in full.findings if f.rule in BRIDGE_FREE and f.level == "error"]
    return ("not searched: every layout of target megatron-lm is refused (" + refused[0] + "), which "
            "Megatron-Bridge runs") if refused else ""


@dataclass(frozen=True)
class Comparison:
    case: Published
    plan: Plan  # our estimate of the published layout
    search: SearchResult | None  # our search for the same model, GPUs and batch
    why: str  # where our pick differs: which estimated costs (or memory) make the difference
    period: SearchResult | None = None  # the same search over what the source's software offered
    period_why: str = ""

    @property
    def pick(self) -> Plan | None:
        return _first(self.search)

    @property
    def period_pick(self) -> Plan | None:
        return _first(self.period)

    @property
    def published_tokens_per_gpu(self) -> float | None:
        return published_tokens_per_gpu(self.case, self.plan)

    @property
    def estimated(self) -> bool:
        """The rules accept the published layout (our memory estimate may still say it does not fit)."""
        p = self.plan
        return p.valid or (len(p.errors) == 1 and not p.memory.fits(p.spec.estimate.headroom))

    @property
    def ratio(self) -> float | None:
        """Our tokens/s/GPU estimate of the published layout over the published figure."""
        pub = self.published_tokens_per_gpu
        if pub is None or not self.estimated:
            return None
        return self.plan.time.tokens_per_s / self.plan.layout.world / pub

    @property
    def rank(self) -> int | None:
        """1 + the fitting layouts the search estimates faster than the published one."""
        return _rank(self.plan, self.search)

    @property
    def pick_gain(self) -> float | None:
        """How much faster our pick is estimated than the published layout (0.1 = 10%)."""
        return self._gain(self.pick)

    @property
    def period_rank(self) -> int | None:
        return _rank(self.plan, self.period)

    @property
    def period_pick_gain(self) -> float | None:
        return self._gain(self.period_pick)

    def meets_ranking(self, error: float) -> bool | None:
        """The issue's ranking target, judged on the search for the row's job (the restricted one
        where the source's software offered less): the published layout in our first TOP, or our
        pick faster by less than ``error`` (the model's error)."""
        rank, gain = (self.period_rank, self.period_pick_gain) if self.period else (self.rank, self.pick_gain)
        if gain is None:
            return None
        return (rank is not None and rank <= TOP) or gain < error

    def _gain(self, pick: Plan | None) -> float | None:
        if pick is None or not self.estimated:
            return None
        return self.plan.time.step_time_s / pick.time.step_time_s - 1


def _first(result: SearchResult | None) -> Plan | None:
    return result.candidates[0].plan if result and result.candidates else None


def _rank(plan: Plan, result: SearchResult | None) -> int | None:
    if result is None or not plan.valid or not plan.memory.fits(result.headroom):
        return None
    return result.faster_than(plan.time.step_time_s) + 1


def software_axes(software: Software) -> dict[str, tuple]:
    """Search axes of a Software (its ZeRO stages without offload)."""
    axes = dict(software.axes)
    if "zero" in axes:
        axes["zero"] = tuple(z for z in zero_choices(None) if z.stage in software.axes["zero"]
                             and z.offload_optimizer == z.offload_param == "none")
    return axes


def time_terms(plan: Plan) -> dict[str, float]:
    """Seconds per step by cause (TimeEstimate.seconds)."""
    return dict(plan.time.seconds)


def _same_layout(a: Plan, b: Plan) -> bool:
    return (a.layout, a.spec.zero, a.batch.micro, a.spec.recompute) == (b.layout, b.spec.zero, b.batch.micro,
                                                                       b.spec.recompute)


def explain_difference(published: Plan, pick: Plan | None, headroom: float) -> str:
    if pick is None:
        return "no layout fits"
    if not published.valid:
        return "the published layout is rejected: " + published.errors[0]
    if not published.memory.fits(headroom):
        return (f"the published layout needs {published.memory.worst.total / GiB:.1f} GiB per GPU, more than the "
                f"{usable_bytes(published.gpu.memory_gib, headroom) / GiB:.1f} GiB the search allows "
                f"({headroom:.0%} headroom); the pick needs {pick.memory.worst.total / GiB:.1f}")
    if _same_layout(published, pick):
        return "the pick is the published layout"
    ours, theirs = time_terms(pick), time_terms(published)
    saved = sorted(((theirs[k] - ours[k], k) for k in ours), reverse=True)
    gains = [f"{k} {d:.3g} s" for d, k in saved if d > 1e-3 * published.time.step_time_s][:3]
    costs = [f"{k} {-d:.3g} s" for d, k in saved if -d > 1e-3 * published.time.step_time_s][:2]
    mem = f"; memory {pick.memory.worst.total / GiB:.1f} vs {published.memory.worst.total / GiB:.1f} GiB"
    text = "the pick saves " + (", ".join(gains) or "nothing measurable")
    return text + (" and spends more on " + ", ".join(costs) if costs else "") + " per step" + mem


def compare(case: Published, *, searched: bool = True) -> Comparison:
    spec = TrainingSpec.from_dict(case.spec)
    shape = reference_shape(case)
    plan = estimate(case)
    if not searched:
        return Comparison(case, plan, None, "")
    unsearchable = bridge_only(case, plan)
    if unsearchable:
        return Comparison(case, plan, None, unsearchable)
    result = search(spec, shape, top=1)
    why = explain_difference(plan, _first(result), result.headroom)
    if case.software is None:
        return Comparison(case, plan, result, why)
    period = search(spec, shape, top=1, axes=software_axes(case.software))
    return Comparison(case, plan, result, why, period, explain_difference(plan, _first(period), period.headroom))
