"""The recipes end to end: 2 CPU ranks over gloo, tiny flavours, their training runs in one
launch of tests/support/runtime_worker.py (the runtime's train, as `--flavor tiny` runs it) and the
generic entry point and the recipe scripts' own checks under the `deepspeed` launcher.

Every layout starts from the same weights (toolkit.runtime.init) and sees the same samples
at each step (toolkit.runtime.data), so loss curves of different layouts must agree to
float32 round-off; a missing gradient reduction (sequence-parallel norms, tied embeddings,
expert groups) shows up as a difference many times larger than the tolerance.
Each launch costs ~10 s of imports, so one test holds the runs whose results it compares.
"""
import json
import math
import subprocess
import sys

import pytest
import torch

from toolkit.plan import make_plan
from toolkit.runtime.recipe import TINY_BATCH, tiny_flavor
from toolkit.runtime.trainer import unsupported

from tests.conftest import ROOT, SUPPORT, free_port, load_recipe, shm_segments, subprocess_env

RECIPES = ROOT / "recipes"
KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}
# Layouts compute the same sums in other orders, so their loss curves part by float32 round-off that
# training amplifies step by step (DeepSeek-V3 tiny, cp2 against dp2: relative gradient-norm difference
# 5e-7 at step 2, 2e-5 at step 7), and in MoE models round-off may flip a near-tied top-k choice. How far
# depends on the model, the steps and the machine's kernels: a fixed 2e-5 held there at 1.3e-6 on one CPU
# and failed at 3.0e-5 on another. So each launch measures it: its reference layout runs again with every
# initial weight moved by one float32 ulp (tests/support/runtime_worker.py, "nudge"), and the two part by what
# round-off alone does over exactly those steps on exactly that machine (`same_curve`). A layout
# may part from the reference by ROUND_OFF_MARGIN times that, and at least by that many ulps of the loss:
# a layout rounds differently at every step (tp splits, cp merges, pipeline hand-offs) where the twin is
# nudged once, but both then grow at the same rate. The bound at step k is the round-off up to
# step k: tight in the first steps, where a missing reduction shows, wider where round-off has grown. (A twin at another micro-batch size is not the same
# arithmetic: per-micro-batch MoE auxiliary losses make it another training.) A missing reduction parts
# by 1e-3 and more, and already changes the first step's gradient norm (`max_diff`).
ROUND_OFF_MARGIN = 32
FALLS_BY = 2.0  # nats: from ln(512) = 6.24 to below 4.3 in 30 steps on the built-in corpus


def launch(recipe: str, *args: str, launcher: str = "deepspeed", nproc: int = 2,
           timeout: int = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """2 ranks under the deepspeed launcher (the documented command) or torchrun (which
    skips the launcher's own DeepSpeed import; the runtime reads the same environment).
    `recipe` is a file in recipes/ or "-m MODULE". A free port can be taken by another
    process before the launcher binds it (rank 0 says so, toolkit.mcore.rendezvous): then the
    launch is repeated on another port."""
    start = (["-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc)] if launcher == "deepspeed"
             else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)])
    target = ["--module", recipe[3:]] if recipe.startswith("-m ") else [str(RECIPES / recipe)]
    for _ in range(3):
        port = free_port()
        cmd = [sys.executable, *start, "--master_port", str(port), *target, *args]
        r = subprocess.run(cmd, env=subprocess_env(**(env or {})), capture_output=True, text=True, timeout=timeout)
        if "EADDRINUSE" not in r.stdout + r.stderr and "(MASTER_PORT) is in use" not in r.stderr:
            break
    assert not shm_segments(port), f"DeepSpeed's /dev/shm segments were left behind: {shm_segments(port)}"
    return r


def tail(r: subprocess.CompletedProcess, n: int = 3000) -> str:
    return (r.stdout + r.stderr)[-n:]


def train(recipe: str, out, *args: str, launcher: str = "deepspeed", flavor: str = "tiny", nproc: int = 2,
          steps: int = 30, export=None) -> list[dict]:
    extra = ["--export-hf", str(export)] if export else []
    r = launch(recipe, *(["--flavor", flavor] if flavor else []), "--out", str(out), "--steps", str(steps), *args,
               *extra, launcher=launcher, nproc=nproc)
    assert r.returncode == 0, tail(r)
    assert f"step {steps:>5}/{steps} | loss" in r.stdout, "rank 0 prints a line per step"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(metrics: list[dict]) -> list[float]:
    return [m["loss"] for m in metrics]


