"""Search time of ``toolkit plan --auto`` for Llama-3.1-405B on 1024 H100 (target < 2 s on a
2-core machine) and the number of layouts considered.

    PYTHONPATH=. python benchmarks/plan_search_bench.py [--repeat N]

"cold" is the first search in a fresh process: it includes importing the planner and the
model registry (no torch, transformers or deepspeed: tests/toolkit/cli/test_startup_imports.py), which
every `toolkit plan` pays once; "warm" is the median of the searches after it, the search
itself. benchmarks/startup_bench.py times the whole `toolkit plan --auto` process.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

SPEC = {"model": "llama3.1-405b", "cluster": {"nodes": 128, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "batch": {"global": 2048, "seq_len": 8192}}  # 16M tokens per step, Llama 3's final batch


def _cpu() -> float:
    """CPU seconds of this process and of its finished child processes (the forked workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", type=int, default=None,
                    help="processes walking the layouts (default: search's own choice, one per CPU)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    from toolkit.search.search import search
    from toolkit.spec import TrainingSpec

    spec = TrainingSpec.from_dict(SPEC)
    result = search(spec, workers=args.workers)
    cold = time.perf_counter() - t0
    warm, cpu = [], []
    for _ in range(args.repeat):
        t, c = time.perf_counter(), _cpu()
        search(spec, workers=args.workers)
        warm.append(time.perf_counter() - t)
        cpu.append(_cpu() - c)
    best = result.candidates[0].plan
    lay = best.layout
    print(f"Llama-3.1-405B on 1024 x H100, global batch 2048 x 8192 tokens, headroom {result.headroom:.0%}")
    print(f"layouts considered: {result.space:,} (rejected by the rules {result.rejected - result.skipped:,}, not "
          f"tried {result.skipped:,}, valid {result.valid:,}, fitting {result.fitting:,}; memory and time estimated "
          f"for the {result.valid:,} valid)")
    print(f"search time: warm median {statistics.median(warm):.2f} s over {args.repeat} "
          f"(min {min(warm):.2f}, max {max(warm):.2f}; CPU of this process and its workers, median "
          f"{statistics.median(cpu):.2f} s; workers {args.workers or 'auto'} on {os.cpu_count()} CPUs); cold, imports "
          f"included: {cold:.2f} s; target < 2 s; load average {os.getloadavg()[0]:.1f}")
    print(f"best: tp={lay.tp} pp={lay.pp} vpp={lay.vpp} cp={lay.cp} dp={lay.dp} ZeRO-{best.spec.zero.stage} "
          f"micro {best.batch.micro} recompute {best.spec.recompute}: {best.memory.worst.total / 1024**3:.1f} GiB, "
          f"{best.time.step_time_s:.2f} s/step, {best.time.tokens_per_s / lay.world:,.0f} tokens/s/GPU, "
          f"MFU {best.time.mfu:.1%}, dominant {best.time.dominant}")


if __name__ == "__main__":
    main()
