"""Every layout the planner may propose trains in the runtime (issue 12), on 4 CPU ranks in ONE
launch (tests/support/runtime_worker.py runs the list below in turn, tiny flavours, fp32):

- interleaved 1F1B (pp2 vpp2; pp2 vpp3 with chunks holding only the embedding or the loss),
  context parallelism (cp2 with each cp_comm: p2p, all_gather,
  a2a; cp4 with a2a+p2p over [2, 2]; tp2 cp2; pp2 cp2; cp2 ZeRO-2), ZeRO-3 with ZeRO++'s hierarchical
  partitioning (hpz 2), expert tensor parallelism different from tp (Mixtral tp2 ep2 etp1),
  Qwen3-MoE at tp2 ep2, selective and full recompute: each gives the loss curve of the
  data-parallel run (3 steps) on the same samples from the same weights;
- save at step 3 and resume, for pp2 vpp2 and cp2: steps 4..6 equal the uninterrupted run's;
- Gemma 3 (the toolkit's own layers in megatron's spec) at tp2 x pp2 and tp2 x cp2, GPT-OSS at tp2 x ep2
  (etp 1) and ep2 x pp2, Qwen3-Next (megatron's GatedDeltaNet on CPU: toolkit.mcore.gated_delta_net) at
  tp2 x ep2 and ep2 x pp2: the data-parallel curve; Qwen3-Next's tp2 x ep2 checkpoint (megatron's
  dist_checkpointing: the delta nets' in_proj and conv1d one key per part) and Gemma 3's tp2 x pp2 one,
  exported with `--export-hf`, compute megatron-core's logits in transformers;
- resume at another layout on 4 ranks (tests/toolkit/runtime/test_resume_layouts.py's checks: the optimizer
  state bit for bit, the curve continued): tp2 pp2 -> dp4 and pp2 vpp2 -> tp2 cp2.
Largest differences print with `pytest -s`.
"""
import json

import pytest

from tests.conftest import SUPPORT
from tests.recipes.test_recipes import assert_export_matches, launch, max_diff, same_curve, tail
from tests.toolkit.runtime.test_resume_layouts import FOUR_PAIRS, check_pair, four_rank_runs

STEPS, SAVE = 6, 3  # the resumed runs and what they are compared with
LAYOUT_STEPS = 3  # every other layout: a missing reduction shows in the first step's gradient norm
LLAMA = {  # name -> spec overrides (llama8b recipe, tiny flavour, 4 ranks)
    "dp4": {},
    "pp2 vpp2": {"parallel.pp": 2, "parallel.vpp": 2},
    # 4 layers + embedding + loss over pp2 x vpp3: the first chunk holds only the embedding, the last
    # only the output layer and loss (megatron-core builds them without transformer layers)
    "pp2 vpp3 embedding+loss chunks": {"parallel.pp": 2, "parallel.vpp": 3, "parallel.embedding_in_split": True,
                                       "parallel.loss_in_split": True},
    "cp2 p2p": {"parallel.cp": 2},
    "cp2 all_gather": {"parallel.cp": 2, "parallel.cp_comm": "all_gather"},
    "cp2 a2a": {"parallel.cp": 2, "parallel.cp_comm": "a2a"},
    "cp4 a2a+p2p": {"parallel.cp": 4, "parallel.cp_comm": "a2a+p2p", "parallel.cp_a2a": 2},
    "tp2 cp2": {"parallel.tp": 2, "parallel.cp": 2},
    "pp2 cp2": {"parallel.pp": 2, "parallel.cp": 2},
    "cp2 ZeRO-2": {"parallel.cp": 2, "zero.stage": 2},
    # ZeRO++'s hierarchical partitioning: each rank keeps a 16-bit secondary partition over 2 ranks
    "ZeRO-3 hpz2": {"zero.stage": 3, "zero.hpz_partition_size": 2},
    "recompute selective": {"recompute": "selective"},
    "recompute full": {"recompute": "full"},
}
MIXTRAL = {"mixtral dp4": {}, "mixtral tp2 ep2 etp1": {"parallel.tp": 2, "parallel.ep": 2, "parallel.etp": 1}}
# (at most 3 steps: later, float round-off flips near-tied top-k choices and the two runs part)
QWEN = {"qwen dp4": {}, "qwen tp2 ep2": {"parallel.tp": 2, "parallel.ep": 2}}
# Gemma 3 (toolkit.mcore.layers: post-norms, (1 + w) norms, local rope on layers 1, 2, 4; window 16 of 64
# tokens): tp2 (sequence parallel, so the norms' and q/k norms' gradients are reduced over tp) x pp2 (layers
# 3-4, the global one first), and tp2 x cp2 (the local rope and the window on each rank's share of the sequence)
GEMMA = {"gemma dp4": {"model": "gemma3-tiny"},
         "gemma tp2 pp2": {"model": "gemma3-tiny", "parallel.tp": 2, "parallel.pp": 2},
         "gemma tp2 cp2": {"model": "gemma3-tiny", "parallel.tp": 2, "parallel.cp": 2}}
