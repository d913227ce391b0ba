"""DeepSeek in the runtime (issue 15): multi-latent attention and DeepSeekMoE train at the
layouts the tiny flavours run on 2 CPU ranks, in ONE launch (tests/runtime_worker.py):

- DeepSeek-V3 tiny (q LoRA, sigmoid routing with groups, shared expert, expert bias) at ep2,
  at pp2 with megatron's uneven split (3 + 1 layers) and at cp2 gives the dp2 curve;
  DeepSeek-V2 tiny (no q LoRA, softmax routing with the aux loss) at ep2 gives its dp2 curve;
- the aux-loss-free expert bias moves the routing towards balance: over 30 steps the spread
  of the per-expert token counts ends lower than with the bias frozen (moe.bias_update_rate
  ~0), and the bias itself moved;
- the trained V3 exports to Hugging Face (--export-hf) and transformers' DeepseekV3ForCausalLM
  computes megatron-core's logits on the trained weights, the expert bias included;
- V3 saved at ep2 half way resumes at pp2 (3 + 1) on the uninterrupted dp2 curve:
  the checkpoint carries the router's expert bias (a buffer, not a parameter) across layouts.
"""
import json

import pytest

from .conftest import ROOT
from .test_recipes import SAME_CURVE, assert_export_matches, launch, max_diff, tail

STEPS, BALANCE_STEPS = 8, 30
RUNS = {  # name -> (recipe, overrides)
    "v3 dp2": ("deepseek_v3", {}),
    "v3 ep2": ("deepseek_v3", {"parallel.ep": 2}),
    "v3 pp2 3+1": ("deepseek_v3", {"parallel.pp": 2, "parallel.last_stage_layers": 1}),
    "v3 cp2": ("deepseek_v3", {"parallel.cp": 2}),
    "v2 dp2": ("deepseek_v2_lite", {}),
    "v2 ep2": ("deepseek_v2_lite", {"parallel.ep": 2}),
}
FROZEN = 1e-12  # moe.bias_update_rate that leaves the bias where it starts


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("+", "_")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek")
    base = {"zero.stage": 1, "recompute": "none", "train.save_interval": 1000}
    items = [{"name": n, "recipe": r, "sets": {**base, **over}, "steps": STEPS, "out": str(tmp / slug(n))}
             for n, (r, over) in RUNS.items()]
    items[1]["export"] = str(tmp / "v3_hf")
    items[1]["sets"]["train.save_interval"] = STEPS // 2  # v3 ep2 also saves half way: resumed at pp2 below
    items.append({"name": "v3 resumed pp2", "recipe": "deepseek_v3", "steps": STEPS, "out": str(tmp / "v3_resumed_pp2"),
                  "load": str(tmp / "v3_ep2" / "checkpoints" / f"global_step{STEPS // 2}"),
                  "sets": {**base, **RUNS["v3 pp2 3+1"][1]}})
    items += [{"name": f"bias {k}", "recipe": "deepseek_v3", "steps": BALANCE_STEPS, "out": str(tmp / f"bias_{k}"),
               "routing_spread": True, "sets": {**base, **({"moe.bias_update_rate": FROZEN} if k == "frozen" else {})}}
              for k in ("updated", "frozen")]
    (tmp / "runs.json").write_text(json.dumps(items))
    r = launch(str(ROOT / "tests" / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun", timeout=1800)
    assert r.returncode == 0, tail(r)
    return tmp


def metrics(tmp, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / slug(name) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multirank
@pytest.mark.parametrize("name,ref", [("v3 ep2", "v3 dp2"), ("v3 pp2 3+1", "v3 dp2"), ("v3 cp2", "v3 dp2"),
                                      ("v2 ep2", "v2 dp2")])
def test_layout_gives_the_data_parallel_curve(runs, name, ref):
    a, b = metrics(runs, name), metrics(runs, ref)
    d = max_diff(a, b)
    print(f"deepseek {name}: loss {a[0]['loss']:.4f} -> {a[-1]['loss']:.4f}, max |diff| vs {ref} {d:.1e}")
    assert d < SAME_CURVE and a[-1]["loss"] < a[0]["loss"] - 0.5


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
    assert_export_matches(runs / "v3_ep2", runs / "v3_hf", "DeepseekV3ForCausalLM", runs / "logits.pt")


@pytest.mark.multirank
def test_resume_at_another_layout_keeps_the_expert_bias(runs):
    from safetensors import safe_open

    resumed, full = metrics(runs, "v3 resumed pp2"), metrics(runs, "v3 dp2")
    assert [m["step"] for m in resumed] == [m["step"] for m in full][STEPS // 2:]
    d = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, full[STEPS // 2:]))
    print(f"deepseek v3 ep2 -> pp2 resume at step {STEPS // 2}: max |loss diff| vs uninterrupted dp2 {d:.1e}")
    assert d < SAME_CURVE
    biases = []
    for path in sorted((runs / "v3_hf").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            biases += [f.get_tensor(k) for k in f.keys() if k.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().max() > 0 for b in biases)  # trained, saved and exported
