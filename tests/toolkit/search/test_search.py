"""toolkit plan --auto: the search agrees with the validator and make_plan, ranks as the cost
model says, keeps tensor parallelism inside a node when it can."""
import itertools
import math
import os
import signal
import time

import pytest

from toolkit import hardware
from toolkit.backends.megatron import padded_vocab
from toolkit.estimate.comm import LATENCY_S, NCCL_EFFICIENCY
from toolkit.estimate.compute import CALIBRATION
from toolkit.hardware import GPU
from toolkit.models import load_model
from toolkit.parallel.layout import derive_batch, derive_layout
from toolkit.plan import make_plan
from toolkit.plan.rules import RULES, Context
from toolkit.search.choices import CPComm, Split, skipped, split_choices
from toolkit.search.partial import build_spec, spec_overrides
from toolkit.search.search import AUTO_HEADROOM, domains, search
from toolkit.search import walk
from toolkit.search.walk import GRID_AXES, INNER_AXES
from toolkit.spec import TrainingSpec, Zero

from tests.conftest import spec_dict

TINY_GPU = GPU("tiny-test", 8 / 1024, 1.0, 1.0, 10.0, 1.0, 20.0)  # 8 MiB: some tiny-model layouts fit, some do not
SMALLER_GPU = GPU("tiny-test-2", 2 / 1024, 1.0, 1.0, 10.0, 1.0, 20.0)  # 2 MiB, for 64-token sequences


def _spec(**over) -> TrainingSpec:
    return TrainingSpec.from_dict(spec_dict(**over))


def _axes(shape) -> dict:
    """Some values of the pipeline and cp axes (the whole product would take minutes here): the
    even split, both accountings, one uneven split; vpp 1-4; p2p and a2a."""
    splits = [s for s in split_choices(shape.num_layers) if str(s) in ("even", "embedding+loss", "1/1 fewer")]
    return {"split": tuple(splits), "vpp": (1, 2, 3, 4), "cpc": (CPComm(), CPComm("a2a"))}


def _brute_force(spec: TrainingSpec) -> tuple[int, list[tuple[float, float]]]:
    """(layouts every rule accepts, [(step time, memory) of those make_plan says fit]) by
    running the spine's RULES on every full layout of the search's domains."""
    shape = load_model(spec.model)
    gpu = hardware.get_gpu(spec.cluster.gpu)
    dom = {**domains(spec, shape), **_axes(shape)}
    valid, fitting = 0, []
    grids = (dict(zip(GRID_AXES, g)) for g in itertools.product(*(dom[a] for a in GRID_AXES)))
    for grid in grids:
        if skipped("split", grid):  # the search's own choice (choices.py)
            continue
        for inner in itertools.product(*(dom[a] for a in INNER_AXES)):
            values = {**grid, **dict(zip(INNER_AXES, inner))}
            if not skipped("cpc", values):
                valid, fitting = _check(spec, shape, gpu, values, valid, fitting)
    return valid, sorted(fitting)


def _check(spec, shape, gpu, values, valid, fitting):
    """Every rule on one full layout, then make_plan if they all pass."""
    s = build_spec(spec, values)
    lay = derive_layout(s, shape)
    ctx = Context(s, shape, lay, derive_batch(s, lay), gpu)
    if any(f.level == "error" for rule in RULES for f in rule(ctx)):
        return valid, fitting
    plan = make_plan(spec.with_overrides(spec_overrides(values)), shape)
    fits = plan.memory.fits(spec.estimate.headroom)
    assert plan.valid == fits  # make_plan's only other error is "does not fit"
    if fits:
        fitting.append((plan.time.step_time_s, plan.memory.worst.total))
    return valid + 1, fitting