# GPT-OSS (attention sinks, biases on every linear and on the experts, clamped SwiGLU, alternating
# window): tp2 x ep2 at etp 1 (the sinks split with the heads; each tp rank holds other experts, whose
# biases neither sum over tp nor count once per tp group) and ep2 x pp2
OSS = {"oss dp4": {"model": "gpt-oss-tiny"},
       "oss tp2 ep2 etp1": {"model": "gpt-oss-tiny", "parallel.tp": 2, "parallel.ep": 2, "parallel.etp": 1},
       "oss ep2 pp2": {"model": "gpt-oss-tiny", "parallel.ep": 2, "parallel.pp": 2}}
# Qwen3-Next (3 gated delta net layers, then gated attention; 8 experts + a gated shared one): tp2 x ep2 (the
# delta nets' in_proj, conv1d and A_log split over tp by parts, their out_norm summed over tp under sequence
# parallelism) and ep2 x pp2 (stage 2 holds delta net 3 and the attention layer: the layer offset places them)
# with its multi-token prediction module (mtp.layers 1: megatron's MTP block, whose layer is a gated attention one,
# on the last stage; its loss joins the gradients)
NEXT = {"next dp4": {"model": "qwen3-next-tiny", "mtp.layers": 1},
        "next tp2 ep2": {"model": "qwen3-next-tiny", "mtp.layers": 1, "parallel.tp": 2, "parallel.ep": 2},
        "next ep2 pp2": {"model": "qwen3-next-tiny", "mtp.layers": 1, "parallel.ep": 2, "parallel.pp": 2}}
