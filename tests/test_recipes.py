"""The recipes end to end under the `deepspeed` launcher: 2 CPU ranks over gloo, tiny flavours.

Every layout starts from the same weights (toolkit.runtime.init) and sees the same samples
at each step (toolkit.runtime.data), so loss curves of different layouts must agree to
float32 round-off; a missing gradient reduction (sequence-parallel norms, tied embeddings,
expert groups) shows up as a difference many times larger than the tolerance.
Each launch costs ~10 s of imports, so one test holds the runs whose results it compares.
"""
import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from toolkit.plan import make_plan
from toolkit.runtime.recipe import tiny_flavor
from toolkit.runtime.trainer import unsupported

from .conftest import ROOT, free_port, shm_segments, subprocess_env

RECIPES = ROOT / "recipes"
KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}
SAME_CURVE = 2e-5  # |loss difference| between layouts; float32 round-off stays below 3e-6 over 30 steps
FALLS_BY = 2.0  # nats: from ln(512) = 6.24 to below 4.3 in 30 steps on the built-in corpus


def launch(recipe: str, *args: str, launcher: str = "deepspeed", nproc: int = 2,
           timeout: int = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """2 ranks under the deepspeed launcher (the documented command) or torchrun (which
    skips the launcher's own DeepSpeed import; the runtime reads the same environment).
    `recipe` is a file in recipes/ or "-m MODULE". A free port can be taken by another
    process before the launcher binds it: then the launch is repeated on another port."""
    start = (["-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc)] if launcher == "deepspeed"
             else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)])
    target = ["--module", recipe[3:]] if recipe.startswith("-m ") else [str(RECIPES / recipe)]
    for _ in range(3):
        port = free_port()
        cmd = [sys.executable, *start, "--master_port", str(port), *target, *args]
        r = subprocess.run(cmd, env=subprocess_env(**(env or {})), capture_output=True, text=True, timeout=timeout)
        if "EADDRINUSE" not in r.stdout + r.stderr:
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


def assert_trains(metrics: list[dict], steps: int = 30) -> None:
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(set(m) == KEYS and m["grad_norm"] is not None and m["tokens_per_s"] > 0 for m in metrics)
    first, last = metrics[0]["loss"], sum(losses(metrics)[-3:]) / 3
    assert first - last > FALLS_BY, f"loss {first:.3f} -> {last:.3f}"


def max_diff(a: list[dict], b: list[dict]) -> float:
    """Largest loss difference; also, the first 3 steps' gradient norms must agree to 1e-5
    (a missing reduction changes the very first gradient, before any divergence)."""
    assert [m["step"] for m in a] == [m["step"] for m in b]
    assert all(abs(x["grad_norm"] - y["grad_norm"]) < 1e-5 for x, y in zip(a[:3], b[:3])), (a[:3], b[:3])
    return max(abs(x - y) for x, y in zip(losses(a), losses(b)))


def tied_llama(folder) -> str:
    """llama-tiny with tied input/output embeddings (as Llama-3.2-1B/3B): with pp = 2 the
    first and last stage each hold a copy whose gradients must be summed."""
    from toolkit.models import named_models

    cfg = {**named_models()["llama-tiny"]["config"], "tie_word_embeddings": True}
    (folder / "tied-llama").mkdir()
    (folder / "tied-llama" / "config.json").write_text(json.dumps(cfg))
    return str(folder / "tied-llama")


@pytest.mark.multirank
def test_tied_embeddings_at_pp2_match_dp(tmp_path):
    """The tied copies on the first and last stage get the summed gradient and count once in
    the norm: pp=2 gives the dp=2 curve. 6 steps: this model at the tiny flavour's learning
    rate later spikes, and float round-off alone then parts the two runs."""
    model = ("--set", f"model={tied_llama(tmp_path)}", "--set", "zero.stage=1")
    dp = train("llama8b.py", tmp_path / "dp", *model, launcher="torchrun", steps=6)
    pp = train("llama8b.py", tmp_path / "pp", *model, "--set", "parallel.pp=2", launcher="torchrun", steps=6)
    assert max_diff(pp, dp) < SAME_CURVE
    print(f"llama-tiny tied pp=2: loss {pp[0]['loss']:.4f} -> {pp[-1]['loss']:.4f}, pp-dp {max_diff(pp, dp):.1e}")


