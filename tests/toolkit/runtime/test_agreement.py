"""The planner and the runtime agree (issue 12): what `toolkit plan --auto` may propose for the
recipes, the runtime runs; what it cannot run is a rule.

For the tiny models on 4 CPU ranks, the whole search space (every value of every axis the
search walks: tp, sequence parallel, pp, vpp, cp, ep, etp, ZeRO stage x offloads, recompute;
cp_comm for cp > 1) is judged by the plan's rules:
  - every valid layout passes the runtime's start-up checks (`unsupported`), and
  - valid parallel grids of the dense and the Mixtral model RUN: one 4-rank launch
    (tests/support/runtime_worker.py) sets each up and takes its first step, the ZeRO / offload /
    recompute choices dealt over the grids so that each valid value runs at least once; the
    first step's loss and gradient norm equal the data-parallel run's (same weights, same
    samples). In CI the grids run are a cover: every value of every axis (tp, sequence
    parallel, pp, vpp, cp, cp_comm, ep, etp) in at least one grid; for the dense model every
    ZeRO / offload choice and selective and full recompute at ZeRO-1 and ZeRO-3, for Mixtral
    each ZeRO stage without offload; with
    TOOLKIT_FULL_AGREEMENT=1 every valid grid runs with every choice dealt (105 first steps,
    about 12 minutes on 2 cores: too long for CI's 20-minute budget).
  - in bf16, where DeepSpeed computes the gradient norm in other code for each optimizer (bf16
    ZeRO-1 without offload: its BF16_Optimizer; else its ZeRO optimizer), Mixtral's experts
    split each way (etp = tp, etp = 1 with tp and pp, etp on ranks other than tp's) on each of
    the two: every rank clips with one norm, the bf16 data-parallel run's within bf16 round-off.
"""
import itertools
import json
import os

import pytest

from toolkit.models import load_model
from toolkit.plan import make_plan
from toolkit.search.partial import zero_choices
from toolkit.search.search import domains
from toolkit.runtime.trainer import unsupported

from tests.conftest import SUPPORT
from tests.support.runtime_worker import recipe_spec
from tests.recipes.test_recipes import launch, tail

WORLD = 4
RECIPES = {"llama": "llama8b", "mixtral": "mixtral8x7b", "qwen3-moe": "qwen3_30b_a3b"}
LAUNCHED = ("llama", "mixtral")  # qwen3-moe's grids are mixtral's (its q/k norms train in tests/recipes/test_recipes.py)
FULL = os.environ.get("TOOLKIT_FULL_AGREEMENT") == "1"
GRID = ("tp", "sequence_parallel", "pp", "vpp", "cp", "ep", "etp")
SAME_START = 2e-5  # loss and gradient norm of step 1: float32 round-off
# bf16 round-off of the first step's loss and gradient norm between layouts: up to 4.9e-4 (the
# norm, 1.768) measured; experts' norms not summed over their tp ranks moved it by 3.1e-3
SAME_START_BF16 = 1e-3
BF16 = {"precision": "bf16"}
MIXTRAL_BF16 = {  # name -> (spec overrides, the DeepSpeed optimizer that computes the norm)
    "tp2 ep2 (etp = tp)": ({"parallel.tp": 2, "parallel.ep": 2}, "BF16_Optimizer"),
    "tp2 pp2 ep2 etp1": ({"parallel.tp": 2, "parallel.pp": 2, "parallel.ep": 2, "parallel.etp": 1},
                         "BF16_Optimizer"),
    "ep2 etp2 (etp != tp) ZeRO-2": ({"parallel.ep": 2, "parallel.etp": 2, "zero.stage": 2}, "DeepSpeedZeroOptimizer"),
    "tp2 ep2 ZeRO-1 + CPU offload": ({"parallel.tp": 2, "parallel.ep": 2, "zero.offload_optimizer": "cpu"},
                                     "DeepSpeedZeroOptimizer"),
}


BASE = {"zero.stage": 1, "recompute": "none"}  # the recipes' own choices vary; every run starts here


def base_spec(recipe: str):
    return recipe_spec(recipe, WORLD, {**BASE, "train.steps": 1})


def inner_choices(spec) -> list[dict]:
    """ZeRO x offload and recompute values of the search, as spec overrides."""
    zeros = [{f"zero.{k}": getattr(z, k) for k in ("stage", "offload_optimizer", "offload_param")}
             for z in zero_choices(spec.zero.nvme_path)]
    return [{**z, "recompute": r} for z in zeros for r in domains(spec, load_model(spec.model))["recompute"]]