@pytest.mark.parametrize("over", [
    {"model": "llama-tiny", "cluster.gpus_per_node": 4, "batch.global": 8, "batch.seq_len": 256},
    {"model": "llama-tiny", "cluster.gpus_per_node": 6, "batch.global": 12, "batch.seq_len": 256},  # pp=3: uneven
    {"model": "mixtral-tiny", "cluster.gpus_per_node": 2, "batch.global": 4, "batch.seq_len": 128,
     "zero.nvme_path": "/nvme"},
    # Megatron-LM with a bf16 gradient buffer: the fp32 gradient copies exist only at the optimizer
    # step, so a stage's peak is the larger phase; short sequences make the step's the larger in some
    {"model": "llama-tiny", "cluster.gpus_per_node": 4, "batch.global": 8, "batch.seq_len": 64,
     "target": "megatron-lm", "optimizer.grad_reduce_dtype": "bf16", "cluster.gpu": SMALLER_GPU.name},
    # the local layer spec: its causal mask (s x s bytes) is held at cp = 1 only
    {"model": "llama-tiny", "cluster.gpus_per_node": 4, "batch.global": 8, "batch.seq_len": 256,
     "attention.backend": "unfused"},
    # DeepSpeed bucket sizes from the spec (the search's buckets and buffers are make_plan's)
    {"model": "llama-tiny", "cluster.gpus_per_node": 4, "batch.global": 8, "batch.seq_len": 256,
     "deepspeed": {"zero_optimization": {"reduce_bucket_size": 3000, "allgather_bucket_size": 3000,
                                         "stage3_prefetch_bucket_size": 2000, "stage3_max_reuse_distance": 0}}},
    # LoRA: the frozen base's weights and the adapters' states (memory.trained_states); the search once
    # counted full training's, a few MB off, and make_plan dropped every layout it proposed
    {"model": "llama-tiny", "cluster.gpus_per_node": 4, "batch.global": 8, "batch.seq_len": 256,
     "finetune.method": "lora", "attention.backend": "unfused"},
    # target hf: transformers' modules (fused experts), with LoRA through peft
    {"model": "mixtral-tiny", "cluster.gpus_per_node": 4, "batch.global": 8, "batch.seq_len": 256, "target": "hf",
     "recompute": "full", "finetune.method": "lora"},
])
def test_search_agrees_with_the_validator_and_make_plan(monkeypatch, over):
    """Every layout of the space checked directly: same valid count, same fitting layouts
    (step times and memory), and the top of the ranking is theirs."""
    for gpu in (TINY_GPU, SMALLER_GPU):
        monkeypatch.setitem(hardware.GPUS, gpu.name, gpu)
    spec = _spec(**{"cluster.gpu": TINY_GPU.name, "estimate.buffer_gib": 0, "estimate.headroom": 0.0, **over})
    valid, fitting = _brute_force(spec)
    result = search(spec, top=5, axes=_axes(load_model(spec.model)))
    assert 0 < len(fitting) < valid < result.space  # rules and memory both reject something here
    assert (result.valid, result.fitting) == (valid, len(fitting))
    assert result.rejected == sum(f.layouts for f in result.families if f.kind in ("error", "skipped"))
    assert result.valid - result.fitting == sum(f.layouts for f in result.families if f.kind == "memory")
    assert result.fitting_times == pytest.approx([t for t, _ in fitting], rel=1e-9)
    assert not result.mismatches
    best = [c.plan for c in result.candidates]
    assert best[0].time.step_time_s == pytest.approx(fitting[0][0], rel=1e-9)
    assert [p.time.step_time_s for p in best] == sorted(p.time.step_time_s for p in best)
    if over.get("target") == "megatron-lm":  # both phases decide the peaks of listed layouts here
        wide = search(spec, top=1000, axes=_axes(load_model(spec.model)))  # each listed one rebuilt by make_plan
        assert not wide.mismatches
        assert {c.plan.memory.worst.step_only > c.plan.memory.worst.activations for c in wide.candidates} == {True, False}


def test_candidates_are_plans_the_validator_accepts():
    spec = _spec(**{"model": "qwen3-moe-tiny", "cluster.gpus_per_node": 8, "batch.global": 32,
                    "batch.seq_len": 256})
    result = search(spec, top=25)
    assert len(result.candidates) == 25 and not result.mismatches
    for c in result.candidates:
        again = make_plan(TrainingSpec.from_dict(c.plan.spec.to_dict()))  # from the JSON-able spec alone
        assert again.valid and again.memory.fits(AUTO_HEADROOM)
        assert again.time.step_time_s == c.plan.time.step_time_s
        assert again.as_dict() == c.plan.as_dict()
    plans = [c.plan for c in result.candidates]
    for i, a in enumerate(plans):  # a listed layout is never a same-grid variant of a faster one made worse
        for b in plans[i + 1:]:
            if a.layout == b.layout:
                assert b.memory.worst.total < a.memory.worst.total
    assert sum(c.hidden for c in result.candidates) > 0