@pytest.mark.multirank
def test_llama_layouts_same_curve_resume_and_export(tmp_path):
    """(tp, pp, dp) = (1,1,2) ZeRO-3, (2,1,1) ZeRO-2, (1,2,1) ZeRO-1 + CPU optimizer offload
    (that one through `deepspeed --module toolkit.runtime.train --spec`)."""
    dp = train("llama8b.py", tmp_path / "dp", "--set", "zero.stage=3")
    tp = train("llama8b.py", tmp_path / "tp", "--set", "parallel.tp=2", "--set", "zero.stage=2",
               "--set", "batch.micro=4", export=tmp_path / "hf")
    # the generic entry point the spine's launch scripts start, on a spec file and the dp run's data
    spec = tiny_flavor(load_recipe("llama8b").make_spec(), "llama-tiny", 2, cuda=False)
    pp_spec = spec.with_overrides({"parallel.pp": 2, "zero.stage": 1, "zero.offload_optimizer": "cpu"})
    (tmp_path / "pp.yaml").write_text(pp_spec.to_yaml())
    pp = train("-m toolkit.runtime.train", tmp_path / "pp", "--spec", str(tmp_path / "pp.yaml"),
               "--data", str(tmp_path / "dp" / "data" / "tiny_corpus"), flavor="")
    for run in (dp, tp, pp):
        assert_trains(run)
    assert max_diff(tp, dp) < SAME_CURVE and max_diff(pp, dp) < SAME_CURVE
    # Megatron's schedule, one increment per optimizer step: the tiny flavour's cosine from 3e-3 to 3e-4
    lrs = [3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi * k / 30)) for k in range(30)]
    assert [m["lr"] for m in dp] == pytest.approx(lrs) and [m["lr"] for m in pp] == pytest.approx(lrs)
    for name, run in (("dp=2 ZeRO-3", dp), ("tp=2 ZeRO-2", tp), ("pp=2 ZeRO-1 offload", pp)):
        print(f"llama-tiny {name}: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f}")
    print(f"max |loss difference| tp-dp {max_diff(tp, dp):.1e}, pp-dp {max_diff(pp, dp):.1e}")

    # 30 steps == 15 steps + save + resume + 15 steps (the dp run saved at step 15)
    r = launch("llama8b.py", "--flavor", "tiny", "--out", str(tmp_path / "resume"), "--set", "zero.stage=3",
               "--load", str(tmp_path / "dp" / "checkpoints" / "global_step15"), launcher="torchrun")
    assert r.returncode == 0, tail(r)
    resumed = [json.loads(line) for line in (tmp_path / "resume" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == list(range(16, 31))
    assert losses(resumed) == losses(dp[15:]), "resumed losses must equal the uninterrupted run's"
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in dp[15:]]

    # the exported HF model computes the trained model's logits
    assert_export_matches(tmp_path / "tp", tmp_path / "hf", "LlamaForCausalLM", tmp_path / "logits.pt")


def assert_export_matches(run, hf_dir, architecture: str, scratch) -> None:
    """megatron-core's GPTModel on the run's final weights (tests/test_recipes_worker.py, one
    rank, resharded to tp = pp = ep = 1) and transformers' model from the export agree."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = launch(str(ROOT / "tests" / "test_recipes_worker.py"), str(run), str(scratch), launcher="torchrun", nproc=1)
    assert r.returncode == 0, tail(r)
    ref = torch.load(scratch)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=ref["tokens"]).logits
    assert type(hf).__name__ == architecture and logits.shape == ref["logits"].shape
    assert AutoTokenizer.from_pretrained(str(hf_dir)).eos_token_id == 2, "the corpus tokenizer comes along"
    diff = float((logits - ref["logits"]).abs().max())
    print(f"export {architecture}: HF logits vs megatron-core on the trained weights: max |diff| {diff:.1e}")
    assert diff < 1e-4


@pytest.mark.multirank
def test_start_from_hugging_face_weights(tmp_path):
    """HF model -> `converters.hf_to_megatron` (torch_dist, Megatron-LM's layout, tp=1) ->
    `--load` at tp=2: the first step's loss is transformers' loss on the same samples."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from converters import hf_to_megatron
    from toolkit.models import named_models
    from toolkit.runtime import data

    cfg = {k: v for k, v in named_models()["llama-tiny"]["config"].items()
           if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=1, pp=1, fmt="torch_dist", dtype="fp32")
    run = train("llama8b.py", tmp_path / "run", "--set", "parallel.tp=2", "--load", str(tmp_path / "mg"),
                launcher="torchrun", steps=1)
    ds = data.build_dataset(tmp_path / "run" / "data" / "tiny_corpus", 64, 1234, 512, tmp_path / "cache")
    batch = data.collate(ds, list(range(16)), "cpu")  # step 0's global batch
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)(
            input_ids=batch["tokens"]).logits
    want = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))
    print(f"start from HF weights: step-1 loss {run[0]['loss']:.6f}, transformers {want:.6f}")
    assert abs(run[0]["loss"] - want) < 1e-5


