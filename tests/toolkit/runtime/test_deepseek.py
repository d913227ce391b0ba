"""DeepSeek in the runtime (issue 15): multi-latent attention and DeepSeekMoE train at the
layouts the tiny flavours run on 2 CPU ranks, in ONE launch (tests/support/runtime_worker.py):

- DeepSeek-V3 tiny (q LoRA, sigmoid routing with groups, shared expert, expert bias) at ep2,
  at pp2 with megatron's uneven split (3 + 1 layers) and at cp2 gives the dp2 curve;
  DeepSeek-V2 tiny (no q LoRA, softmax routing with the aux loss) at ep2 gives its dp2 curve;
  GLM-4.5 tiny (toolkit/models/families/glm4_moe.py) with its MTP module at ep2, tp2 and pp2 gives its
  dp2 curves (main and MTP loss), at cp2 (no MTP) its dp2 curve without MTP, and its export computes
  megatron-core's logits in transformers; Kimi-K2 tiny (DeepSeek-V3's family file with Kimi's
  configuration) at ep2 gives its dp2 curve;
- the aux-loss-free expert bias moves the routing towards balance: over 20 steps (update rate 1e-2) the spread
  of the per-expert token counts ends lower than with the bias frozen (moe.bias_update_rate
  ~0), and the bias itself moved;
- the trained V3 exports to Hugging Face (--export-hf) and transformers' DeepseekV3ForCausalLM
  computes megatron-core's logits on the trained weights, the expert bias included;
- V3 saved at ep2 half way resumes at pp2 (3 + 1) on the uninterrupted dp2 curve:
  the checkpoint carries the router's expert bias (a buffer, not a parameter) across layouts;
- V3 trains its multi-token prediction module (the recipe's mtp.layers=1; the cp2 run and
  its dp2 reference without, MTP at cp > 1 being a plan rule): the step after the ep2
  checkpoint at step 4, taken at ep2 and (resumed) at pp2, has the main loss, the MTP loss
  and the gradient norm of megatron-core's own GPTModel with its MTP block in one process on
  that checkpoint and batch (tests/support/mtp_reference.py); the MTP weights move, the MTP loss
  falls, and the export holds them under DeepSeek-V3's HF names.
"""
import json

import pytest

from tests.conftest import SUPPORT
from tests.recipes.test_recipes import assert_export_matches, launch, max_diff, same_curve, tail

