"""`toolkit plan --chart`: per-stage memory (parameters, gradients, optimizer, activations,
buffers) against the GPU's memory, and the step time split into compute, pipeline bubble
and exposed communication; with --auto, the top candidates side by side (each with its
fullest pipeline stage)."""
from __future__ import annotations

from .page import Table

PARTS = ("params", "grads", "optimizer", "activations", "buffers")


def memory_bars(labeled: list[tuple[str, object]]) -> list[tuple[str, dict[str, float]]]:
    """(bar label, GiB by part) per bar: every stage of one plan, or each plan's fullest stage."""
    if len(labeled) == 1:
        plan = labeled[0][1]
        return [(f"stage {s.stage}", s.gib()) for s in plan.memory.stages]
    return [(f"{label}\nstage {p.memory.worst.stage}", p.memory.worst.gib()) for label, p in labeled]


def _stack(ax, labels: list[str], parts: list[str], values: list[dict[str, float]], unit: str) -> None:
    """Stacked bars, one per label, with each bar's total written above it."""
    x = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for part in parts:
        heights = [v.get(part, 0.0) for v in values]
        if any(heights):
            ax.bar(x, heights, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights)]
    for i, total in enumerate(bottom):
        ax.annotate(f"{total:.3g} {unit}", (i, total), ha="center", va="bottom", fontsize="small")
    ax.set_xticks(x, labels, fontsize="small")
    ax.margins(y=0.08)


def plan_figure(labeled: list[tuple[str, object]]):
    from matplotlib.figure import Figure

    bars = memory_bars(labeled)
    per_bar = 1.1 if len(labeled) == 1 else 2.0  # stages of one plan are narrower than labelled layouts
    fig = Figure(figsize=(max(10, per_bar * len(bars) + 2.4 * len(labeled) + 3), 6), layout="constrained")
    mem, time = fig.subplots(1, 2, width_ratios=[max(2, len(bars)), max(2, len(labeled))])
    _stack(mem, [b for b, _ in bars], list(PARTS), [v for _, v in bars], "GiB")
    first = labeled[0][1]
    gpu = first.gpu
    mem.axhline(gpu.memory_gib, color="black", linestyle="-", label=f"{gpu.name} {gpu.memory_gib:.1f} GiB")
    headroom = first.spec.estimate.headroom
    if headroom:
        mem.axhline(gpu.memory_gib * (1 - headroom), color="black", linestyle="--",
                    label=f"usable ({headroom:.0%} headroom)")
    mem.set_ylabel("GiB per GPU")
    mem.set_title("memory per GPU")
    _legend_beside(mem)
    terms = [p.time.terms for _, p in labeled]
    kinds = list(dict.fromkeys(k for t in terms for k in t))
    _stack(time, [label for label, _ in labeled], kinds, terms, "s")
    time.set_ylabel("seconds per step")
    time.set_title("step time: compute, bubble, exposed communication")
    _legend_beside(time)
    return fig


def _legend_beside(ax) -> None:
    """The legend right of the axes, top-aligned, never over a bar (constrained layout
    makes room for it)."""
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def plan_tables(labeled: list[tuple[str, object]]) -> list[Table]:
    mem_rows = tuple((label, s.stage, *(s.gib()[k] for k in PARTS), s.gib()["total"], p.memory.gpu_gib)
                     for label, p in labeled for s in p.memory.stages)
    time_rows = tuple((label, kind, sec) for label, p in labeled for kind, sec in p.time.terms.items())
    step_rows = tuple((label, p.time.step_time_s, p.time.tokens_per_s, p.time.mfu) for label, p in labeled)
    return [Table("memory per GPU (GiB) by pipeline stage", ("layout", "stage", *PARTS, "total", "GPU"), mem_rows),
            Table("step time by cause (seconds)", ("layout", "cause", "seconds"), time_rows),
            Table("step", ("layout", "step time s", "tokens/s", "MFU"), step_rows)]


def plan_chart(labeled: list[tuple[str, object]]) -> tuple[object, list[Table]]:
    """(figure, tables) of plans with estimates, each with its label."""
    missing = [label for label, p in labeled if not p.estimated]
    if missing:
        raise ValueError(f"plans without estimates cannot be drawn: {missing}")
    return plan_figure(labeled), plan_tables(labeled)