def _hand_step_time(tp: int) -> float:
    """Llama-3-8B, 8 H100 in one node, seq 4096, global 64, micro 1, pp=cp=1, sequence parallel,
    ZeRO-1, no recompute, flash attention, from the step-time model's stated formulas (compute.py,
    comm.py, stage_time.py, data_time.py docstrings), its constants and the HF config."""
    h, L, a, g, d, f, V = 4096, 32, 32, 8, 128, 14336, 128256
    t, w, peak, hbm, nvlink = 4096, 2, 989e12, 3350e9, 450e9 * NCCL_EFFICIENCY
    cal = CALIBRATION
    dp = 8 // tp
    m = 64 // dp
    vocab = padded_vocab(V, tp)
    fx = lambda x, x0: x / (x + x0)  # noqa: E731
    gemm = lambda M, N, K: 2 * M * N * K / (peak * cal.gemm_efficiency * fx(M, cal.tile) * fx(N, cal.tile)  # noqa: E731
                                            * fx(K, cal.tile))
    qkv, proj = gemm(t, (a + 2 * g) * d / tp, h), gemm(t, h, a * d / tp)
    fc1, fc2 = gemm(t, 2 * f / tp, h), gemm(t, h, f / tp)
    attn = 2 * (d + d) * a / tp * t * t / 2 / (peak * cal.attention_efficiency * fx(t, cal.attention_chunk)
                                                 * fx(d, cal.tile))
    mem = (10 * h / tp + 2 * (a + g) * d / tp + 3 * f / tp) * t * w / hbm
    c = LATENCY_S + (tp - 1) / tp * t * h * w / nvlink  # one all-gather / reduce-scatter of the activations
    tp_f = 2 * (2 * c)  # attention and MLP blocks: all-gather + reduce-scatter each, forward
    tp_b = (c + 2 * max(0.0, c - qkv)) + (c + 2 * max(0.0, c - fc1))
    layer = 3 * (qkv + proj + fc1 + fc2) + 3.5 * attn + 3 * mem + tp_f + tp_b
    head = gemm(t, vocab / tp, h)
    loss = (32 + w + 4) + (8 + w + 4)  # megatron-core's unfused cross entropy: 38 + 14 bytes per bf16 logit
    edge = 3 * head + (3 * t * h * w + t * vocab / tp * loss) / hbm + c + c + max(0.0, c - head)
    stage = L * layer + edge
    per_layer = h * (a * d + 2 * g * d) + a * d * h + 3 * h * f  # qkv, proj, fc1 (gate+up), fc2
    params = L * (per_layer / tp + 2 * h) + 2 * vocab * h / tp + h  # one GPU's weights before ZeRO
    # the recipes target's bf16 ZeRO-1 is DeepSpeed's BF16_Optimizer: the gradients all-reduced in
    # bf16 (its communication dtype) after the backward in 5e8-element buffers, the updated shards
    # gathered in the step in h^2-element buckets; each NCCL call's latency by NCCL's model in one node:
    # 8.4 us and 3.4 us a ring step (the all-reduce's ring: 2 (dp - 1) steps, under its tree's here)
    ar = math.ceil(params / 5e8) * (8.4 + 2 * (dp - 1) * 3.4) * 1e-6 + 2 * (dp - 1) / dp * 2 * params / nvlink
    ag = math.ceil(params / h**2) * (8.4 + (dp - 1) * 3.4) * 1e-6 + (dp - 1) / dp * 2 * params / nvlink
    dp_s = ar + ag
    optimizer = params / dp * 30 / hbm
    return m * stage + dp_s + optimizer


def test_two_layouts_rank_as_computed_by_hand():
    spec = _spec(**{"batch.global": 64, "batch.seq_len": 4096})
    axes = {"tp": (4, 2), "sp": (True,), "pp": (1,), "split": (Split(),), "vpp": (1,), "cp": (1,),
            "cpc": (CPComm(),), "zero": (Zero(stage=1),), "micro": (1,), "recompute": ("none",)}
    result = search(spec, top=5, axes=axes)
    assert result.space == 2 and result.fitting == 2
    by_hand = {tp: _hand_step_time(tp) for tp in (2, 4)}
    assert by_hand[2] < by_hand[4]  # tp=4: smaller GEMMs and 3/2 x the bytes per all-gather, twice the micro-batches
    assert [c.plan.layout.tp for c in result.candidates] == [2, 4]
    for c in result.candidates:
        assert c.plan.time.step_time_s == pytest.approx(by_hand[c.plan.layout.tp], rel=1e-9)
        assert c.plan.time.tokens_per_s == pytest.approx(64 * 4096 / by_hand[c.plan.layout.tp], rel=1e-9)