def valid_grids(spec) -> list[dict]:
    """Every parallel grid (with each cp_comm the rules allow at cp > 1) valid at ZeRO-1."""
    shape = load_model(spec.model)
    dom = domains(spec, shape)
    axes = {"tp": dom["tp"], "sequence_parallel": dom["sp"], "pp": dom["pp"], "vpp": dom["vpp"], "cp": dom["cp"],
            "ep": dom["ep"], "etp": dom["etp"]}
    out = []
    for values in itertools.product(*axes.values()):
        grid = {f"parallel.{k}": v for k, v in zip(axes, values)}
        comms = ["p2p", "all_gather", "a2a", "a2a+p2p"] if grid["parallel.cp"] > 1 else ["p2p"]
        for comm in comms:
            over = {**grid, "parallel.cp_comm": comm}
            if comm == "a2a+p2p":
                over["parallel.cp_a2a"] = 2
            if make_plan(spec.with_overrides(over), shape=shape).valid:
                out.append(over)
    return out


@pytest.fixture(scope="module")
def space() -> dict[str, tuple[list[dict], list[dict], list]]:
    """model -> (valid grids, inner choices valid on at least one grid, every valid plan)."""
    out = {}
    for model, recipe in RECIPES.items():
        spec = base_spec(recipe)
        grids, choices, shape = valid_grids(spec), inner_choices(spec), load_model(spec.model)
        plans = {(i, j): make_plan(spec.with_overrides({**g, **c}), shape=shape)
                 for (i, g), (j, c) in itertools.product(enumerate(grids), enumerate(choices))}
        valid = {k: p for k, p in plans.items() if p.valid}
        inner = [c for j, c in enumerate(choices) if any(k[1] == j for k in valid)]
        out[model] = (grids, inner, list(valid.values()))
    return out


def test_every_valid_layout_passes_the_start_up_checks(space):
    checked = 0
    for model in RECIPES:
        for plan in space[model][2]:
            assert unsupported(plan, cuda=False) == [], plan.layout
            checked += 1
    assert checked > 500, checked
    print(f"{checked} valid layouts of {len(RECIPES)} tiny models on {WORLD} ranks pass the start-up checks")


def read(folder) -> dict:
    """The first step's metrics, with every rank's gradient norm and the engine's optimizer."""
    facts = json.loads((folder / "worker.json").read_text())
    keep = ("grad_norm_by_rank", "optimizer", "trainable_numel", "bf16_grad_buffer_numel", "bf16_master_numel")
    return {**facts["first_step"], **{k: facts[k] for k in keep if k in facts}}


def cover(grids: list[dict]) -> list[dict]:
    """Grids (in their order) until every value of every axis is in one, greedily: each next
    grid the one that adds most values not yet run."""
    values = lambda g: {(k, json.dumps(v)) for k, v in g.items()}  # noqa: E731
    todo, out = set().union(*map(values, grids)), []
    while todo:
        best = max(grids, key=lambda g: len(values(g) & todo))
        out.append(best)
        todo -= values(best)
    return out


def launched(model: str, grids: list[dict], inner: list[dict]) -> tuple[list[dict], list[dict]]:
    """What the launch runs: everything with TOOLKIT_FULL_AGREEMENT=1, else the cover."""
    if FULL:
        return grids, inner
    plain = lambda c: c["zero.offload_optimizer"] == c["zero.offload_param"] == "none"  # noqa: E731
    # llama: every ZeRO / offload choice, and both recompute kinds at ZeRO-1 and ZeRO-3;
    # Mixtral: each ZeRO stage without offload (offload does not touch the expert code path)
    keep = (lambda c: c["recompute"] == "none" or (plain(c) and c["zero.stage"] in (1, 3))) if model == "llama" \
        else (lambda c: c["recompute"] == "none" and plain(c))
    return cover(grids), [c for c in inner if keep(c)]


def deal(grids: list[dict], inner: list[dict], spec) -> list[dict]:
    shape = load_model(spec.model)
    """One run per grid; the inner choices dealt round-robin over the grids that take them, so
    each one runs at least once (grids beyond the choices run at ZeRO-1 without recompute)."""
    runs = [dict(g) for g in grids]
    used = [False] * len(runs)
    for c in inner:
        fits = [i for i, g in enumerate(grids) if make_plan(spec.with_overrides({**g, **c}), shape=shape).valid]
        i = next((i for i in fits if not used[i]), fits[0])
        if used[i]:
            runs.append({**grids[i], **c})
        else:
            runs[i].update(c)
            used[i] = True
    return runs