STEPS, BALANCE_STEPS = 8, 20
RUNS = {  # name -> (recipe, overrides)
    "v3 dp2": ("deepseek_v3", {}),
    "v3 ep2": ("deepseek_v3", {"parallel.ep": 2}),
    "v3 pp2 3+1": ("deepseek_v3", {"parallel.pp": 2, "parallel.last_stage_layers": 1}),
    "v3 cp2": ("deepseek_v3", {"parallel.cp": 2, "mtp.layers": 0}),  # MTP at cp > 1: rule runtime_mtp
    "v3 dp2 no mtp": ("deepseek_v3", {"mtp.layers": 0}),
    "v2 dp2": ("deepseek_v2_lite", {}),
    "v2 ep2": ("deepseek_v2_lite", {"parallel.ep": 2}),
    # GLM-4.5 tiny (GQA with q/k/v biases and q/k norm, half-rotary rope, shared expert, sigmoid
    # routing with expert bias and routed scaling) on the same MoE recipe, with its MTP module
    "glm dp2": ("deepseek_v3", {"model": "glm4-moe-tiny"}),
    "glm ep2": ("deepseek_v3", {"model": "glm4-moe-tiny", "parallel.ep": 2}),
    # tp2 (sequence parallel: the q/k norms' and biases' gradients reduced over tp; rope on half of each
    # head split with the heads), pp2 (the dense first layer and 1 MoE layer, then 2 MoE layers and the
    # MTP module), cp2 (the half-rotary rope on each rank's share of the sequence; MTP at cp > 1: rule)
    "glm tp2": ("deepseek_v3", {"model": "glm4-moe-tiny", "parallel.tp": 2}),
    "glm pp2": ("deepseek_v3", {"model": "glm4-moe-tiny", "parallel.pp": 2}),
    "glm cp2": ("deepseek_v3", {"model": "glm4-moe-tiny", "parallel.cp": 2, "mtp.layers": 0}),
    "glm dp2 no mtp": ("deepseek_v3", {"model": "glm4-moe-tiny", "mtp.layers": 0}),
    # Kimi-K2 tiny: DeepSeek-V3's family file with Kimi's configuration (one dense layer, one expert group,
    # routed scaling 2.827); the hub's Kimi-K2 has no MTP module
    "kimi dp2": ("deepseek_v3", {"model": "kimi-k2-tiny", "mtp.layers": 0}),
    "kimi ep2": ("deepseek_v3", {"model": "kimi-k2-tiny", "mtp.layers": 0, "parallel.ep": 2}),
}
# again nudged by one ulp: test_recipes.same_curve
TWINS = ("v3 dp2", "v3 dp2 no mtp", "v2 dp2", "glm dp2", "glm dp2 no mtp", "kimi dp2")
FROZEN = 1e-12  # moe.bias_update_rate that leaves the bias where it starts
UPDATE = 1e-2  # 10x the recipe's 1e-3: the tiny run's 20 steps of 8 x 64 tokens show the pull to balance


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("+", "_")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek")
    base = {"zero.stage": 1, "recompute": "none", "train.save_interval": 1000}
    items = [{"name": n, "recipe": r, "sets": {**base, **over}, "steps": STEPS, "out": str(tmp / slug(n))}
             for n, (r, over) in RUNS.items()]
    items += [{"name": f"{n} twin", "recipe": RUNS[n][0], "sets": {**base, **RUNS[n][1]}, "steps": STEPS,
               "nudge": True, "out": str(tmp / slug(f"{n} twin"))} for n in TWINS]
    items[1]["export"] = str(tmp / "v3_hf")
    glm = next(i for i in items if i["name"] == "glm ep2")
    glm["export"], glm["sets"]["train.save_interval"] = str(tmp / "glm_hf"), STEPS
    items[1]["sets"]["train.save_interval"] = STEPS // 2  # v3 ep2 also saves half way: resumed at pp2 below
    items.append({"name": "v3 resumed pp2", "recipe": "deepseek_v3", "steps": STEPS, "out": str(tmp / "v3_resumed_pp2"),
                  "load": str(tmp / "v3_ep2" / "checkpoints" / f"global_step{STEPS // 2}"),
                  "sets": {**base, **RUNS["v3 pp2 3+1"][1]}})
    items += [{"name": f"bias {k}", "recipe": "deepseek_v3", "steps": BALANCE_STEPS, "out": str(tmp / f"bias_{k}"),
               "routing_spread": True, "sets": {**base, "mtp.layers": 0,  # the routing only: no MTP block
                                                "moe.bias_update_rate": FROZEN if k == "frozen" else UPDATE}}
              for k in ("updated", "frozen")]
    items.append({"name": "v3 ep2 reference", "recipe": "deepseek_v3", "out": str(tmp / "v3_ep2_reference"),
                  "export_reference": str(tmp / "v3_ep2")})
    items.append({"name": "glm ep2 reference", "recipe": "deepseek_v3", "out": str(tmp / "glm_ep2_reference"),
                  "export_reference": str(tmp / "glm_ep2")})
    ep2 = tmp / "v3_ep2" / "checkpoints"
    items.append({"name": "mtp reference", "recipe": "deepseek_v3", "out": str(tmp / "mtp_reference"), "sets": base,
                  "mtp_reference": {"checkpoint": str(ep2 / f"global_step{STEPS // 2}"),
                                    "later": str(ep2 / f"global_step{STEPS}"), "step": STEPS // 2,
                                    "data": str(tmp / "v3_ep2" / "data" / "tiny_corpus")}})
    (tmp / "runs.json").write_text(json.dumps(items))
    r = launch(str(SUPPORT / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun", timeout=1800)
    assert r.returncode == 0, tail(r)
    return tmp


def metrics(tmp, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / slug(name) / "metrics.jsonl").read_text().splitlines()]


def twin(tmp, reference: str) -> list[dict]:
    return metrics(tmp, f"{reference} twin")


@pytest.mark.multirank
@pytest.mark.parametrize("name,ref", [("v3 ep2", "v3 dp2"), ("v3 pp2 3+1", "v3 dp2"), ("v3 cp2", "v3 dp2 no mtp"),
                                      ("v2 ep2", "v2 dp2"), ("glm ep2", "glm dp2"), ("glm tp2", "glm dp2"),
                                      ("glm pp2", "glm dp2"), ("glm cp2", "glm dp2 no mtp"), ("kimi ep2", "kimi dp2")])
def test_layout_gives_the_data_parallel_curve(runs, name, ref):
    a, b, t = metrics(runs, name), metrics(runs, ref), twin(runs, ref)
    d, off = max_diff(a, b), same_curve(a, b, t)
    mtp = [m.get("mtp_loss") for m in a]
    assert (mtp[0] is not None) == (b[0].get("mtp_loss") is not None) == ("mtp" not in ref and name.startswith(("v3", "glm")))
    dm = off_mtp = 0.0
    if mtp[0]:  # the first MTP module's loss curve, against the same round-off bound
        first = lambda run: [{"step": m["step"], "loss": m["mtp_loss"][0]} for m in run]  # noqa: E731
        dm = max(abs(x[0] - y["mtp_loss"][0]) for x, y in zip(mtp, b))
        off_mtp = same_curve(first(a), first(b), first(t))
    print(f"deepseek {name}: loss {a[0]['loss']:.4f} -> {a[-1]['loss']:.4f}, max |diff| vs {ref} {d:.1e} "
          f"({off:.2f} of the round-off bound)"
          + (f"; mtp_1 loss {mtp[0][0]:.4f} -> {mtp[-1][0]:.4f}, max |diff| {dm:.1e} ({off_mtp:.2f})" if mtp[0] else ""))
    assert off < 1 and a[-1]["loss"] < a[0]["loss"] - 0.5
    assert off_mtp < 1 and (mtp[0] is None or mtp[-1][0] < mtp[0][0] - 0.5)


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["v3 ep2", "v3 resumed pp2"])
def test_mtp_step_is_megatron_cores(runs, name):
    """The step after the ep2 checkpoint, at ep2 and resumed at pp2 (the MTP module and the
    embedding copy on the last stage), against megatron-core's GPTModel with MTP in one process."""
    ref = json.loads((runs / "mtp_reference" / "worker.json").read_text())
    got = next(m for m in metrics(runs, name) if m["step"] == STEPS // 2 + 1)
    rel = {k: abs(got[k] - ref[k]) / abs(ref[k]) for k in ("loss", "grad_norm")}
    rel["mtp_loss"] = abs(got["mtp_loss"][0] - ref["mtp_loss"][0]) / ref["mtp_loss"][0]
    print(f"deepseek {name} step {got['step']} vs megatron-core GPTModel+MTP (1 process): loss {got['loss']:.7f} / "
          f"{ref['loss']:.7f}, mtp_1 loss {got['mtp_loss'][0]:.7f} / {ref['mtp_loss'][0]:.7f}, grad norm "
          f"{got['grad_norm']:.7f} / {ref['grad_norm']:.7f}; relative diffs " +
          ", ".join(f"{k} {v:.1e}" for k, v in rel.items()) +
          f"; MTP grad norm {ref['mtp_grad_norm']:.3e}, MTP weights moved {ref['mtp_weight_change']:.2e} in 4 steps")
    assert all(v < 1e-6 for v in rel.values()), rel
    assert ref["mtp_grad_norm"] > 1e-3 and ref["mtp_weight_change"] > 1e-4


@pytest.mark.multirank
def test_mtp_module_exports_with_deepseek_names(runs):
    """The trained MTP module is in the export as DeepSeek-V3's layer num_hidden_layers (4)."""
    import torch
    from safetensors import safe_open

    from tests.support.mtp_reference import MTP_ONE_TO_ONE

    final = torch.load(runs / "mtp_reference" / "mtp_later.pt")
    exported = {}
    for path in sorted((runs / "v3_hf").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            exported.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.4.")})
    assert any(".mlp.experts." in k for k in exported) and "model.layers.4.shared_head.head.weight" in exported
    for ours, hf in MTP_ONE_TO_ONE.items():
        assert torch.equal(exported[f"model.layers.4.{hf}"], final[ours]), hf


@pytest.mark.multirank
def test_expert_bias_moves_routing_towards_balance(runs):
    updated, frozen = (json.loads((runs / f"bias_{k}" / "worker.json").read_text())["routing_spread"]
                       for k in ("updated", "frozen"))
    assert len(updated) == len(frozen) == BALANCE_STEPS
    assert updated[0] == pytest.approx(frozen[0])  # the same first step: the bias starts at zero in both
    end = lambda s: sum(s[-10:]) / 10  # noqa: E731
    print(f"per-expert token spread (std/mean), last 10 of {BALANCE_STEPS} steps: bias updated {end(updated):.3f}, "
          f"frozen {end(frozen):.3f}")
    assert end(updated) < 0.9 * end(frozen)


@pytest.mark.multirank
def test_trained_deepseek_exports_to_hugging_face(runs):
    assert_export_matches(runs / "v3_ep2_reference", runs / "v3_hf", "DeepseekV3ForCausalLM")


@pytest.mark.multirank
def test_trained_glm_exports_to_hugging_face(runs):
    """GLM-4.5 tiny trained at ep2 (its MTP module too): transformers' Glm4MoeForCausalLM on the
    export computes megatron-core's logits; the MTP layer is in the export under HF layer 4."""
    from safetensors import safe_open

    assert_export_matches(runs / "glm_ep2_reference", runs / "glm_hf", "Glm4MoeForCausalLM")
    names = set()
    for path in sorted((runs / "glm_hf").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.mlp.experts.7.down_proj.weight"} <= names


@pytest.mark.multirank
def test_resume_at_another_layout_keeps_the_expert_bias(runs):
    from safetensors import safe_open

    resumed, full = metrics(runs, "v3 resumed pp2"), metrics(runs, "v3 dp2")
    assert [m["step"] for m in resumed] == [m["step"] for m in full][STEPS // 2:]
    d = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, full[STEPS // 2:]))
    off = same_curve(resumed, full, twin(runs, "v3 dp2"))
    print(f"deepseek v3 ep2 -> pp2 resume at step {STEPS // 2}: max |loss diff| vs uninterrupted dp2 {d:.1e} "
          f"({off:.2f} of the round-off bound)")
    assert off < 1
    biases = []
    for path in sorted((runs / "v3_hf").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            biases += [f.get_tensor(k) for k in f.keys() if k.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().max() > 0 for b in biases)  # trained, saved and exported
