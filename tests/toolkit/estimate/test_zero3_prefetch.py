"""What the planner's DeepSpeed ZeRO-3 path assumes of DeepSpeed (toolkit.estimate.data_time, the
``overlapped`` path): once the first step has recorded the sub-module trace, every fetch finds its
parameters prefetched (or kept for reuse), none is gathered on demand, also under transformers'
gradient checkpointing, whose recomputed forward runs inside the backward. Run on 2 CPU ranks in
ONE launch (tests/support/zero3_prefetch.py: DeepSpeed's own coordinator, its fetches counted by the
state they find the parameters in). docs/planner.md, "DeepSpeed's own ZeRO-3 runs", uses it to rule
out a stale trace as the reason the DeepCompile benchmarks' ZeRO-3 runs hide less than the planner. The
same launch records DeepSpeed's all-gather calls and gradient buckets, which data_time.tensor_calls counts
("DeepSpeed's calls over whole tensors")."""
import itertools
import json

from toolkit.estimate.data_time import deepspeed_tail, first_bucket, tensor_calls

from tests.recipes.test_recipes import launch, tail


def _groups(sizes: list[int], size: int, flush: bool) -> list[list[int]]:
    """Tensors in order into buckets: closed once they hold ``size`` (ZeRO-3's prefetch) or, ``flush``,
    sent before the tensor that would overflow them (the gradient buckets)."""
    out, held = [], []
    for n in sizes:
        if flush and held and sum(held) + n > size:
            out, held = out + [held], []
        held = held + [n]
        if not flush and sum(held) >= size:
            out, held = out + [held], []
    return out + ([held] if held else [])


def _runs(sizes: list[int]) -> tuple:
    """StageParams.tensors of one layer holding these dense tensors in this order."""
    runs = tuple((n, len(list(g))) for n, g in itertools.groupby(sizes))
    return (((runs, ()), 1),)


def test_zero3_prefetches_every_fetch_after_the_first_step_with_and_without_checkpointing():
    r = launch("-m tests.support.zero3_prefetch", launcher="torchrun", timeout=600)
    assert r.returncode == 0, tail(r)
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    models = {x["mode"]: x for x in lines if "tensors" in x}
    rows = [x for x in lines if "step" in x]
    assert {(x["mode"], x["step"]) for x in rows} == {(m, s) for m in ("none", "reentrant", "non-reentrant")
                                                      for s in range(4)}
    for x in rows:
        # DeepSpeed's collectives, counted as the planner counts them (data_time.tensor_calls): the forward's
        # all-gathers are its partitioned parameters in order, in buckets that close at the prefetch size;
        # the gradient buckets are sent before the tensor that would overflow the reduce size
        groups, reduced, model = x.pop("groups"), x.pop("reduced"), models[x["mode"]]
        forward = _groups(model["tensors"], model["prefetch"], flush=False)
        if x["step"] > 0:
            assert groups[:len(forward)] == forward, (x["mode"], groups)
        assert len(forward) == tensor_calls(_runs(model["tensors"]), False, model["prefetch"]) == 26
        sent = [n for g in reduced for n in g]
        assert reduced == _groups(sent, model["reduce"], flush=True), (x["mode"], reduced)
        assert len(reduced) == tensor_calls(_runs(sent), False, model["reduce"], flush=True)
        # the buckets the estimate leaves exposed (data_time.Buckets.edges): the forward's first gather, and
        # the last gradient bucket, the gradients taken in the backward's order (the model's tensors reversed)
        assert first_bucket(_runs(model["tensors"]), False, model["prefetch"]) == sum(forward[0])
        assert deepspeed_tail(_runs(model["tensors"]), False, model["reduce"]) == sum(reduced[-1]), reduced
        fetched = {k: v for k, v in x.items() if k not in ("mode", "step") and not k.endswith("gathers")}
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