@pytest.fixture(scope="module")
def first_steps(space, tmp_path_factory) -> dict[str, list[tuple[dict, dict]]]:
    tmp = tmp_path_factory.mktemp("agreement")
    items, index = [], {}
    for model in LAUNCHED:
        recipe = RECIPES[model]
        grids, inner = launched(model, *space[model][:2])
        ref = {"name": f"{model} ref", "recipe": recipe, "steps": 1, "first_step": True, "out": str(tmp / f"{model}_ref"),
               "sets": BASE}
        items.append(ref)
        corpus = str(tmp / f"{model}_ref" / "data" / "tiny_corpus")  # prepared by the first run
        for k, sets in enumerate(deal(grids, inner, base_spec(recipe))):
            items.append({"name": f"{model} {k}", "recipe": recipe, "steps": 1, "first_step": True,
                          "out": str(tmp / f"{model}_{k}"), "sets": {**BASE, **sets}, "data": corpus})
            index.setdefault(model, []).append((sets, tmp / f"{model}_{k}"))
    corpus = str(tmp / "mixtral_ref" / "data" / "tiny_corpus")
    items.append({"name": "mixtral ref bf16", "recipe": RECIPES["mixtral"], "steps": 1, "first_step": True,
                  "out": str(tmp / "mixtral_ref_bf16"), "sets": {**BASE, **BF16}, "data": corpus})
    for k, (name, (sets, _)) in enumerate(MIXTRAL_BF16.items()):
        items.append({"name": f"mixtral bf16 {name}", "recipe": RECIPES["mixtral"], "steps": 1, "first_step": True,
                      "out": str(tmp / f"mixtral_bf16_{k}"), "sets": {**BASE, **BF16, **sets}, "data": corpus})
        index.setdefault("mixtral bf16", []).append((sets, tmp / f"mixtral_bf16_{k}"))
    (tmp / "runs.json").write_text(json.dumps(items))
    r = launch(str(SUPPORT / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun", nproc=WORLD,
               timeout=3000)
    assert r.returncode == 0, tail(r)
    refs = {m: tmp / (f"{m}_ref" if m in LAUNCHED else "mixtral_ref_bf16") for m in index}
    return {m: [(sets, read(folder), read(refs[m])) for sets, folder in runs] for m, runs in index.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("model", LAUNCHED)
def test_every_valid_grid_takes_its_first_step(first_steps, space, model):
    runs = first_steps[model]
    grids, inner = launched(model, *space[model][:2])
    assert {json.dumps(g, sort_keys=True) for g in grids} <= {
        json.dumps({k: v for k, v in s.items() if k.startswith("parallel.")}, sort_keys=True) for s, _, _ in runs}
    worst = 0.0
    for sets, step, ref in runs:
        d = max(abs(step["loss"] - ref["loss"]), abs(step["grad_norm"] - ref["grad_norm"]))
        assert d < SAME_START, (sets, step, ref)
        assert len(set(step["grad_norm_by_rank"])) == 1, (sets, step["grad_norm_by_rank"])  # one clip coefficient
        worst = max(worst, d)
    print(f"{model}: {len(grids)} of {len(space[model][0])} valid grids ({'all' if FULL else 'a cover of every axis value'}), "
          f"{len(inner)} ZeRO/offload/recompute choices in {len(runs)} first steps; "
          f"max |loss or grad-norm diff| vs dp {worst:.1e}")


@pytest.mark.multirank
def test_bf16_gradient_norm_is_the_data_parallel_one(first_steps):
    """Mixtral in bf16 (MIXTRAL_BF16): on DeepSpeed's bf16 ZeRO-1 optimizer and on its ZeRO
    optimizer, with experts split over tp, whole on tp ranks, or split over other ranks, every
    rank's gradient norm is one value, the bf16 data-parallel run's within bf16 round-off."""
    ref = first_steps["mixtral bf16"][0][2]
    assert ref["optimizer"] == "BF16_Optimizer" and len(set(ref["grad_norm_by_rank"])) == 1, ref
    # rank 0's BF16_Optimizer against the plan's estimate (memory.bf16_states): an fp32 gradient
    # buffer of every parameter, not sharded, beside the bf16 gradients; the masters (and the
    # moments) sharded. Flattening pads each group to a multiple of 2 x its data-parallel size.
    stage = make_plan(recipe_spec(RECIPES["mixtral"], WORLD, {**BASE, **BF16})).memory.stages[0]
    n, buffer, master = ref["trainable_numel"], ref["bf16_grad_buffer_numel"], ref["bf16_master_numel"]
    print(f"mixtral-tiny bf16 ZeRO-1 rank 0: {n} trainable elements, fp32 gradient buffer {buffer}, fp32 masters "
          f"{master}; estimate grads {stage.grads:.0f} B (measured 2 x {n} + 4 x {buffer}), optimizer "
          f"{stage.optimizer:.0f} B (measured 12 x {master})")
    assert 0 <= buffer - n < 64 and master < buffer
    assert stage.grads == pytest.approx(2 * n + 4 * buffer, rel=1e-3)
    assert stage.optimizer == pytest.approx(12 * master, rel=1e-3)
    lines = [f"dp4 {ref['grad_norm']:.6f}"]
    for (name, (_, optimizer)), (sets, step, _) in zip(MIXTRAL_BF16.items(), first_steps["mixtral bf16"]):
        norms = step["grad_norm_by_rank"]
        assert step["optimizer"] == optimizer, (name, step["optimizer"])
        assert len(set(norms)) == 1, (name, norms)
        d = max(abs(step["loss"] - ref["loss"]), abs(step["grad_norm"] - ref["grad_norm"]))
        assert d < SAME_START_BF16, (name, step, ref)
        lines.append(f"{name} ({optimizer}) {step['grad_norm']:.6f} (|diff| {d:.1e})")
    print("mixtral-tiny bf16 first-step gradient norms, one per run on all ranks: " + "; ".join(lines))