@pytest.mark.parametrize("nodes, per_node", [(2, 8), (8, 2)])
def test_no_pick_puts_tp_across_nodes_when_a_within_node_tp_fits(nodes, per_node):
    """Llama-2-7B has 32 KV heads, so tp=16 is valid (with a warning) and fits on 16 GPUs."""
    spec = _spec(**{"model": "llama2-7b", "cluster.nodes": nodes, "cluster.gpus_per_node": per_node,
                    "batch.global": 64, "batch.seq_len": 4096})
    across = make_plan(spec.with_overrides({"parallel.tp": 16, "parallel.pp": 1, "zero.stage": 1}))
    assert across.valid and across.memory.fits(AUTO_HEADROOM) and any("crosses" in w for w in across.warnings)
    result = search(spec, top=20)
    assert any(f.rule == "tp_within_node" and f.kind == "warning" for f in result.families)
    assert len(result.candidates) == 20
    assert all(c.plan.layout.tp <= per_node for c in result.candidates)
    assert result.faster_than(across.time.step_time_s) >= 20


def test_headroom_defaults_to_a_margin_unless_the_spec_sets_one():
    spec = _spec(**{"batch.global": 64})
    assert search(spec, top=1).headroom == AUTO_HEADROOM
    assert search(spec.with_overrides({"estimate.headroom": 0.0}), top=1).headroom == 0.0
    r = search(spec, top=3, headroom=0.2)
    assert all(c.plan.memory.worst.total <= 0.8 * c.plan.gpu.memory_gib * 1024**3 for c in r.candidates)
    assert all(c.plan.spec.estimate.headroom == 0.2 and c.plan.as_dict()["fits"] for c in r.candidates)


def test_progress_is_reported_per_pipeline_parallel_size():
    calls = []
    search(_spec(**{"batch.global": 64}), top=1, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 4) for i in range(1, 5)]  # pp in 1, 2, 4, 8 (the first axis the walk chooses)


def test_forked_workers_give_the_one_process_result():
    """workers > 1 walk the pipeline-parallel sizes in forked processes: the same families (rule
    attribution included), fitting layouts in the same order and the same candidates."""
    spec = _spec(**{"model": "llama3.1-70b", "cluster.nodes": 8, "batch.global": 256, "batch.seq_len": 8192})
    calls = []
    one, two = search(spec, top=8, workers=1), search(spec, top=8, workers=2,
                                                       progress=lambda done, total: calls.append((done, total)))
    assert one.fitting > 100 and one.families == two.families and one.fitting_times == two.fitting_times
    assert (one.space, one.valid, one.fitting) == (two.space, two.valid, two.fitting)
    assert [c.plan.as_dict() for c in one.candidates] == [c.plan.as_dict() for c in two.candidates]
    assert [c.hidden for c in one.candidates] == [c.hidden for c in two.candidates]
    assert [done for done, _ in calls] == list(range(1, 8)) and {total for _, total in calls} == {7}


def _same_result(a, b) -> None:
    assert (a.space, a.valid, a.fitting, a.families) == (b.space, b.valid, b.fitting, b.families)
    assert [c.as_dict() for c in a.candidates] == [c.as_dict() for c in b.candidates]  # hidden counts included