def assert_trains(metrics: list[dict], steps: int = 30, falls_by: float = FALLS_BY) -> None:
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(set(m) == KEYS and m["grad_norm"] is not None and m["tokens_per_s"] > 0 for m in metrics)
    first, last = metrics[0]["loss"], sum(losses(metrics)[-3:]) / 3
    assert first - last > falls_by, f"loss {first:.3f} -> {last:.3f}"


def max_diff(a: list[dict], b: list[dict]) -> float:
    """Largest loss difference; also, the first step's gradient norm must agree to 1e-5 relative
    and the next two's to 1e-4 (float32 round-off; a missing reduction changes the very first
    gradient by a factor, before any divergence). The round-off grows with the steps: Qwen3-MoE
    tp2 ep2 against dp4 once differed by 1.1e-5 relative at step 3 (1.1e-7 and 2.8e-7 at steps 1
    and 2, the same loss at all three)."""
    assert [m["step"] for m in a] == [m["step"] for m in b]
    assert all(abs(x["grad_norm"] - y["grad_norm"]) < tol * max(1.0, abs(y["grad_norm"]))
               for x, y, tol in zip(a[:3], b[:3], (1e-5, 1e-4, 1e-4))), (a[:3], b[:3])
    return max(abs(x - y) for x, y in zip(losses(a), losses(b)))


def same_curve(run: list[dict], reference: list[dict], twin: list[dict]) -> float:
    """How far `run` parts from `reference`, in units of the round-off bound: the largest, over
    the run's steps k, of |loss difference at k| / (ROUND_OFF_MARGIN x the largest |loss
    difference| between `reference` and `twin`, the reference run nudged by one ulp, at steps up
    to k, and at least one float32 ulp of the loss). Below 1: the same curve. Steps are matched
    by number, so a resumed run's steps N+1.. meet the reference's."""
    eps = float(torch.finfo(torch.float32).eps)
    by_step = {m["step"]: m["loss"] for m in reference}
    spread, bound = 0.0, {}
    for a, b in zip(reference, twin):
        assert a["step"] == b["step"], (a["step"], b["step"])
        spread = max(spread, abs(a["loss"] - b["loss"]), eps * abs(a["loss"]))
        bound[a["step"]] = ROUND_OFF_MARGIN * spread
    assert all(m["step"] in bound for m in run), "the twin must cover every step compared"
    return max(abs(m["loss"] - by_step[m["step"]]) / bound[m["step"]] for m in run)


def tied_llama(folder) -> str:
    """llama-tiny with tied input/output embeddings (as Llama-3.2-1B/3B): with pp = 2 the
    first and last stage each hold a copy whose gradients must be summed."""
    from toolkit.models import named_models

    cfg = {**named_models()["llama-tiny"]["config"], "tie_word_embeddings": True}
    (folder / "tied-llama").mkdir()
    (folder / "tied-llama" / "config.json").write_text(json.dumps(cfg))
    return str(folder / "tied-llama")


