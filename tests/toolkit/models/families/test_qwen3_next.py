"""Qwen3-Next (toolkit/models/families/qwen3_next.py), planned: the planner counts the parameters
transformers' Qwen3NextForCausalLM builds (gated delta net and gated attention layers, 512
experts with a gated shared expert); config.json -> shape -> config.json; the megatron-core
settings and Megatron-LM flags each feature becomes, built into megatron-core's
TransformerConfig; bad configs refused in one line naming the field. Conversion and parity:
tests/converters/test_qwen3_next.py."""
from __future__ import annotations

import pytest
import torch

from toolkit.backends.megatron import load_transformer_config
from toolkit.emit.megatron import gpt_model_kwargs, megatron_lm_args, transformer_config_kwargs
from toolkit.errors import SpecError
from toolkit.models import load_model
from toolkit.models.family import family_of
from toolkit.models.params import active_params, embedding_weights, total_params
from toolkit.models.registry import hf_config_object, named_models, shape_from_hf
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

from tests.conftest import spec_dict

BIG, TINY = "qwen3-next-80b-a3b", "qwen3-next-tiny"


@pytest.mark.parametrize("name", [BIG, TINY])
def test_planner_counts_what_transformers_builds(name):
    """Every parameter of transformers' model (on the meta device: no memory), and the model
    card's 80B total / 3B active (active without the embedding and head: 3.25B)."""
    from transformers import AutoModelForCausalLM

    shape = load_model(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config_object(named_models()[name]["config"]))
    assert total_params(shape) == sum(p.numel() for p in model.parameters())
    if name == BIG:
        vocab = 2 * sum(w.total for w in embedding_weights(shape))  # untied: embedding and output layer
        assert total_params(shape) == 79_674_391_296 and round((active_params(shape) - vocab) / 1e9) == 3


@pytest.mark.parametrize("name", [BIG, TINY])
def test_config_round_trip(name):
    """The family's config.json, read back by transformers' Qwen3NextConfig, is the same shape
    (layer_types written out, partial_rotary_factor kept)."""
    shape = load_model(name)
    written = family_of(shape.architecture).to_hf(shape)
    assert shape_from_hf(written) == shape
    full = hf_config_object(written).to_dict()
    assert shape_from_hf({**full, "architectures": [shape.architecture]}) == shape
    assert shape.linear_attention.layers == (True, True, True, False) * (shape.num_layers // 4)
    assert shape.rotary_fraction == 0.25 and shape.attention_output_gate and shape.zero_centered_norm


def test_layer_types_and_defaults():
    """layer_types wins over full_attention_interval; without either, every 4th layer is full
    (Qwen3NextConfig); partial_rotary_factor defaults to 0.25 as Qwen3NextConfig sets it."""
    base = {k: v for k, v in named_models()[TINY]["config"].items()
            if k not in ("full_attention_interval", "partial_rotary_factor")}
    assert shape_from_hf(base).linear_attention.layers == (True, True, True, False)
    assert shape_from_hf(base).rotary_fraction == 0.25
    mixed = ["full_attention", "linear_attention"] * 2
    assert shape_from_hf({**base, "layer_types": mixed}).linear_attention.layers == (False, True, False, True)
    assert shape_from_hf({**base, "full_attention_interval": 2}).linear_attention.layers == (True, False, True, False)


@pytest.mark.parametrize("change, says", [
    ({"attention_bias": True}, "with attention_bias=true is not supported"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 2},
     "layer_types: 4 entries for 4 layers, unknown ['sliding_attention']"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_bad_configs_are_refused_naming_the_field(change, says):
    with pytest.raises(SpecError) as e:
        shape_from_hf({**named_models()[TINY]["config"], **change})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_megatron_settings():
    """megatron-core's gated delta net (the list form of linear_attention_freq: 1 = delta net),
    the attention output gate, (1 + w) norms, the gated shared expert, rope on a quarter of each
    head; TransformerConfig takes them; Megatron-LM's flags say the same."""
    plan = make_plan(TrainingSpec.from_dict(spec_dict(**{
        "model": BIG, "target": "megatron-lm", "cluster.nodes": 4, "parallel.tp": 2, "parallel.ep": 16,
        "parallel.sequence_parallel": True})))
    assert plan.valid, plan.errors
    kw = transformer_config_kwargs(plan)
    assert kw["experimental_attention_variant"] == "gated_delta_net"
    assert kw["linear_attention_freq"] == [1, 1, 1, 0] * 12
    assert (kw["linear_num_key_heads"], kw["linear_num_value_heads"], kw["linear_key_head_dim"],
            kw["linear_value_head_dim"], kw["linear_conv_kernel_dim"]) == (16, 32, 128, 128, 4)
    assert kw["attention_output_gate"] and kw["layernorm_zero_centered_gamma"] and kw["qk_layernorm"]
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_shared_expert_intermediate_size"],
            kw["moe_shared_expert_gate"], kw["moe_router_pre_softmax"]) == (512, 10, 512, True, False)
    assert gpt_model_kwargs(plan)["rotary_percent"] == 0.25
    config = load_transformer_config(kw, use_cpu_initialization=True)
    assert config.linear_attention_freq == [1, 1, 1, 0] * 12 and config.attention_output_gate
    args = " ".join(megatron_lm_args(plan))
    for flag in ("--experimental-attention-variant gated_delta_net", "--attention-output-gate",
                 "--linear-attention-freq [" + ",".join(["1,1,1,0"] * 12) + "]", "--linear-num-value-heads 32",
                 "--apply-layernorm-1p", "--moe-shared-expert-gate", "--qk-layernorm"):
        assert flag in args, flag