@pytest.mark.multirank
def test_moe_expert_parallel(tmp_path):
    """Mixtral and Qwen3-MoE shapes at ep=2 train; ep=2 gives the ep=1 curve (experts reduced
    over the expert data-parallel group only, through DeepSpeed's MoE path); on 4 ranks,
    tp=2 x ep=2 (sequence-parallel router and norms, q/k norms, experts) starts the same."""
    once = ("--set", "train.save_interval=30")
    ep1 = train("mixtral8x7b.py", tmp_path / "ep1", *once, launcher="torchrun")
    ep2 = train("mixtral8x7b.py", tmp_path / "ep2", "--set", "parallel.ep=2", *once, launcher="torchrun",
                export=tmp_path / "hf")
    flat = ("--set", "optimizer.decay=constant")  # the same learning rates whether a run is 3 or 30 steps long
    qwen = train("qwen3_30b_a3b.py", tmp_path / "qwen", "--set", "parallel.ep=2", *once, *flat, launcher="torchrun")
    for run in (ep1, ep2, qwen):
        assert_trains(run)
    assert max_diff(ep2, ep1) < SAME_CURVE
    # every expert parallel rank's experts reach the export (DeepSpeed's own module file has rank 0's only)
    assert_export_matches(tmp_path / "ep2", tmp_path / "hf", "MixtralForCausalLM", tmp_path / "logits.pt")
    # 3 steps: later, float round-off flips near-tied top-k choices and the two runs part
    four = train("qwen3_30b_a3b.py", tmp_path / "qwen4", "--set", "parallel.ep=2", "--set", "parallel.tp=2", *once,
                 *flat, launcher="torchrun", nproc=4, steps=3)
    assert max_diff(four, qwen[:3]) < SAME_CURVE
    for name, run in (("mixtral-tiny ep=1", ep1), ("mixtral-tiny ep=2", ep2), ("qwen3-moe-tiny ep=2", qwen),
                      ("qwen3-moe-tiny tp=2 ep=2 (4 ranks)", four)):
        print(f"{name}: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f} ({len(run)} steps)")
    print(f"max |loss difference| mixtral ep2-ep1 {max_diff(ep2, ep1):.1e}, "
          f"qwen 4 ranks-2 ranks {max_diff(four, qwen[:3]):.1e}")


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


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name,world,tiny_sets", [
    ("llama70b", 1024, [{"parallel.tp": 2}, {"parallel.pp": 2}]),
    ("llama8b", 8, [{"parallel.tp": 2}]),
    ("mixtral8x7b", 64, [{"parallel.ep": 2}, {"parallel.tp": 2}]),
    ("qwen3_30b_a3b", 16, [{"parallel.ep": 2}, {"parallel.pp": 2}]),
    ("deepseek_v3", 1024, [{"parallel.ep": 2}, {"parallel.pp": 2, "parallel.last_stage_layers": 1},
                           {"parallel.cp": 2, "mtp.layers": 0}]),  # MTP at cp > 1: runtime_mtp
    ("deepseek_v2_lite", 8, [{"parallel.ep": 2}]),
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