def hf_llama(folder) -> None:
    """A random llama-tiny saved by transformers, converted to torch_dist at tp = 1 as
    `toolkit convert hf-to-megatron` does (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from converters import hf_to_megatron
    from toolkit.models import named_models

    cfg = {k: v for k, v in named_models()["llama-tiny"]["config"].items()
           if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(folder / "hf")
    hf_to_megatron(folder / "hf", folder / "mg", tp=1, pp=1, fmt="torch_dist", dtype="fp32")


ONCE = {"train.save_interval": 1000}  # the final save only
FLAT = {"optimizer.decay": "constant"}  # the tiny flavour's lr 3e-3 at every step
MOE_STEPS, MOE_FALLS_BY = 15, 1.5  # nats: from ln(512) = 6.24 to below 4.7 in 15 steps at a constant lr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The recipes' training runs on 2 ranks in ONE launch (tests/support/runtime_worker.py: each run is
    toolkit.runtime.trainer.train on the recipe's tiny flavour, as `--flavor tiny` runs it)."""
    tmp = tmp_path_factory.mktemp("recipes")
    hf_llama(tmp)
    tied = tied_llama(tmp)

    def item(name, recipe, steps=30, **kw):
        return {"name": name, "recipe": recipe, "steps": steps, "out": str(tmp / name), **kw}

    items = [
        item("dp", "llama8b", sets={"zero.stage": 3}),  # saves at step 15 (the tiny flavour's interval)
        item("dp_twin", "llama8b", sets={"zero.stage": 3, **ONCE}, nudge=True),
        item("tp", "llama8b", sets={"parallel.tp": 2, "zero.stage": 2, "batch.micro": 4}, export=str(tmp / "tp_hf")),
        item("resume", "llama8b", sets={"zero.stage": 3}, load=str(tmp / "dp" / "checkpoints" / "global_step15")),
        item("tied_dp", "llama8b", 6, sets={"model": tied, "zero.stage": 1}),
        item("tied_dp_twin", "llama8b", 6, sets={"model": tied, "zero.stage": 1}, nudge=True),
        item("tied_pp", "llama8b", 6, sets={"model": tied, "zero.stage": 1, "parallel.pp": 2}),
        # the embedding alone in the first chunk, the tied output layer alone in the last
        item("tied_pp_vpp3_chunks", "llama8b", 6, sets={"model": tied, "zero.stage": 1, "parallel.pp": 2,
                                                        "parallel.vpp": 3, "parallel.embedding_in_split": True,
                                                        "parallel.loss_in_split": True}),
        item("from_hf", "llama8b", 1, sets={"parallel.tp": 2}, load=str(tmp / "mg")),
        item("ep1", "mixtral8x7b", MOE_STEPS, sets={**ONCE, **FLAT}),
        item("ep1_twin", "mixtral8x7b", MOE_STEPS, sets={**ONCE, **FLAT}, nudge=True),
        item("ep2", "mixtral8x7b", MOE_STEPS, sets={"parallel.ep": 2, **ONCE, **FLAT}, export=str(tmp / "ep2_hf")),
        item("qwen", "qwen3_30b_a3b", MOE_STEPS, sets={"parallel.ep": 2, **ONCE, **FLAT}),
        # GPT-OSS (sinks, alternating window, biases, clamped GLU, yarn): ep=2 against ep=1, and its export
        item("oss_ep1", "gpt_oss_120b", MOE_STEPS, sets={**ONCE, **FLAT}),
        item("oss_ep1_twin", "gpt_oss_120b", MOE_STEPS, sets={**ONCE, **FLAT}, nudge=True),
        item("oss_ep2", "gpt_oss_120b", MOE_STEPS, sets={"parallel.ep": 2, **ONCE, **FLAT},
             export=str(tmp / "oss_ep2_hf")),
        item("tp_reference", "llama8b", export_reference=str(tmp / "tp")),
        item("ep2_reference", "mixtral8x7b", export_reference=str(tmp / "ep2")),
        item("oss_ep2_reference", "gpt_oss_120b", export_reference=str(tmp / "oss_ep2")),
    ]
    (tmp / "runs.json").write_text(json.dumps(items))
    r = launch(str(SUPPORT / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun", timeout=1800)
    assert r.returncode == 0, tail(r)
    return tmp


def metrics(folder) -> list[dict]:
    """A run folder's metrics.jsonl, one dict per step."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multirank
def test_tied_embeddings_at_pp2_match_dp(runs):
    """The tied copies on the first and last stage get the summed gradient and count once in
    the norm: pp=2 gives the dp=2 curve, also at vpp 3 where the first chunk holds only the
    embedding and the last only the output layer. 6 steps: this model at the tiny flavour's
    learning rate later spikes, and float round-off alone then parts the two runs."""
    dp = metrics(runs / "tied_dp")
    twin = metrics(runs / "tied_dp_twin")
    for name in ("tied_pp", "tied_pp_vpp3_chunks"):  # the second: chunks of only the embedding / output layer
        pp = metrics(runs / name)
        off = same_curve(pp, dp, twin)
        print(f"llama-tiny {name}: loss {pp[0]['loss']:.4f} -> {pp[-1]['loss']:.4f}, pp-dp {max_diff(pp, dp):.1e} "
              f"({off:.2f} of the round-off bound)")
        assert len(pp) == 6 and off < 1, name


@pytest.mark.multirank
def test_llama_layouts_same_curve_resume_and_export(runs, tmp_path):
    """(tp, pp, dp) = (1,1,2) ZeRO-3, (2,1,1) ZeRO-2, (1,2,1) ZeRO-1 + CPU optimizer offload
    (that one through `deepspeed --module toolkit.cli.train --spec`, the generic entry point
    the spine's launch scripts start, on a spec file and the dp run's data)."""
    dp, tp = metrics(runs / "dp"), metrics(runs / "tp")
    spec = tiny_flavor(load_recipe("llama8b").make_spec(), "llama-tiny", 2, cuda=False)
    pp_spec = spec.with_overrides({"parallel.pp": 2, "zero.stage": 1, "zero.offload_optimizer": "cpu"})
    (tmp_path / "pp.yaml").write_text(pp_spec.to_yaml())
    pp = train("-m toolkit.cli.train", tmp_path / "pp", "--spec", str(tmp_path / "pp.yaml"),
               "--data", str(runs / "dp" / "data" / "tiny_corpus"), flavor="")
    for run in (dp, tp, pp):
        assert_trains(run)
    twin = metrics(runs / "dp_twin")
    off = {name: same_curve(run, dp, twin) for name, run in (("tp", tp), ("pp", pp))}
    print(f"max |loss difference| tp-dp {max_diff(tp, dp):.1e}, pp-dp {max_diff(pp, dp):.1e} "
          f"({off['tp']:.2f} and {off['pp']:.2f} of the round-off bound)")
    assert max(off.values()) < 1, off
    # Megatron's schedule, one increment per optimizer step: the tiny flavour's cosine from 3e-3 to 3e-4
    lrs = [3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi * k / 30)) for k in range(30)]
    assert [m["lr"] for m in dp] == pytest.approx(lrs) and [m["lr"] for m in pp] == pytest.approx(lrs)
    for name, run in (("dp=2 ZeRO-3", dp), ("tp=2 ZeRO-2", tp), ("pp=2 ZeRO-1 offload", pp)):
        print(f"llama-tiny {name}: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f}")

    # 30 steps == 15 steps + save + resume + 15 steps (the dp run saved at step 15)
    resumed = metrics(runs / "resume")
    assert [m["step"] for m in resumed] == list(range(16, 31))
    assert losses(resumed) == losses(dp[15:]), "resumed losses must equal the uninterrupted run's"
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in dp[15:]]

    # the exported HF model computes the trained model's logits
    assert_export_matches(runs / "tp_reference", runs / "tp_hf", "LlamaForCausalLM")


def assert_export_matches(reference, hf_dir, architecture: str) -> None:
    """megatron-core's GPTModel on the run's final weights (tests/support/export_reference.py: the
    worker's "export_reference" item wrote REFERENCE/logits.pt) and transformers' model from
    the export agree."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = torch.load(reference / "logits.pt")
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=ref["tokens"]).logits
    assert type(hf).__name__ == architecture and logits.shape == ref["logits"].shape
    assert AutoTokenizer.from_pretrained(str(hf_dir)).eos_token_id == 2, "the corpus tokenizer comes along"
    diff = float((logits - ref["logits"]).abs().max())
    print(f"export {architecture}: HF logits vs megatron-core on the trained weights: max |diff| {diff:.1e}")
    assert diff < 1e-4


@pytest.mark.multirank
def test_start_from_hugging_face_weights(runs):
    """HF model -> `converters.hf_to_megatron` (torch_dist, Megatron-LM's layout, tp=1) ->
    `--load` at tp=2: the first step's loss is transformers' loss on the same samples."""
    from transformers import AutoModelForCausalLM

    from toolkit.runtime import data

    run = metrics(runs / "from_hf")
    ds = data.build_dataset(runs / "from_hf" / "data" / "tiny_corpus", 64, 1234, 512, runs / "cache")
    batch = data.collate(ds, list(range(TINY_BATCH["global"])), "cpu")  # step 0's global batch
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(str(runs / "hf"), dtype=torch.float32)(
            input_ids=batch["tokens"]).logits
    want = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))
    print(f"start from HF weights: step-1 loss {run[0]['loss']:.6f}, transformers {want:.6f}")
    assert len(run) == 1 and abs(run[0]["loss"] - want) < 1e-5


