"""LoRA in the runtime (spec finetune.method: lora, toolkit.runtime.lora), on 2 CPU ranks in ONE
launch (tests/support/runtime_worker.py, llama8b's tiny flavour, fp32, ZeRO-1):

- tp2, pp2 and megatron's full recompute give the data-parallel run's loss curve (6 steps, within the round-off bound of
  tests/recipes/test_recipes.same_curve), and so does Mixtral's ep2 (3 steps; adapters on the
  attention, the experts frozen);
- the base stays frozen: every base tensor of the checkpoint at step 6 equals step 3's, bit for bit,
  while the adapters moved (B starts at zero);
- DeepSpeed's optimizer holds Adam state for the adapters only, and the plan's memory estimate
  counts exactly the rank's trainable and frozen elements;
- a checkpoint holds the adapters and their optimizer state: resumed at step 3 at the same
  layout and at tp2, the optimizer state after loading is the saved one bit for bit and steps 4..6
  continue the uninterrupted curve;
- adapters out: LoRA on a model transformers saved (converted, --load), 3 steps at tp1 and at
  tp2, and Qwen3-Next at tp2 (adapters on the gated delta nets' in_proj and out_proj too), exported
  in peft's format: peft.PeftModel.from_pretrained(that HF model, the export) gives
  megatron-core's logits of the trained run (computed at the run's layout) within 1e-5, and the
  merged export (--export-hf) equals peft's merge_and_unload().
Largest differences print with `pytest -s`.
"""
import json

import pytest
import torch

from tests.recipes.test_recipes import hf_llama, max_diff, same_curve
from tests.recipes.test_recipes import metrics as read_metrics
from tests.toolkit.runtime.test_resume_layouts import N, _launch, continues, same_state

LORA = {"zero.stage": 1, "recompute": "none", "finetune.method": "lora", "train.save_interval": N}
LAYOUTS = {"dp2": {}, "tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2},
           "full recompute": {"recompute": "full"}}  # a frozen embedding: lora._needs_grad
STEPS = 2 * N
# LoRA from an HF model (transformers saved it: the folder), exported; Qwen3-Next at tp2: adapters on the
# gated delta nets' in_proj (B stored part by part, each tp rank holding its rows of every part) and out_proj
EXPORTS = {"tp1": ({}, "hf"), "tp2": ({"parallel.tp": 2}, "hf"),
           "next tp2": ({"parallel.tp": 2}, "next_hf")}  # the model: the folder's config (vocabulary 500)
MIXTRAL = {"mixtral dp2": {}, "mixtral dp2 twin": {}, "mixtral ep2": {"parallel.ep": 2}}


def slug(name: str) -> str:
    return name.replace(" ", "_").replace(">", "")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    items = [{"name": n, "recipe": "llama8b", "sets": {**LORA, **over}, "steps": STEPS, "out": str(tmp / slug(n)),
              "dump_optimizer": n == "dp2"} for n, over in LAYOUTS.items()]
    items.append({"name": "dp2 twin", "recipe": "llama8b", "sets": LORA, "steps": STEPS, "nudge": True,
                  "out": str(tmp / "dp2_twin")})
    items += [{"name": n, "recipe": "mixtral8x7b", "sets": {**LORA, **over}, "steps": N, "nudge": n.endswith("twin"),
               "out": str(tmp / slug(n))} for n, over in MIXTRAL.items()]
    saved = str(tmp / "dp2" / "checkpoints" / f"global_step{N}")
    items += [{"name": n, "recipe": "llama8b", "sets": {**LORA, **LAYOUTS[layout]}, "steps": STEPS, "load": saved,
               "dump_optimizer": True, "out": str(tmp / slug(n))}
              for n, layout in (("dp2 -> dp2", "dp2"), ("dp2 -> tp2", "tp2"))]
    hf_llama(tmp)  # tmp/hf (transformers), tmp/mg (converted)
    hf_qwen3_next(tmp)  # tmp/next_hf, tmp/next_hf_mg
    for n, (over, hf) in EXPORTS.items():
        run, model = str(tmp / f"from_hf_{slug(n)}"), {} if hf == "hf" else {"model": str(tmp / hf)}
        items += [{"name": f"from_hf {n}", "recipe": "llama8b", "sets": {**LORA, **over, **model}, "steps": N,
                   "out": run,
                   "load": str(tmp / ("mg" if hf == "hf" else f"{hf}_mg")), "export_peft": str(tmp / f"peft_{slug(n)}"),
                   "export": str(tmp / f"merged_{slug(n)}")},
                  {"name": f"reference {n}", "recipe": "llama8b", "export_reference": run, "reference_sets": over,
                   "out": str(tmp / f"reference_{slug(n)}")}]
    _launch(tmp, items, 2)
    return tmp


