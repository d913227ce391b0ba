"""The runtime on the paths users run (issue 18), on 2 CPU ranks in ONE launch
(tests/support/runtime_worker.py runs every training run below in turn):

- starting from Hugging Face weights keeps them: lr ~0 for 3 steps, then --export-hf gives
  the source weights back, at ZeRO 0/1/2/3, fp32 and bf16, with and without CPU optimizer
  offload, at dp2, tp2 and pp2; at a normal lr the first loss is transformers' own, and so it is
  for GPT-OSS at ep2, Gemma 3 at tp2 and GLM-4.5 at pp2 from their converted HF weights;
- bf16 accumulates gradients in fp32 (asserted on DeepSpeed's engine) and follows fp32;
- ZeRO-3 builds each rank's partition only, and saves without holding the whole model;
- a resume with a longer --steps follows the schedule Megatron-LM's flags choose: with
  --override-scheduler the fresh (longer) schedule's learning rate at every step, with
  --use-checkpoint-scheduler the checkpoint's (then min_lr past its end).
"""
import json
import math

import pytest
import torch

from toolkit.runtime.recipe import TINY_BATCH

from tests.conftest import SUPPORT
from tests.recipes.test_recipes import launch, metrics, tail

LR0 = {"optimizer.lr": 1e-12, "optimizer.min_lr": 1e-12}
HF_RUNS = {  # name -> spec overrides (llama8b recipe, tiny flavour, 2 ranks)
    "dp2 ZeRO-0 fp32": {"zero.stage": 0, "precision": "fp32"},
    "dp2 ZeRO-1 bf16": {"zero.stage": 1, "precision": "bf16"},
    "dp2 ZeRO-2 bf16 offload": {"zero.stage": 2, "precision": "bf16", "zero.offload_optimizer": "cpu"},
    "dp2 ZeRO-3 fp32 offload": {"zero.stage": 3, "precision": "fp32", "zero.offload_optimizer": "cpu"},
    "dp2 ZeRO-3 bf16": {"zero.stage": 3, "precision": "bf16"},
    "tp2 ZeRO-1 fp32": {"parallel.tp": 2, "zero.stage": 1, "precision": "fp32"},
    "tp2 ZeRO-2 bf16": {"parallel.tp": 2, "zero.stage": 2, "precision": "bf16"},
    "pp2 ZeRO-1 bf16 offload": {"parallel.pp": 2, "zero.stage": 1, "precision": "bf16", "zero.offload_optimizer": "cpu"},
    "pp2 ZeRO-1 fp32": {"parallel.pp": 2, "zero.stage": 1, "precision": "fp32"},
}
ACCUM = {"batch.micro": 1, "batch.global": 16}  # 2 data-parallel ranks: 8 micro-batches per step
ACC_RUNS = {"fp32 ZeRO-1": {"precision": "fp32", "zero.stage": 1},
            "bf16 ZeRO-1": {"precision": "bf16", "zero.stage": 1},
            "bf16 ZeRO-2": {"precision": "bf16", "zero.stage": 2}}
BF16_CURVE = 0.05  # |loss difference| bf16 vs fp32 over 10 steps (bf16 weights: ~3 significant digits)
# the 2026 families from their converted HF weights (issue 40), each at a layout that splits what is its own:
# GPT-OSS's experts with their biases and the sinks (ep2), Gemma 3's own layers (tp2), GLM-4.5's dense first
# layer and MoE layers with q/k norms and biases (pp2)
FROM_HF = {"gpt-oss-tiny": {"parallel.ep": 2}, "gemma3-tiny": {"parallel.tp": 2}, "glm4-moe-tiny": {"parallel.pp": 2}}


def slug(name: str) -> str:
    return name.replace(" ", "_")