@pytest.mark.multirank
def test_moe_expert_parallel(runs):
    """Mixtral and Qwen3-MoE shapes at ep=2 train; ep=2 gives the ep=1 curve (experts reduced
    over the expert data-parallel group only, through DeepSpeed's MoE path). On 4 ranks,
    tp=2 x ep=2: tests/toolkit/runtime/test_layouts.py."""
    ep1, ep2, qwen = (metrics(runs / n) for n in ("ep1", "ep2", "qwen"))
    for run in (ep1, ep2, qwen):
        assert_trains(run, MOE_STEPS, MOE_FALLS_BY)
    off = same_curve(ep2, ep1, metrics(runs / "ep1_twin"))
    print(f"max |loss difference| mixtral ep2-ep1 {max_diff(ep2, ep1):.1e} ({off:.2f} of the round-off bound)")
    assert off < 1
    # every expert parallel rank's experts reach the export (DeepSpeed's own module file has rank 0's only)
    assert_export_matches(runs / "ep2_reference", runs / "ep2_hf", "MixtralForCausalLM")
    for name, run in (("mixtral-tiny ep=1", ep1), ("mixtral-tiny ep=2", ep2), ("qwen3-moe-tiny ep=2", qwen)):
        print(f"{name}: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f} ({len(run)} steps)")