def hf_qwen3_next(folder) -> None:
    """A random qwen3-next-tiny saved by transformers, converted to torch_dist (fp32)."""
    from converters import hf_to_megatron

    from tests.support.convert_models import NEXT, make_hf

    make_hf("qwen3_next", folder / "next_hf", NEXT)
    hf_to_megatron(folder / "next_hf", folder / "next_hf_mg", tp=1, pp=1, fmt="torch_dist", dtype="fp32")


def metrics(tmp, name: str) -> list[dict]:
    return read_metrics(tmp / slug(name))


def facts(tmp, name: str) -> dict:
    return json.loads((tmp / slug(name) / "worker.json").read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["tp2", "pp2", "full recompute"])
def test_lora_layout_gives_the_data_parallel_curve(runs, name):
    run, ref = metrics(runs, name), metrics(runs, "dp2")
    assert len(run) == STEPS
    d, off = max_diff(run, ref), same_curve(run, ref, metrics(runs, "dp2 twin"))
    print(f"LoRA llama-tiny {name}: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f}, max |diff| vs dp2 {d:.1e} "
          f"({off:.2f} of the round-off bound)")
    assert off < 1
    assert run[-1]["loss"] < run[0]["loss"] - 0.05, "the adapters train"
    assert (facts(runs, name)["recomputed"] > 0) == (name == "full recompute")  # megatron's checkpointing ran


@pytest.mark.multirank
def test_lora_at_expert_parallel_gives_the_data_parallel_curve(runs):
    """Frozen experts at ep2: DeepSpeed sees no MoE layer but broadcasts each expert over its own
    expert data-parallel group (toolkit.runtime.engine.build_engine)."""
    run, ref = metrics(runs, "mixtral ep2"), metrics(runs, "mixtral dp2")
    d, off = max_diff(run, ref), same_curve(run, ref, metrics(runs, "mixtral dp2 twin"))
    print(f"LoRA mixtral-tiny ep2: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f}, max |diff| vs dp2 {d:.1e} "
          f"({off:.2f} of the round-off bound)")
    assert len(run) == N and off < 1