def hf_source(folder):
    """A tiny Llama in bf16 with perturbed norms (so norms must be carried too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.models import named_models

    cfg = {k: v for k, v in named_models()["llama-tiny"]["config"].items()
           if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(folder)
    return model


def hf_family(model: str, folder) -> None:
    """The registry's tiny flavour of a family, randomly initialised and saved by transformers (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.models import named_models

    cfg = {k: v for k, v in named_models()[model]["config"].items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(folder)


def bigger_llama(folder) -> str:
    """~140 M parameters (540 MB in fp32, largest weight 12 MB): big enough to see ZeRO-3's
    partitioning in RSS."""
    from toolkit.models import named_models

    cfg = {**named_models()["llama-tiny"]["config"], "hidden_size": 1024, "intermediate_size": 2816,
           "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 1024}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from converters import hf_to_megatron

    tmp = tmp_path_factory.mktemp("correctness")
    hf_source(tmp / "hf")
    hf_to_megatron(tmp / "hf", tmp / "mg", tp=1, pp=1, fmt="torch_dist")
    runs = [{"name": n, "recipe": "llama8b", "sets": {**over, **LR0}, "load": str(tmp / "mg"), "steps": 3,
             "out": str(tmp / slug(n)), "export": str(tmp / f"{slug(n)}-hf")} for n, over in HF_RUNS.items()]
    runs.append({"name": "normal lr", "recipe": "llama8b", "sets": {"parallel.tp": 2, "zero.stage": 1},
                 "load": str(tmp / "mg"), "steps": 6, "out": str(tmp / "normal")})
    for model, layout in FROM_HF.items():
        hf_family(model, tmp / f"hf_{model}")
        hf_to_megatron(tmp / f"hf_{model}", tmp / f"mg_{model}", tp=1, pp=1, fmt="torch_dist", dtype="fp32")
        runs.append({"name": f"from hf {model}", "recipe": "llama8b", "load": str(tmp / f"mg_{model}"), "steps": 1,
                     "sets": {"model": str(tmp / f"hf_{model}"), "zero.stage": 1, **layout},
                     "out": str(tmp / f"from_hf_{model}")})
    runs += [{"name": n, "recipe": "llama8b", "sets": {**over, **ACCUM}, "steps": 10, "out": str(tmp / slug(n))}
             for n, over in ACC_RUNS.items()]
    runs.append({"name": "zero3 memory", "recipe": "llama8b", "first_step": True, "out": str(tmp / "z3mem"),
                 "sets": {"model": bigger_llama(tmp / "big"), "zero.stage": 3, "batch.global": 2, "batch.micro": 1,
                          "batch.seq_len": 32}, "measure": "zero3_build"})
    runs.append({"name": "schedule", "recipe": "llama8b", "steps": 6, "out": str(tmp / "sched"),
                 "sets": {"train.save_interval": 3, "zero.stage": 1}})
    runs.append({"name": "nothing left", "recipe": "llama8b", "steps": 6, "out": str(tmp / "nothing"),
                 "load": str(tmp / "sched" / "checkpoints" / "global_step6"), "export": str(tmp / "nothing-hf"),
                 "sets": {"train.save_interval": 3, "zero.stage": 1}})
    for name, choice in (("longer", "override"), ("kept", "checkpoint")):
        runs.append({"name": f"resume {name}", "recipe": "llama8b", "steps": 12, "out": str(tmp / name),
                     "load": str(tmp / "sched" / "checkpoints" / "global_step3"), "sets": {"zero.stage": 1},
                     "scheduler": choice})
    (tmp / "runs.json").write_text(json.dumps(runs))
    # the memory run fixes glibc's mmap threshold for itself (runtime_worker.fixed_mmap_threshold)
    r = launch(str(SUPPORT / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun",
               timeout=1800)
    assert r.returncode == 0, tail(r)
    return tmp


def facts(folder) -> dict:
    return json.loads((folder / "worker.json").read_text())


def weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.multirank
def test_start_from_hf_weights_keeps_them(results):
    source = weights(results / "hf")
    for name in HF_RUNS:
        exported = weights(results / f"{slug(name)}-hf")
        assert exported.keys() == source.keys(), name
        diff = max(float((exported[k].float() - source[k].float()).abs().max()) for k in source)
        print(f"start from HF weights, {name}, lr 1e-12 x 3 steps: export vs source max |diff| {diff:.2e}")
        assert diff <= 1e-6, name


@pytest.mark.multirank
def test_export_with_no_step_left_exports_what_was_loaded(results, tmp_path):
    """--load RUN --out NEW --steps N --export-hf DIR of a checkpoint at step N trains nothing,
    saves nothing, and exports the loaded checkpoint's weights (it looked for NEW's own)."""
    from converters import megatron_to_hf

    model = results / "sched" / "checkpoints" / "global_step6" / "model"
    megatron_to_hf(model, tmp_path / "direct", hf_config=model / "hf")
    exported, direct = weights(results / "nothing-hf"), weights(tmp_path / "direct")
    assert exported.keys() == direct.keys() and all(torch.equal(exported[k], direct[k]) for k in direct)
    assert not (results / "nothing" / "checkpoints").exists()


@pytest.mark.multirank
def test_normal_lr_starts_at_the_hf_models_loss(results):
    """The first loss is transformers' own on the same samples, and training improves on it."""
    run = metrics(results / "normal")
    want = transformers_first_loss(results / "normal", results / "hf")
    losses = [m["loss"] for m in run]
    print(f"from HF weights at lr 3e-3 (tp2 ZeRO-1): loss {losses[0]:.6f} (transformers {want:.6f}) -> "
          f"{losses[-1]:.4f} in {len(losses)} steps; a random model starts at ln(512) = {math.log(512):.2f}")
    assert abs(losses[0] - want) < 1e-5
    assert losses[-1] < losses[0] - 0.1 and all(b < a + 0.05 for a, b in zip(losses, losses[1:]))


def transformers_first_loss(run, hf) -> float:
    """transformers' loss of the HF model in folder ``hf`` on the run's first global batch."""
    from transformers import AutoModelForCausalLM

    from toolkit.runtime import data

    ds = data.build_dataset(run / "data" / "tiny_corpus", 64, 1234, 512, run.parent / "cache")
    batch = data.collate(ds, list(range(TINY_BATCH["global"])), "cpu")  # the first global batch
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"]).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))


@pytest.mark.multirank
@pytest.mark.parametrize("model", list(FROM_HF))
def test_2026_families_start_from_their_converted_hf_weights(results, model):
    """GPT-OSS, Gemma 3 and GLM-4.5 converted from what transformers saved and loaded by the runtime
    (--load) at a layout that splits them: the first loss is transformers' own on the same samples."""
    [first] = [m["loss"] for m in metrics(results / f"from_hf_{model}")]
    want = transformers_first_loss(results / f"from_hf_{model}", results / f"hf_{model}")
    print(f"{model} from its HF weights at {FROM_HF[model]}: first loss {first:.6f} (transformers {want:.6f})")
    assert abs(first - want) < 1e-5


@pytest.mark.multirank
def test_bf16_accumulates_in_fp32_and_follows_fp32(results):
    ref = [m["loss"] for m in metrics(results / slug("fp32 ZeRO-1"))]
    for name in ("bf16 ZeRO-1", "bf16 ZeRO-2"):
        f = facts(results / slug(name))
        assert f["model_dtype"] == "torch.bfloat16" and f["grad_accum_dtype"] == "torch.float32", f
        if f["optimizer"] == "BF16_Optimizer":  # ZeRO-1: DeepSpeed's bf16 optimizer keeps fp32 hp grads
            assert f["hp_grad_dtype"] == "torch.float32", f
        else:
            assert f["zero_grad_accum_dtype"] == "torch.float32", f
        got = [m["loss"] for m in metrics(results / slug(name))]
        diff = max(abs(a - b) for a, b in zip(got, ref))
        print(f"{name}, 8 micro-batches per step ({f['optimizer']}, accumulation {f['grad_accum_dtype']}): "
              f"loss {got[0]:.4f} -> {got[-1]:.4f}, max |diff| vs fp32 {diff:.2e}")
        assert len(got) == 10 and diff < BF16_CURVE


@pytest.mark.multirank
def test_zero3_builds_and_saves_its_share(results):
    """Building: about half the model per rank (each weight is whole only while it is built
    and drawn); saving: the rank's share of the training state, never the whole."""
    f = facts(results / "z3mem")
    build = f["build_growth"] / f["model_bytes"]
    whole = 4 * f["model_bytes"]  # fp32 weights + master + 2 moments (fp32 training)
    save = f["save_growth"] / whole
    print(f"ZeRO-3 on 2 ranks: model {f['model_bytes'] / 2**20:.0f} MiB unpartitioned; peak RSS growth while "
          f"building {f['build_growth'] / 2**20:.0f} MiB ({build:.2f} of it); while saving "
          f"{f['save_growth'] / 2**20:.0f} MiB ({save:.2f} of the whole training state, "
          f"{whole / 2**20:.0f} MiB)")
    assert 0.4 < build < 0.65
    assert save < 0.6


@pytest.mark.multirank
def test_resume_with_longer_steps_follows_the_chosen_schedule(results):
    """The 6-step run's step 3 resumed for 12 steps: --override-scheduler gives the tiny flavour's
    cosine from 3e-3 to 3e-4 over 12 steps, --use-checkpoint-scheduler the 6-step one's, which
    ends at step 6 (min_lr after it, as megatron-core's scheduler past lr_decay_steps)."""
    cosine = lambda n: [3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi * min(k, n) / n)) for k in range(12)]  # noqa: E731
    for name, want in (("longer", cosine(12)), ("kept", cosine(6))):
        resumed = metrics(results / name)
        assert [m["step"] for m in resumed] == list(range(4, 13))
        assert [m["lr"] for m in resumed] == pytest.approx(want[3:], rel=1e-12), name


@pytest.mark.multirank
def test_close_gives_the_run_back(results):
    """trainer.close (DeepSpeed's engine.destroy, the references to the module that DeepSpeed
    and megatron-core keep past it, then megatron's grid): the run's model is garbage
    afterwards, for every optimizer path, ZeRO-3 with and without offload included."""
    for name in {**HF_RUNS, **ACC_RUNS}:
        f = facts(results / slug(name))
        print(f"{name}: {f['optimizer']}, model freed after trainer.close: {f['model_freed']}")
        assert f["model_freed"], name