@pytest.mark.parametrize("top, workers", [(1, 1), (3, 1), (3, 2)])
def test_pruned_search_is_the_full_one(top, workers):
    """The search leaves untimed the layouts whose step-time floor (time.step_floor: the stages'
    compute alone) is above the listed ones: the same candidates, hidden counts, families and
    counts as timing every fitting layout; the floor is below every untimed layout's step time;
    faster_than and fitting_times time what they need and give the full search's answers."""
    spec = _spec(**{"model": "llama3.1-70b", "cluster.nodes": 8, "batch.global": 256, "batch.seq_len": 8192})
    full = search(spec, top=top, workers=workers, prune=False)
    pruned = search(spec, top=top, workers=workers)
    _same_result(pruned, full)
    walk = pruned.times.walk
    untimed = list(pruned.times.untimed)
    assert len(untimed) > pruned.fitting / 2  # most fitting layouts were not timed here
    assert not full.times.untimed
    for floor, k in untimed:
        step, mem, gid, inner = walk.leaves[k]
        assert step == math.inf and floor <= walk.leaf_step(gid, inner)
    times = full.fitting_times
    for t in (times[0], times[10], times[len(times) // 2], times[-1] * 2):
        assert pruned.faster_than(t) == full.faster_than(t)
    assert pruned.fitting_times == times


FP8_8B = {"model": "llama3.1-8b", "target": "megatron-lm", "cluster.gpu": "h100-80gb", "cluster.gpus_per_node": 8,
          "batch.global": 64, "batch.seq_len": 4096}


@pytest.mark.parametrize("over", [
    {"model": "mixtral-tiny"}, {"model": "gemma3-tiny"}, {"model": "qwen3-next-tiny"},  # MoE, windows, delta rule
    {**FP8_8B, "fp8.format": "e4m3"},
    {**FP8_8B, "fp8.format": "hybrid", "fp8.recipe": "tensorwise", "fp8.bf16_layers": 1},  # layer_floor 0
])
def test_floors_hold_for_every_layer_kind(monkeypatch, over):
    """time.layer_floor takes the least layer kind, and FP8's: the pruned search is the full one and
    every untimed layout's floor is below its step time, for MoE, sliding-window and gated
    delta-net layers and FP8 (with and without 16-bit end layers)."""
    monkeypatch.setitem(hardware.GPUS, TINY_GPU.name, TINY_GPU)
    spec = _spec(**{"cluster.gpu": TINY_GPU.name, "cluster.gpus_per_node": 4, "estimate.buffer_gib": 0,
                    "batch.global": 8, "batch.seq_len": 256, **over})
    full, pruned = search(spec, top=1, prune=False), search(spec, top=1)
    _same_result(pruned, full)
    w = pruned.times.walk
    assert len(pruned.times.untimed) > pruned.fitting / 4
    assert all(floor <= w.leaf_step(*w.leaves[k][2:]) for floor, k in pruned.times.untimed)
    assert pruned.fitting_times == full.fitting_times


def test_a_floor_above_a_step_time_would_change_the_ranking(monkeypatch):
    """The checks above have teeth: with a floor 1.5x the stages' compute for recompute none (above
    those layouts' step times), the pruned search lists other layouts than the full one, and some
    untimed layout's floor is above its step time. (A floor too high everywhere times nothing at
    first: _rank then times every layout.)"""
    spec = _spec(**{"model": "llama3.1-70b", "cluster.nodes": 8, "batch.global": 256, "batch.seq_len": 8192})
    full = search(spec, top=3, workers=1, prune=False)
    real = walk.step_floor
    monkeypatch.setattr(walk, "step_floor", lambda works, r, m: real(works, r, m) * (1.5 if r == "none" else 1))
    wrong = search(spec, top=3, workers=1)
    assert [c.as_dict() for c in wrong.candidates] != [c.as_dict() for c in full.candidates]
    w = wrong.times.walk
    assert any(floor > w.leaf_step(*w.leaves[k][2:]) for floor, k in wrong.times.untimed)


def test_a_worker_stopped_before_its_initializer_runs_ends():
    """The pool's terminate() right after a Ctrl-C can reach a forked worker before the pool's
    initializer has run, while the worker still has the parent's recording handler: it must end
    (SIGTERM) or ignore (SIGINT) as an initialised worker would, not record and keep waiting,
    which left a worker the pool joined forever (`toolkit plan --auto` hung after a Ctrl-C)."""
    with walk._signals_deferred() as received:
        pid = os.fork()
        if pid == 0:  # the window before the initializer: a worker still starting up
            os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C, to the whole group
            time.sleep(5)  # the SIGTERM below ends this sleep, or the worker lives it out
            os._exit(0)
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
    assert received == []  # the child's signals are not the parent's


def test_unknown_axis_is_an_error():
    with pytest.raises(ValueError, match="unknown axes"):
        search(_spec(), axes={"tpp": (1,)})


def test_families_explain_each_rejection_by_rule():
    spec = _spec(**{"model": "llama2-7b", "cluster.nodes": 6, "cluster.gpus_per_node": 4, "batch.global": 48})
    result = search(spec, top=1)
    messages = {(f.kind, f.rule, f.message) for f in result.families}
    assert ("error", "heads_divisible", "tp=3 does not divide num_attention_heads=32") in messages
    assert any(k == "warning" and r == "tp_within_node" and m.startswith("tp=8 is larger than a node")
               for k, r, m in messages)
    assert math.fsum(f.layouts for f in result.families if f.kind in ("error", "skipped")) == result.rejected
    assert any(f.kind == "skipped" and f.message.startswith("cp=1:") for f in result.families)