RESUMED = ("pp2 vpp2", "cp2 p2p")
REFERENCES = {"dp4": ("llama8b", {}, STEPS), "dp4 short": ("llama8b", {}, LAYOUT_STEPS),
              "mixtral dp4": ("mixtral8x7b", {}, LAYOUT_STEPS),
              "qwen dp4": ("qwen3_30b_a3b", {"optimizer.decay": "constant"}, LAYOUT_STEPS),
              "gemma dp4": ("llama8b", GEMMA["gemma dp4"], LAYOUT_STEPS),
              "oss dp4": ("llama8b", OSS["oss dp4"], LAYOUT_STEPS),
              "next dp4": ("llama8b", NEXT["next dp4"], LAYOUT_STEPS)}


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("+", "_")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    base = {"zero.stage": 1, "recompute": "none"}
    saved = {"train.save_interval": SAVE}  # only the runs resumed below save mid-way
    items = [{"name": n, "recipe": "llama8b", "sets": {**base, **over, **(saved if n in RESUMED else {})},
              "steps": STEPS if n in RESUMED or n == "dp4" else LAYOUT_STEPS, "out": str(tmp / slug(n))}
             for n, over in LLAMA.items()]
    # the learning rate's cosine spans a run's steps: the 3-step runs have their own reference
    items.append({"name": "dp4 short", "recipe": "llama8b", "sets": base, "steps": LAYOUT_STEPS,
                  "out": str(tmp / "dp4_short")})
    items += [{"name": n, "recipe": "mixtral8x7b", "sets": {**base, **over}, "steps": LAYOUT_STEPS,
               "out": str(tmp / slug(n))} for n, over in MIXTRAL.items()]
    items += [{"name": n, "recipe": "qwen3_30b_a3b", "sets": {**base, **over, "optimizer.decay": "constant"},
               "steps": LAYOUT_STEPS, "out": str(tmp / slug(n))} for n, over in QWEN.items()]
    items += [{"name": n, "recipe": "llama8b", "sets": {**base, **over}, "steps": LAYOUT_STEPS,
               "out": str(tmp / slug(n))} for n, over in {**GEMMA, **OSS, **NEXT}.items()]
    # each reference nudged by one ulp: the round-off bound (test_recipes.same_curve)
    items += [{"name": f"{n} twin", "recipe": r, "sets": {**base, **over}, "steps": steps, "nudge": True,
               "out": str(tmp / slug(f"{n} twin"))} for n, (r, over, steps) in REFERENCES.items()]
    export = next(i for i in items if i["name"] == "next tp2 ep2")
    export["export"] = str(tmp / "next_hf")
    items.append({"name": "next reference", "recipe": "llama8b", "out": str(tmp / "next_reference"),
                  "export_reference": export["out"]})
    gemma = next(i for i in items if i["name"] == "gemma tp2 pp2")
    gemma["export"] = str(tmp / "gemma_hf")
    items.append({"name": "gemma reference", "recipe": "llama8b", "out": str(tmp / "gemma_reference"),
                  "export_reference": gemma["out"]})
    items += [{"name": f"{n} resumed", "recipe": "llama8b", "sets": {**base, **LLAMA[n]}, "steps": STEPS,
               "out": str(tmp / f"{slug(n)}_resumed"), "load": str(tmp / slug(n) / "checkpoints" / f"global_step{SAVE}")}
              for n in RESUMED]
    (tmp / "resume4").mkdir()
    items += four_rank_runs(tmp / "resume4")
    (tmp / "runs.json").write_text(json.dumps(items))
    r = launch(str(SUPPORT / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun", nproc=4,
               timeout=1800)
    assert r.returncode == 0, tail(r)
    return tmp


def metrics(tmp, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / slug(name) / "metrics.jsonl").read_text().splitlines()]


def off_curve(tmp, name: str, reference: str) -> tuple[float, str]:
    """(largest |loss difference| from the reference, the same as a fraction of the round-off bound)."""
    run, ref = metrics(tmp, name), metrics(tmp, reference)
    return max_diff(run, ref), f"{same_curve(run, ref, metrics(tmp, f'{reference} twin')):.2f}"