@pytest.mark.multirank
def test_gpt_oss_expert_parallel(runs):
    """GPT-OSS tiny (recipes/gpt_oss_120b.py's flavour) trains on megatron's local layers; ep=2
    gives the ep=1 curve (its random sinks and router bias drawn from their global names:
    toolkit.runtime.init), and transformers' GptOssForCausalLM on the ep=2 export (experts
    packed back into 3-D tensors) computes megatron-core's logits."""
    ep1, ep2 = metrics(runs / "oss_ep1"), metrics(runs / "oss_ep2")
    for run in (ep1, ep2):
        assert_trains(run, MOE_STEPS, MOE_FALLS_BY)
    off = same_curve(ep2, ep1, metrics(runs / "oss_ep1_twin"))
    print(f"gpt-oss-tiny: loss {ep1[0]['loss']:.4f} -> {ep1[-1]['loss']:.4f}; ep2-ep1 max |diff| "
          f"{max_diff(ep2, ep1):.1e} ({off:.2f} of the round-off bound)")
    assert off < 1
    assert_export_matches(runs / "oss_ep2_reference", runs / "oss_ep2_hf", "GptOssForCausalLM")


@pytest.mark.multirank
def test_too_few_ranks_fails_at_once_with_the_plan():
    r = launch("llama70b.py", timeout=300)
    assert r.returncode == 2, tail(r)
    assert "error: needs 1024 ranks (tp8 x pp8 x dp16), found 2; use --flavor tiny" in r.stderr


def test_dry_run_prints_plan_writes_configs(tmp_path):
    r = subprocess.run([sys.executable, str(RECIPES / "llama70b.py"), "--dry-run", "--out", str(tmp_path)],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, tail(r)
    assert "tp=8 pp=8" in r.stdout and "dp=16" in r.stdout and "nothing trained" in r.stdout
    written = json.loads((tmp_path / "configs" / "ds_config.json").read_text())
    assert written == json.loads((ROOT / "ds_configs" / "recipe_llama70b.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]


@pytest.mark.parametrize("name,world,tiny_sets", [
    ("llama70b", 1024, [{"parallel.tp": 2}, {"parallel.pp": 2}]),
    ("llama8b", 8, [{"parallel.tp": 2}]),
    ("mixtral8x7b", 64, [{"parallel.ep": 2}, {"parallel.tp": 2}]),
    ("qwen3_30b_a3b", 16, [{"parallel.ep": 2}, {"parallel.pp": 2, "zero.stage": 1}]),
    ("deepseek_v3", 1024, [{"parallel.ep": 2}, {"parallel.pp": 2, "parallel.last_stage_layers": 1},
                           {"parallel.cp": 2, "mtp.layers": 0}]),  # MTP at cp > 1: runtime_mtp
    ("deepseek_v2_lite", 8, [{"parallel.ep": 2}]),
    ("glm45_air", 32, [{"parallel.ep": 2}, {"parallel.pp": 2}]),
    ("gpt_oss_120b", 64, [{"parallel.ep": 2}, {"parallel.pp": 2}]),
])
def test_recipe_specs(name, world, tiny_sets):
    """Full size: a valid plan that fits and that this runtime runs on GPUs; tiny: valid on
    2 CPU ranks at each 2-rank layout, runnable on CPU."""
    mod = load_recipe(name)
    plan = make_plan(mod.make_spec())
    assert plan.valid and plan.memory.fits() and plan.layout.world == world, plan.errors
    assert unsupported(plan, cuda=True, te=True) == []  # a GPU cluster with TransformerEngine
    assert any("transformer_engine is not importable" in m for m in unsupported(plan, cuda=True, te=False))
    assert f"{world}" in mod.__doc__ and "--flavor tiny" in mod.__doc__
    for sets in [{}, *tiny_sets]:
        tiny = make_plan(tiny_flavor(mod.make_spec(), mod.TINY, 2, cuda=False).with_overrides(sets))
        assert tiny.valid and tiny.layout.world == 2 and unsupported(tiny, cuda=False) == [], (sets, tiny.errors)

