"""Published layouts vs the planner: our estimate of each published layout and our top pick
for the same model, GPUs and batch (``toolkit plan --auto``), as a markdown table.

    PYTHONPATH=. python benchmarks/plan_compare_published.py [--only SUBSTRING]

Where our pick differs, the last column says which estimated costs (seconds per step, by
cause) or memory make the difference. The published throughput each row uses, and its
source, are listed under the table.
"""
from __future__ import annotations

import argparse
import time

from toolkit.cli.tables import plan_label
from toolkit.plan.published import PUBLISHED, Comparison, compare

GiB = 1024**3


def layout(plan) -> str:
    return plan_label(plan)


def cells(plan) -> list[str]:
    if not plan.valid:
        return ["invalid", "-", "-", "-"]
    t = plan.time
    return [f"{plan.memory.worst.total / GiB:.1f}" + ("" if plan.memory.fits() else " (does not fit)"),
            f"{t.tokens_per_s / plan.layout.world:,.0f}", f"{t.mfu:.1%}", t.dominant]


def rows(c: Comparison) -> list[str]:
    pub = c.case.tokens_per_gpu
    ratio = "" if c.ratio is None else f" (est/pub {c.ratio:.2f}{'' if c.case.comparable else ', not comparable'})"
    out = [f"| {c.case.name} | published: {layout(c.plan)} | " + " | ".join(cells(c.plan))
           + f" | {'-' if pub is None else f'{pub:,.0f}{ratio}'} | |"]
    if c.pick is not None:
        out.append(f"| | our pick: {layout(c.pick)} | " + " | ".join(cells(c.pick))
                   + f" | | {c.why} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    print("| case | layout | GiB/GPU | est. tokens/s/GPU | est. MFU | dominant | published tokens/s/GPU | "
          "why the pick differs |")
    print("|---|---|---|---|---|---|---|---|")
    sources = []
    for case in PUBLISHED:
        if args.only not in case.name:
            continue
        t0 = time.perf_counter()
        c = compare(case)
        print("\n".join(rows(c)), flush=True)
        sources.append(f"- {case.name}: {case.source}" + (f". Note: {case.note}" if case.note else "")
                       + f" [search {time.perf_counter() - t0:.1f} s, {c.search.space:,} layouts]")
    print("\nSources and notes:\n" + "\n".join(sources))


if __name__ == "__main__":
    main()
