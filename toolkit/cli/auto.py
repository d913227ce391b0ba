"""Rendering of ``toolkit plan --auto`` results (tables, --explain, --json); no logic."""
from __future__ import annotations

from rich.table import Table

from ..hardware import get_gpu
from ..plan import Plan
from ..search.search import SEARCHED_KEYS, SearchResult
from ..spec import TrainingSpec
from .tables import layout_label, zero_label

GiB = 1024**3
FAMILIES_PER_RULE = 6  # the table shows a rule's largest families; --json lists every one


def _row(rank: str, plan: Plan) -> list[str]:
    t = plan.time
    if t is None:  # the spec's own layout, when its sizes do not come out
        return [rank, layout_label(plan), zero_label(plan), str(plan.batch.micro), plan.spec.recompute,
                "-", "-", "-", "-", "invalid"]
    return [rank, layout_label(plan), zero_label(plan), str(plan.batch.micro), plan.spec.recompute,
            f"{plan.memory.worst.total / GiB:.1f}", f"{t.step_time_s:.3f}", f"{t.tokens_per_s:,.0f}",
            f"{t.mfu:.1%}", t.dominant]


def candidates_table(spec: TrainingSpec, result: SearchResult, spec_plan: Plan | None) -> Table:
    b = spec.batch
    title = (f"{spec.model} on {spec.cluster.world_size} x {get_gpu(spec.cluster.gpu).name}, global batch {b.global_} "
             f"x {b.seq_len} tokens: top {len(result.candidates)} of {result.fitting:,} layouts that fit "
             f"({result.valid:,} valid of {result.space:,} searched; memory headroom {result.headroom:.0%})")
    tab = Table("#", "layout", "ZeRO", "micro", "recompute", "GiB/GPU", "step s", "tokens/s", "MFU", "dominant",
                title=title)
    hidden = sum(c.hidden for c in result.candidates)
    tab.caption = f"{hidden:,} slower variants of these (same grid or step time, no less memory) not listed" \
        if hidden else None
    for i, c in enumerate(result.candidates, 1):
        tab.add_row(*_row(str(i), c.plan))
    if spec_plan is not None:
        tab.add_row(*_row("spec", spec_plan), style="dim")
    return tab


def spec_line(result: SearchResult, plan: Plan) -> str:
    """Where the layout the spec wrote stands (it is the table's dim 'spec' row)."""
    if not plan.valid:
        return "the spec's own layout is invalid: " + "; ".join(plan.errors)
    if not plan.memory.fits(result.headroom):
        w = plan.memory.worst.total / GiB
        return (f"the spec's own layout does not fit: {w:.1f} GiB per GPU > "
                f"{plan.gpu.memory_gib * (1 - result.headroom):.1f} GiB usable")
    return (f"the spec's own layout: {result.faster_than(plan.time.step_time_s):,} of the {result.fitting:,} "
            f"fitting layouts are estimated faster")


def explain_table(result: SearchResult) -> Table:
    """Families grouped by rule: the rule's total, then its largest families."""
    tab = Table("layouts", "rule / reason", title=f"{result.rejected - result.skipped:,} layouts rejected by the "
                f"rules, {result.skipped:,} not tried, "
                f"{result.valid - result.fitting:,} valid ones that do not fit in memory; warnings are kept")
    by_rule: dict[tuple[str, str], list] = {}
    for f in result.families:
        by_rule.setdefault((f.kind, f.rule), []).append(f)
    for (kind, rule), fams in sorted(by_rule.items(), key=lambda kv: -sum(f.layouts for f in kv[1])):
        note = {"warning": " (warning: kept; the cost model charges for it)",
                "skipped": " (not tried: the same as a layout tried, or no split)"}.get(kind, "")
        tab.add_row(f"{sum(f.layouts for f in fams):,}", f"[bold]{rule}[/]{note}")
        for f in fams[:FAMILIES_PER_RULE]:
            tab.add_row(f"{f.layouts:,}", f"  {f.message}")
        if len(fams) > FAMILIES_PER_RULE:
            rest = fams[FAMILIES_PER_RULE:]
            tab.add_row(f"{sum(f.layouts for f in rest):,}", f"  ... {len(rest)} more (all in --json)")
    return tab


def time_table(result: SearchResult, spec_plan: Plan | None) -> Table | None:
    """Where the seconds of a step go (TimeEstimate.seconds) for the pick and the spec's layout."""
    plans = [("#1 " + layout_label(c.plan), c.plan) for c in result.candidates[:1]]
    if spec_plan is not None and spec_plan.time is not None:
        plans.append(("spec " + layout_label(spec_plan), spec_plan))
    if not plans:
        return None
    tab = Table("seconds per step", *(label for label, _ in plans),
                title="where the step goes (slowest pipeline stage; compute at the efficiency its GEMM and "
                      "attention shapes allow, communication only where it is not hidden)")
    for kind in plans[0][1].time.seconds:
        cells = [f"{p.time.seconds[kind]:.3f} ({p.time.seconds[kind] / p.time.step_time_s:.0%})" for _, p in plans]
        if any(p.time.seconds[kind] for _, p in plans):
            tab.add_row(kind, *cells)
    tab.add_row("[bold]step[/]", *(f"[bold]{p.time.step_time_s:.3f}[/]" for _, p in plans))
    return tab


def auto_json(result: SearchResult, spec_plan: Plan | None, explain: bool) -> dict:
    out: dict = {"candidates": [c.as_dict() for c in result.candidates],
                 "search": {"space": result.space, "valid": result.valid, "fitting": result.fitting,
                            "rejected_by_rules": result.rejected, "headroom": result.headroom,
                            "searched_keys": list(SEARCHED_KEYS), "mismatches": list(result.mismatches)}}
    if spec_plan is not None:
        faster = result.faster_than(spec_plan.time.step_time_s) if spec_plan.time else None
        out["spec_layout"] = {**spec_plan.as_dict(), "faster_layouts": faster}
    if explain:
        out["families"] = [{"kind": f.kind, "rule": f.rule, "reason": f.message, "layouts": f.layouts}
                           for f in result.families]
    return out
