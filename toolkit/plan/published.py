"""Published layouts (toolkit.plan.references) against the planner: our estimate of each published
layout, our top pick for the same model, GPUs and batch, and why they differ.

Each reference is the source's layout in our spec's terms: Megatron's distributed optimizer is
ZeRO-1, FSDP is ZeRO-3.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models import ModelShape, load_model
from ..spec import TrainingSpec
from . import Plan, make_plan
from .memory import GiB, usable_bytes
from .references import PUBLISHED, Published
from .search import SearchResult, search

__all__ = ["PUBLISHED", "Comparison", "Published", "compare", "estimate", "explain_difference", "time_terms"]


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
    """make_plan of the published layout."""
    return make_plan(TrainingSpec.from_dict(case.spec), reference_shape(case))


@dataclass(frozen=True)
class Comparison:
    case: Published
    plan: Plan  # our estimate of the published layout
    search: SearchResult | None  # our search for the same model, GPUs and batch
    why: str  # where our pick differs: which estimated costs (or memory) make the difference

    @property
    def pick(self) -> Plan | None:
        return self.search.candidates[0].plan if self.search and self.search.candidates else None

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
        if self.search is None or not self.plan.valid or not self.plan.memory.fits(self.search.headroom):
            return None
        return self.search.faster_than(self.plan.time.step_time_s) + 1

    @property
    def pick_gain(self) -> float | None:
        """How much faster our pick is estimated than the published layout (0.1 = 10%)."""
        if self.pick is None or not self.estimated:
            return None
        return self.plan.time.step_time_s / self.pick.time.step_time_s - 1


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
    plan = make_plan(spec, shape)
    if not searched:
        return Comparison(case, plan, None, "")
    result = search(spec, shape, top=1)
    pick = result.candidates[0].plan if result.candidates else None
    return Comparison(case, plan, result, explain_difference(plan, pick, result.headroom))
