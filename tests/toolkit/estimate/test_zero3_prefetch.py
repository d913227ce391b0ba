"""What the planner's DeepSpeed ZeRO-3 path assumes of DeepSpeed (toolkit.estimate.data_time, the
``overlapped`` path): once the first step has recorded the sub-module trace, every fetch finds its
parameters prefetched (or kept for reuse), none is gathered on demand, also under transformers'
gradient checkpointing, whose recomputed forward runs inside the backward. Run on 2 CPU ranks in
ONE launch (tests/support/zero3_prefetch.py: DeepSpeed's own coordinator, its fetches counted by the
state they find the parameters in). docs/planner.md, "DeepSpeed's own ZeRO-3 runs", uses it to rule
out a stale trace as the reason the DeepCompile benchmarks' ZeRO-3 runs hide less than the planner."""
import json

from tests.recipes.test_recipes import launch, tail


def test_zero3_prefetches_every_fetch_after_the_first_step_with_and_without_checkpointing():
    r = launch("-m tests.support.zero3_prefetch", launcher="torchrun", timeout=600)
    assert r.returncode == 0, tail(r)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert {(x["mode"], x["step"]) for x in rows} == {(m, s) for m in ("none", "reentrant", "non-reentrant")
                                                      for s in range(4)}
    for x in rows:
        fetched = {k: v for k, v in x.items() if k not in ("mode", "step")}
        if x["step"] == 0:  # recording the trace: everything gathered on demand
            assert fetched.get("forward NOT_AVAILABLE", 0) >= 30, x
            continue
        assert not any("NOT_AVAILABLE" in k for k in fetched) and "invalidated" not in fetched, x
        assert fetched["forward INFLIGHT"] > 0 and fetched["backward INFLIGHT"] > 0, x
        # 30 gathered parameters a pass (4 layers x 7 Linear weights, the embedding, the output layer); the
        # checkpointed layers' 28 again in the recomputed forward
        forward = fetched["forward INFLIGHT"] + fetched.get("forward AVAILABLE", 0)
        assert forward == (30 if x["mode"] == "none" else 58), x
        assert fetched["backward INFLIGHT"] + fetched.get("backward AVAILABLE", 0) == 30, x
