"""Published runs vs the planner: our estimate of each published layout against the published
throughput, and our top pick for the same model, GPUs and batch (``toolkit plan --auto``), as
one markdown table.

    PYTHONPATH=. python benchmarks/plan_compare_published.py [--only SUBSTRING] [--no-search]
    PYTHONPATH=. python benchmarks/plan_compare_published.py --fit
    PYTHONPATH=. python benchmarks/plan_compare_published.py --by-origin [--only SUBSTRING]

Columns: est/pub is our tokens/s/GPU over the published one (marked * where the row is one the
step-time constants are fitted on, "nc" where the run is not comparable: FP8, other hardware);
rank is where the published layout stands among the layouts the search finds that fit (1 =
our fastest); "pick +x%" is how much faster our pick is estimated. ``--fit`` fits the constants
of toolkit.estimate.compute.CALIBRATION to the rows marked fit (coordinate descent on the RMS of
log(est/pub)) and prints them with the error on every row; the table uses the constants in the
code. ``--by-origin`` holds each origin (references.yaml) out whole: the constants fitted on the
other origins' fit rows, the error on every comparable row of the one held out.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

from toolkit.cli.tables import plan_label
from toolkit.estimate import compute
from toolkit.estimate.time import estimate_time
from toolkit.search.published import PUBLISHED, TOP, Comparison, compare, estimate, published_tokens_per_gpu

GiB = 1024**3
GRID = {"gemm_efficiency": [x / 100 for x in range(50, 96)],
        "ampere_gemm_efficiency": [x / 100 for x in range(50, 96)], "tile": [16, 32, 48, 64, 96, 128, 192, 256, 384],
        "attention_efficiency": [x / 100 for x in range(30, 96, 2)],
        "attention_chunk": [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]}


def layout(plan) -> str:
    return plan_label(plan)  # grid (cp_comm, uneven split, tp overlap where set), ZeRO, micro, recompute


def cells(plan) -> list[str]:
    if plan.time is None:
        return ["invalid", "-", "-", "-"]
    t = plan.time
    fits = "" if plan.memory.fits() else " (does not fit)"
    return [f"{plan.memory.worst.total / GiB:.1f}{fits}", f"{t.tokens_per_s / plan.layout.world:,.0f}", f"{t.mfu:.1%}",
            t.dominant]


def published_cell(c: Comparison) -> str:
    pub = c.published_tokens_per_gpu
    if pub is None:
        return "-"
    mark = "*" if c.case.fit else ("" if c.case.comparable else ", nc")
    ratio = "" if c.ratio is None else f" ({c.ratio:.2f}{mark})"
    return f"{pub:,.0f}{ratio}" + (f", MFU {c.case.published_mfu}" if c.case.published_mfu else "")


def rank_cell(c: Comparison) -> str:
    rank = "-" if c.rank is None else str(c.rank)
    if c.period is None:
        return rank
    period = "-" if c.period_rank is None else str(c.period_rank)
    return f"{period} ({c.case.software.name}); {rank} (any)"


def pick_row(label: str, pick, gain: float | None, why: str) -> str:
    cell = f"pick {gain:+.1%}" if gain is not None else ""
    return f"| | {label}: {layout(pick)} | " + " | ".join(cells(pick)) + f" | | {cell} | {why} |"


def rows(c: Comparison) -> list[str]:
    out = [f"| {c.case.name} | published: {layout(c.plan)} | " + " | ".join(cells(c.plan))
           + f" | {published_cell(c)} | {rank_cell(c)} | |"]
    if c.period_pick is not None:
        out.append(pick_row(f"our pick, {c.case.software.name}", c.period_pick, c.period_pick_gain, c.period_why))
    if c.pick is not None:
        out.append(pick_row("our pick" + (", any software" if c.period else ""), c.pick, c.pick_gain, c.why))
    elif c.search is None and c.why:  # a Megatron-Bridge row whose model Megatron-LM's flags cannot run
        out.append(f"| | {c.why} | | | | | | | |")
    return out


def table(only: str, searched: bool) -> None:
    print("| case | layout | GiB/GPU | est. tokens/s/GPU | est. MFU | dominant | published tokens/s/GPU (est/pub) | "
          "rank | why the pick differs |")
    print("|---|---|---|---|---|---|---|---|---|")
    sources, ratios, compared = [], [], []
    for case in PUBLISHED:
        if only not in case.name:
            continue
        t0 = time.perf_counter()
        c = compare(case, searched=searched)
        compared.append(c)
        print("\n".join(rows(c)), flush=True)
        if c.ratio is not None and case.comparable:
            ratios.append((case.name, c.ratio, case.fit))
        took = f" [search {time.perf_counter() - t0:.1f} s, {c.search.space:,} layouts]" if c.search else ""
        software = f". Searched also over {case.software.name}: {case.software.why}" if case.software else ""
        sources.append(f"- {case.name}: {case.source}" + (f". Note: {case.note}" if case.note else "") + software
                       + took)
    print("\nSources and notes:\n" + "\n".join(sources))
    summary(ratios)
    ranking(compared, ratios)


def rms(ratios: list[float]) -> float:
    return math.sqrt(sum(math.log(r) ** 2 for r in ratios) / len(ratios))


def ranking(compared: list[Comparison], ratios: list[tuple[str, float, bool]]) -> None:
    """The issue's ranking target per searched row with a published throughput, with the model's
    error taken as its RMS error over all comparable rows and as the +-15% bound of the error
    target (rank "-": the published layout does not fit in the search's headroom)."""
    searched = [c for c in compared if c.search is not None and c.case.comparable and c.ratio is not None]
    if not searched or not ratios:
        return
    for error in (rms([r for _, r, _ in ratios]), 0.15):
        met = [c for c in searched if c.meets_ranking(error)]
        print(f"\nranking (published layout in our top {TOP}, or our pick faster by less than {error:.1%}; rows "
              f"with a restricted search judged on it): met by {len(met)} of {len(searched)}")
        for c in searched:
            if c not in met:
                gain = c.period_pick_gain if c.period else c.pick_gain
                rank = c.period_rank if c.period else c.rank
                print(f"  not met: {c.case.name}: rank {'-' if rank is None else rank}, pick {gain:+.1%}")


def summary(ratios: list[tuple[str, float, bool]]) -> None:
    if not ratios:
        return
    for label, sel in (("fitted on", [r for r in ratios if r[2]]), ("held out", [r for r in ratios if not r[2]]),
                       ("all comparable", ratios)):
        if sel:
            worst = max(sel, key=lambda x: abs(math.log(x[1])))
            print(f"\n{label}: {len(sel)} rows, RMS error {rms([r for _, r, _ in sel]):.1%}, "
                  f"worst {worst[1]:.2f} ({worst[0]}), within +-15%: {sum(abs(r - 1) <= 0.15 for _, r, _ in sel)}")


def comparable_cases() -> list:
    """(case, plan of its published layout) of every row our estimate is compared on."""
    return [(case, p) for case in PUBLISHED if case.comparable
            for p in [estimate(case)] if published_tokens_per_gpu(case, p)]


def ratios(cal, cases) -> list[tuple[str, float, bool]]:
    """(name, est/pub, fitted on) of each case with the step-time constants ``cal``."""
    compute.CALIBRATION = cal
    out = []
    for case, p in cases:
        t = estimate_time(p.spec, p.shape, p.layout, p.batch, p.gpu)
        pub = case.tokens_per_gpu or case.tflops_per_gpu / (t.model_flops / p.batch.tokens)
        out.append((case.name, t.tokens_per_s / p.layout.world / pub, case.fit))
    return out


# A constant the fitted rows leave undetermined (no row depends on it) takes its counterpart's
# fitted value: a large GEMM's fraction of the peak, carried from one GPU generation to the other.
COUNTERPART = {"gemm_efficiency": "ampere_gemm_efficiency", "ampere_gemm_efficiency": "gemm_efficiency"}


def fitted(cases, start):
    """Coordinate descent over GRID on the RMS of log(est/pub) of the cases marked fit; also the
    constants no fitted row depends on (each then follows COUNTERPART, or keeps ``start``'s value)."""
    fit_cases = [(c, p) for c, p in cases if c.fit]  # (the loss reads these alone: the others are not estimated)

    def loss(cal) -> float:
        logs = [math.log(r) for _, r, _ in ratios(cal, fit_cases)]
        return math.sqrt(sum(x * x for x in logs) / len(logs))

    flat = {name for name, values in GRID.items()
            if len({round(loss(replace(start, **{name: v})), 12) for v in values[::max(1, len(values) // 6)]}) == 1}
    best = start
    for _ in range(4):
        for name, values in GRID.items():
            if name not in flat:
                best = min((replace(best, **{name: v}) for v in values), key=loss)
    best = replace(best, **{n: getattr(best, COUNTERPART[n]) for n in flat if COUNTERPART.get(n) not in (None, *flat)})
    return best, loss(best), sorted(flat)


def fit() -> None:
    cases = comparable_cases()
    best, err, _ = fitted(cases, compute.CALIBRATION)
    print(f"fitted: {best} (RMS {err:.2%} on {sum(c.fit for c, _ in cases)} rows)")
    for name, ratio, was_fitted in ratios(best, cases):
        print(f"  {'fit ' if was_fitted else 'held'} {ratio:.3f}  {name}")


def undetermined(flat: list[str]) -> str:
    """How each undetermined constant was set: its counterpart's fit, or the code's value (which
    was fitted with every origin, the one held out included: that part of the check is not blind)."""
    return ", ".join(f"{n} = {COUNTERPART[n]}" if COUNTERPART.get(n) not in (None, *flat) else f"{n} (the code's value)"
                     for n in flat) or "-"


def by_origin(only: str = "") -> None:
    """Leave one origin out: fit the constants on the fit rows of every other origin (from the
    constants in the code), then estimate every comparable row of the one left out. Rows of one
    origin share hardware, software and authors: a row held out beside its fitted siblings says
    less about a run the model has not seen than an origin held out whole. ``only``: the origins
    whose name contains it."""
    cases, start = comparable_cases(), compute.CALIBRATION
    origins = [o for o in dict.fromkeys(c.origin for c, _ in cases) if only in o]  # in the data file's order
    print("| origin held out | rows | of them fit rows | RMS est/pub | worst est/pub | within +-15% | fitted on | "
          "constants the other origins leave undetermined |")
    print("|---|---|---|---|---|---|---|---|")
    for origin in origins:
        rest = [(replace(c, fit=c.fit and c.origin != origin), p) for c, p in cases]
        fit_rows = sum(c.fit for c, _ in rest)
        cal, _, flat = fitted(rest, start)
        held = [r for (c, _), r in zip(cases, ratios(cal, cases)) if c.origin == origin]
        worst = max(held, key=lambda x: abs(math.log(x[1])))
        print(f"| {origin} | {len(held)} | {sum(f for _, _, f in held)} | {rms([r for _, r, _ in held]):.1%} | "
              f"{worst[1]:.3f} ({worst[0]}) | {sum(abs(r - 1) <= 0.15 for _, r, _ in held)} of {len(held)} | "
              f"{fit_rows} rows of the other origins | {undetermined(flat)} |")
    compute.CALIBRATION = start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="only cases whose name contains this (with --by-origin: origins)")
    ap.add_argument("--no-search", action="store_true", help="estimates only, no search for a pick")
    ap.add_argument("--fit", action="store_true", help="fit the step-time constants and print them")
    ap.add_argument("--by-origin", action="store_true",
                    help="leave each origin out: fit on the others' rows, estimate its rows")
    args = ap.parse_args()
    if args.fit:
        fit()
    elif args.by_origin:
        by_origin(args.only)
    else:
        table(args.only, not args.no_search)


if __name__ == "__main__":
    main()