def facts(tmp, name: str) -> dict:
    return json.loads((tmp / slug(name) / "worker.json").read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("name", [n for n in LLAMA if n != "dp4"])
def test_layout_gives_the_data_parallel_curve(runs, name):
    run = metrics(runs, name)
    assert len(run) == (STEPS if name in RESUMED else LAYOUT_STEPS)
    d, off = off_curve(runs, name, "dp4" if name in RESUMED else "dp4 short")
    print(f"llama-tiny {name}: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f}, max |diff| vs dp4 {d:.1e} "
          f"({off} of the round-off bound)")
    assert float(off) < 1


@pytest.mark.multirank
def test_hierarchical_partitioning_keeps_a_secondary_partition(runs):
    """zero.hpz_partition_size 2 at dp4 (its curve: test_layout_gives_the_data_parallel_curve): DeepSpeed
    keeps each parameter's 16-bit secondary partition over 2 ranks, half of it per rank, the
    estimate's 2 bytes x parameters / N (toolkit.estimate; padded to the partition size)."""
    f = facts(runs, "ZeRO-3 hpz2")
    share = f["hpz_secondary_numel"] / f["zero3_numel"]
    print(f"ZeRO-3 hpz2 on 4 ranks: secondary partition {f['hpz_secondary_numel']:,} of {f['zero3_numel']:,} "
          f"elements ({share:.4f})")
    assert 0.5 <= share < 0.51


@pytest.mark.multirank
def test_expert_tensor_parallel_differs_from_tp(runs):
    run = metrics(runs, "mixtral tp2 ep2 etp1")
    d, off = off_curve(runs, "mixtral tp2 ep2 etp1", "mixtral dp4")
    print(f"mixtral-tiny tp2 ep2 etp1: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f}, max |diff| vs dp4 {d:.1e} "
          f"({off} of the round-off bound)")
    assert float(off) < 1


@pytest.mark.multirank
def test_qwen3_moe_tp2_ep2_starts_as_data_parallel(runs):
    """Sequence-parallel router and norms, q/k norms and experts at tp=2 x ep=2."""
    run = metrics(runs, "qwen tp2 ep2")
    assert len(run) == LAYOUT_STEPS
    d, off = off_curve(runs, "qwen tp2 ep2", "qwen dp4")
    print(f"qwen3-moe-tiny tp2 ep2: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f}, max |diff| vs dp4 {d:.1e} "
          f"({off} of the round-off bound)")
    assert float(off) < 1


FAMILY_RUNS = {**{n: ("gemma3-tiny", "gemma dp4") for n in GEMMA if n != "gemma dp4"},
               **{n: ("gpt-oss-tiny", "oss dp4") for n in OSS if n != "oss dp4"},
               **{n: ("qwen3-next-tiny", "next dp4") for n in NEXT if n != "next dp4"}}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(FAMILY_RUNS))
def test_gemma3_gpt_oss_and_qwen3_next_give_the_data_parallel_curve(runs, name):
    model, reference = FAMILY_RUNS[name]
    run = metrics(runs, name)
    assert len(run) == LAYOUT_STEPS and run[-1]["loss"] < run[0]["loss"]
    d, off = off_curve(runs, name, reference)
    print(f"{model} {name.split(' ', 1)[1]}: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f}, max |diff| vs dp4 "
          f"{d:.1e} ({off} of the round-off bound)")
    assert float(off) < 1


@pytest.mark.multirank
@pytest.mark.parametrize("family,architecture", [("next", "Qwen3NextForCausalLM"), ("gemma", "Gemma3ForCausalLM")])
def test_qwen3_next_and_gemma3_exports_compute_megatrons_logits(runs, family, architecture):
    """Qwen3-Next's tp2 x ep2 and Gemma 3's tp2 x pp2 run's last checkpoint, read by the converters
    from what megatron-core saved, as a Hugging Face folder (--export-hf): transformers' model against
    megatron-core's GPTModel on the same weights (tests/support/export_reference.py)."""
    assert_export_matches(runs / f"{family}_reference", runs / f"{family}_hf", architecture)


@pytest.mark.multirank
def test_recompute_runs_megatrons_checkpointing(runs):
    """The same curve (above) with megatron's checkpointing really running: selective
    recomputes core attention per layer and micro-batch, full recomputes every layer."""
    none, sel, full = (facts(runs, n)["recomputed"] for n in ("dp4", "recompute selective", "recompute full"))
    assert none == 0 and sel > 0 and full > 0, (none, sel, full)


@pytest.mark.multirank
@pytest.mark.parametrize("name", RESUMED)
def test_save_and_resume(runs, name):
    whole, resumed = metrics(runs, name), metrics(runs, f"{name} resumed")
    assert [m["step"] for m in resumed] == list(range(SAVE + 1, STEPS + 1))
    d = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, whole[SAVE:]))
    print(f"{name}: resumed at step {SAVE}, max |loss diff| over steps {SAVE + 1}..{STEPS}: {d:.1e}")
    assert d == 0.0


@pytest.mark.multirank
@pytest.mark.parametrize("a,b", list(FOUR_PAIRS), ids=[f"{a}->{b}" for a, b in FOUR_PAIRS])
def test_resume_four_ranks_at_another_layout(runs, a, b):
    check_pair(runs / "resume4", a, b, metrics(runs, "dp4 twin"))
