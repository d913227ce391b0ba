"""Where a published DeepSpeed ZeRO-3 run's seconds go beside its compute, against the planner's terms.

    PYTHONPATH=. python benchmarks/zero3_published.py [--origin SUBSTRING]

For every comparable ZeRO-3 row (zero.engine deepspeed) of the origins matching ``--origin``
(default: the DeepCompile benchmarks, DeepSpeed's own ZeRO-3 runs), one micro-batch's seconds:
the published (the step over the micro-batches), the planner's compute (GEMMs, attention,
memory-bound work, recompute), the planner's ZeRO-3 traffic if nothing hid it (plan.zero3_hidden_seconds,
the figures of make_plan's zero3_overlap warning: the forward's all-gather, the backward's less what is
kept for reuse and the reduce-scatter, NCCL's latency included), what the planner
leaves exposed of it, its host work (ZERO3_HOST_S per module), and what the source leaves beside
the planner's compute (published - compute). Then, per model, the least-squares line through the
published seconds against tokens per micro-batch (rows of one accumulation only): its slope
against the planner's compute per token, its intercept against the traffic. Nothing is fitted to
the planner; this prints what the source says about overlap. Last, the rows against the planner's
two ends: its estimate (the traffic hidden as far as compute lasts) and the step with none of it
hidden (make_plan's zero3_overlap warning): est/pub range and RMS of each.
"""
from __future__ import annotations

import argparse
import math

from toolkit.estimate.data_time import ZERO3_HOST_S
from toolkit.estimate.memory import spec_stage_params
from toolkit.plan import zero3_hidden_seconds
from toolkit.search.published import PUBLISHED, estimate

COMPUTE = ("gemm", "attention", "memory", "recompute")


def terms(case) -> dict:
    plan = estimate(case)
    lay, spec, t = plan.layout, plan.spec, plan.time
    m = plan.batch.grad_accum
    modules = spec_stage_params(plan.spec, plan.shape, lay, 0).modules
    hidden, traffic = zero3_hidden_seconds(spec, plan.shape, lay, plan.batch, plan.gpu, t)  # zero3_overlap's
    return {"tokens": plan.batch.micro * plan.batch.seq_len, "m": m, "step": t.step_time_s / m,
            "published": t.step_time_s * t.tokens_per_s / lay.world / case.tokens_per_gpu / m,
            "compute": sum(t.seconds[k] for k in COMPUTE) / m, "traffic": traffic / m, "hidden": hidden / m,
            "exposed": t.seconds["dp"] / m, "host": ZERO3_HOST_S * modules, "modules": modules,
            "optimizer": t.seconds["optimizer"]}


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--origin", default="DeepSpeed DeepCompile")
    args = ap.parse_args()
    rows = [c for c in PUBLISHED if args.origin in c.origin and c.comparable and c.spec["zero"]["stage"] == 3
            and c.spec["zero"].get("engine", "deepspeed") == "deepspeed"]
    if not rows:
        print(f"error: no comparable DeepSpeed ZeRO-3 row of an origin matching {args.origin!r}")
        return 2
    print("| row | tokens/micro-batch | published s | compute s | ZeRO-3 traffic s | exposed s | host s "
          "| published - compute s | (published - compute) / traffic |")
    print("|---|---|---|---|---|---|---|---|---|")
    by_model: dict[str, list[dict]] = {}
    for case in rows:
        r = terms(case)
        by_model.setdefault(case.spec["model"], []).append(r)
        rest = r["published"] - r["compute"]
        print(f"| {case.name} | {r['tokens']} | {r['published']:.3f} | {r['compute']:.3f} | {r['traffic']:.3f} "
              f"| {r['exposed']:.3f} | {r['host']:.3f} | {rest:.3f} | {rest / r['traffic']:.2f} |")
    print()
    for model, rs in by_model.items():
        single = [r for r in rs if r["m"] == 1]
        if len({r["tokens"] for r in single}) < 2:
            continue
        a, b = line([(r["tokens"], r["published"]) for r in single])
        per_token = sum(r["compute"] / r["tokens"] for r in single) / len(single)
        print(f"{model}: published s per micro-batch = {a:.3f} + {b * 1e3:.4f} ms x tokens ({len(single)} rows); "
              f"the planner's compute {per_token * 1e3:.4f} ms per token (mean), its ZeRO-3 traffic "
              f"{single[0]['traffic']:.3f} s, host {single[0]['host']:.3f} s ({single[0]['modules']:.0f} modules x "
              f"{ZERO3_HOST_S * 1e6:.0f} us), optimizer {single[0]['optimizer']:.3f} s")
    rows_terms = [r for rs in by_model.values() for r in rs]
    for label, step in (("the estimate", lambda r: r["step"]),
                        ("none hidden", lambda r: r["step"] + r["hidden"])):
        ratios = [r["published"] / step(r) for r in rows_terms]  # est/pub = published s / estimated s
        rms = math.sqrt(sum(math.log(x) ** 2 for x in ratios) / len(ratios))
        print(f"{label}: est/pub {min(ratios):.3f}-{max(ratios):.3f}, RMS {rms:.1%} over {len(ratios)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