def _model(folder, out) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder / "model", out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.mark.multirank
def test_base_is_frozen_and_the_adapters_train(runs, tmp_path):
    ckpt = runs / "dp2" / "checkpoints"
    early, late = (_model(ckpt / f"global_step{s}", tmp_path / f"{s}.pt") for s in (N, STEPS))
    assert early.keys() == late.keys()
    adapters = sorted(k for k in early if ".lora_" in k)
    assert {k.rsplit(".", 2)[-2] for k in adapters} == {"lora_A", "lora_B"}
    assert len(adapters) == 8, adapters  # A and B of linear_qkv, linear_proj, linear_fc1, linear_fc2
    base = [k for k in early if k not in adapters]
    assert base and all(torch.equal(early[k], late[k]) for k in base)
    assert all(not torch.equal(early[k], late[k]) for k in adapters)
    assert all(late[k].abs().sum() > 0 for k in adapters if ".lora_B." in k)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_optimizer_holds_the_adapters_only_as_the_estimate_counts(runs, name):
    """Rank 0's trainable / frozen elements and Adam's state, against the plan's stage-0 estimate
    (fp32, ZeRO-1: weights 4 bytes each, gradients 4 per trainable element, exp_avg and
    exp_avg_sq 8 per trainable element of the data-parallel partition)."""
    from tests.support.runtime_worker import recipe_spec
    from toolkit.plan import make_plan

    f = facts(runs, name)
    plan = make_plan(recipe_spec("llama8b", 2, {**LORA, **LAYOUTS[name]}))
    dp, stage = plan.layout.dp, plan.memory.stages[0]
    assert f["exp_avg_numel"] == f["trainable_numel"] / dp
    assert 0 < f["trainable_numel"] < f["frozen_numel"] / 5
    print(f"LoRA {name}, rank 0: {f['trainable_numel']} trainable, {f['frozen_numel']} frozen elements; "
          f"estimate: weights {stage.params:.0f} B, gradients {stage.grads:.0f} B, optimizer {stage.optimizer:.0f} B")
    assert stage.params == 4 * (f["trainable_numel"] + f["frozen_numel"])
    assert stage.grads == 4 * f["trainable_numel"]
    assert stage.optimizer == 8 * f["exp_avg_numel"]


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["dp2 -> dp2", "dp2 -> tp2"])
def test_adapters_and_their_optimizer_state_resume(runs, name):
    state = same_state(runs / "dp2" / "optim" / f"save_step{N}", runs / slug(name) / "optim" / f"load_step{N}")
    loss = continues(metrics(runs, "dp2"), metrics(runs, name), metrics(runs, "dp2 twin"))
    print(f"LoRA {name}: steps {N + 1}..{STEPS} max |loss diff| {loss}; optimizer state after loading: {state}")


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(EXPORTS))
def test_peft_loads_the_exported_adapters(runs, name):
    """HF base (as transformers saved it) + the exported adapter, through peft's own loader,
    against megatron-core's GPTModel with the trained adapters (tests/support/export_reference.py)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = torch.load(runs / f"reference_{slug(name)}" / "logits.pt")
    base = AutoModelForCausalLM.from_pretrained(str(runs / EXPORTS[name][1]), dtype=torch.float32)
    with torch.no_grad():
        before = base(input_ids=ref["tokens"]).logits
    model = PeftModel.from_pretrained(base, str(runs / f"peft_{slug(name)}"))
    with torch.no_grad():
        logits = model(input_ids=ref["tokens"]).logits
    diff, moved = float((logits - ref["logits"]).abs().max()), float((before - ref["logits"]).abs().max())
    print(f"LoRA {name}: HF base + peft adapter vs megatron-core's logits: max |diff| {diff:.1e} "
          f"(the base alone: {moved:.1e})")
    assert diff < 1e-5 and moved > 1e-3
    merged = model.merge_and_unload().state_dict()
    ours = AutoModelForCausalLM.from_pretrained(str(runs / f"merged_{slug(name)}"), dtype=torch.float32).state_dict()
    assert merged.keys() == ours.keys()
    worst = max(float((merged[k] - ours[k]).abs().max()) for k in merged)
    print(f"LoRA {name}: --export-hf (merged) vs peft's merge_and_unload(): max |diff| {worst:.1e}")
    assert worst < 1e-6


def test_export_peft_needs_a_lora_run(tmp_path):
    from tests.support.runtime_worker import recipe_spec
    from toolkit.errors import SpecError
    from toolkit.plan import make_plan
    from toolkit.runtime.export import check_export_peft

    full = make_plan(recipe_spec("llama8b", 2, {}))
    with pytest.raises(SpecError, match="--export-peft needs finetune.method=lora") as e:
        check_export_peft(full, tmp_path / "peft", False)
    assert e.value.exit_code == 2
    check_export_peft(make_plan(recipe_spec("llama8b", 2, LORA)), tmp_path / "peft", False)
    check_export_peft(full, None, False)  # not asked for: nothing to check
