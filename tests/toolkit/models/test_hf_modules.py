"""params.hf_layer_weights against transformers' own models: every tiny model of every family built
by transformers (the installed 5.x), run forward once on CPU with a hook on each module holding
parameters. Per decoder layer, the modules in the order the forward first calls them (what DeepSpeed
ZeRO-3's trace follows) and each one's tensors (what it gathers, whole) are the table's."""
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.models import load_model, named_models
from toolkit.models.params import hf_layer_weights, layer_weights
from toolkit.models.registry import hf_config_object

TINY = sorted(k for k in named_models() if k.endswith("-tiny"))
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# modules whose weights transformers' forward reads without calling them: Qwen3-Next's delta net passes
# conv1d.weight to causal_conv1d_fn (counted where megatron-core's layer holds it, after the in_proj)
READ_NOT_CALLED = {"linear_attn.conv1d"}


def transformers_layers(name: str) -> dict[int, list[tuple[int, ...]]]:
    """{layer: [the numels of a module's own parameters, per module, in the order the forward calls them]}."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config_object(named_models()[name]["config"])).eval()
    called: dict[str, tuple[int, ...]] = {}
    for module_name, module in model.named_modules():
        own = tuple(p.numel() for p in module.parameters(recurse=False))
        if own and LAYER.match(module_name + "."):
            module.register_forward_pre_hook(lambda m, a, n=module_name, t=own: called.setdefault(n, t) and None)
    with torch.no_grad():
        model(input_ids=torch.randint(0, model.config.vocab_size, (1, 16)))
    layers: dict[int, list] = {}
    for module_name, numels in called.items():
        layers.setdefault(int(LAYER.match(module_name + ".").group(1)), []).append(numels)
    unseen = {LAYER.sub("", n): tuple(p.numel() for p in m.parameters(recurse=False))
              for n, m in model.named_modules() if LAYER.match(n + ".") and list(m.parameters(recurse=False))
              and n not in called}
    assert set(unseen) <= READ_NOT_CALLED, unseen  # every other module holding parameters runs in a forward
    return layers, set(unseen.values())


def _without(ours: list, numels: set) -> list:
    """ours less one module of each of these numels (READ_NOT_CALLED's, which no hook sees)."""
    out, left = [], set(numels)
    for m in ours:
        if m in left:
            left.discard(m)
        else:
            out.append(m)
    assert not left, left
    return out


@pytest.mark.parametrize("name", TINY)
def test_layers_are_transformers_modules_in_forward_order(name):
    shape = load_model(name)
    layers, read = transformers_layers(name)
    assert sorted(layers) == list(range(shape.num_layers))
    for i, modules in layers.items():
        ours = [w.parts or (w.numel,) for w in hf_layer_weights(shape, i, "fused")]
        if shape.is_linear_attention_layer(i):
            ours = _without(ours, read)
        assert ours == modules, (i, ours, modules)
        # the same parameters as megatron-core's modules
        assert sum(w.total for w in hf_layer_weights(shape, i)) == sum(w.total for w in layer_weights(shape, i))


@pytest.mark.parametrize("name", [n for n in TINY if load_model(n).moe is not None])
def test_experts_as_modules_are_a_linear_per_expert_weight(name):
    """transformers 4.x's MoE layers (Mixtral's w1, w3, w2: a Linear per expert weight), against
    the fused layer: the same tensors, cut per expert, one module each."""
    shape = load_model(name)
    i = shape.moe.layers.index(True)
    fused = [w for w in hf_layer_weights(shape, i, "fused") if w.split == "expert"]
    apart = [w for w in hf_layer_weights(shape, i, "modules") if w.split == "expert"]
    assert len(fused) == 1 and fused[0].count == 1
    assert all(w.count == shape.moe.num_experts for w in apart)
    assert len(apart) == (3 if shape.gated_mlp else 2)
    assert sum(w.total for w in apart) == fused[0].total
    # per expert weight, gate and up as the fused gate_up_proj's halves
    per_expert = sorted(p * w.count for w in apart for p in (w.parts or (w.numel,)))
    halves = [fused[0].parts[0] // 2] * 2 + list(fused[0].parts[1:]) if shape.gated_mlp else list(fused[0].parts)
    assert sum(per_expert) == sum(halves)


def test_a_plan_says_when_the_fused_experts_are_the_gather_that_counts():
    """The HF Trainer at ZeRO-3 on transformers 5 gathers a MoE layer's experts as one module: where that
    gather (with its gradient, 4 bytes a parameter in the estimate) is over a tenth of the GPU, the plan warns
    with both sizes; with transformers 4.x's modules (estimate.hf_experts) or another target it does not."""
    from toolkit.plan import FUSED_EXPERTS_RULE, make_plan
    from toolkit.spec import TrainingSpec

    base = {"model": "deepseek-v3", "target": "hf", "cluster": {"nodes": 32, "gpus_per_node": 8, "gpu": "h100-80gb"},
            "zero": {"stage": 3}, "recompute": "full", "batch": {"micro": 1, "global": 256, "seq_len": 4096}}
    fused = make_plan(TrainingSpec.from_dict(base))
    apart = make_plan(TrainingSpec.from_dict({**base, "estimate": {"hf_experts": "modules"}}))
    msg = [f.message for f in fused.findings if f.rule == FUSED_EXPERTS_RULE]
    shape = load_model("deepseek-v3")
    layer = shape.moe.layers.index(True)
    experts = next(w for w in hf_layer_weights(shape, layer) if w.module == "mlp.experts")
    assert experts.numel == 256 * 3 * 2048 * 7168  # every expert's gate, up and down projections
    assert msg and f"one module of {experts.numel / 1e9:.3g} billion parameters" in msg[0], msg
    # what the gather adds to the estimate: 2 bytes a parameter gathered, 2 of its gradient
    grown = sum(fused.memory.worst.gib()[k] - apart.memory.worst.gib()[k] for k in ("params", "grads"))
    largest_apart = 129280 * 7168  # then the embedding is the largest module
    assert grown == pytest.approx(4 * (experts.numel - largest_apart) / 2**30, rel=1e-3)
    assert not [f for f in apart.findings if f.rule == FUSED_EXPERTS_RULE]
    for other in ({"model": "mixtral-8x7b"}, {"target": "megatron-lm", "zero": {"stage": 1}}):
        plan = make_plan(TrainingSpec.from_dict({**base, **other}))
        assert not [f for f in plan.findings if f.rule == FUSED_EXPERTS_RULE], other
