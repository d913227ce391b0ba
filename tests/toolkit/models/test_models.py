import json

import pytest

from toolkit.errors import SpecError, UnknownNameError
from toolkit.models import (
    UnsupportedArchitectureError,
    active_params,
    family_of,
    hf_config_dict,
    load_model,
    named_models,
    shape_from_hf,
    total_params,
)
from toolkit.models.shape import ModelShape

# Published totals (model cards / papers); exact where the card gives the exact count.
PUBLISHED = {
    "llama3-8b": (8_030_261_248, 0), "llama3.1-8b": (8_030_261_248, 0), "llama2-7b": (6_738_415_616, 0),
    "llama2-13b": (13_015_864_320, 0), "llama2-70b": (68_976_648_192, 0), "mistral-7b": (7_241_732_096, 0),
    "llama3-70b": (70.55e9, 0.001), "llama3.1-405b": (405.85e9, 0.001), "qwen2-0.5b": (494_032_768, 0),
    "qwen2-7b": (7.62e9, 0.002), "qwen2.5-7b": (7.61e9, 0.002), "qwen3-8b": (8.19e9, 0.002),
    "mixtral-8x7b": (46.7e9, 0.002), "mixtral-8x22b": (140.6e9, 0.002), "qwen1.5-moe-a2.7b": (14.3e9, 0.005),
    "qwen2-57b-a14b": (57.41e9, 0.002), "qwen3-30b-a3b": (30.5e9, 0.005), "qwen3-235b-a22b": (235.1e9, 0.002),
    "deepseek-v2-lite": (15.7e9, 0.005), "deepseek-v3": (671e9, 0.002),
    "gemma3-1b": (999_885_952, 0),  # google/gemma-3-1b-it's safetensors total
}
# Gemma 3 technical report (arXiv 2503.19786), Table 1: non-embedding parameters in millions. With the
# post-norms (2 x hidden per layer) left out, 27B would count 25,599.0M.
GEMMA3_NON_EMBEDDING = {"gemma3-1b": 698, "gemma3-4b": 3209, "gemma3-12b": 10759, "gemma3-27b": 25600}
ACTIVE = {"mixtral-8x7b": 12.9e9, "qwen3-30b-a3b": 3.3e9, "qwen3-235b-a22b": 22e9, "deepseek-v3": 37e9,
          "qwen1.5-moe-a2.7b": 2.7e9, "qwen2-57b-a14b": 14e9}


def test_llama3_8b_exact():
    assert total_params(load_model("llama3-8b")) == 8_030_261_248


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    want, tol = PUBLISHED[name]
    got = total_params(load_model(name))
    assert abs(got - want) <= tol * want, f"{name}: {got:,} vs published {want:,.0f}"


@pytest.mark.parametrize("name", sorted(GEMMA3_NON_EMBEDDING))
def test_gemma3_non_embedding_parameters(name):
    s = load_model(name)
    got = (total_params(s) - s.vocab_size * s.hidden_size) / 1e6
    assert abs(got - GEMMA3_NON_EMBEDDING[name]) <= 0.5, f"{name}: {got:.2f}M"


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_active_parameters(name):
    got = active_params(load_model(name))
    assert abs(got - ACTIVE[name]) / ACTIVE[name] < 0.03, f"{name}: {got:,}"


def test_public_names_and_tiny_flavours():
    names = set(named_models())
    assert set(PUBLISHED) <= names
    families = {family_of(load_model(n).architecture).name for n in names}
    for fam in families:  # every family has a tiny flavour
        assert any(family_of(load_model(n).architecture).name == fam and total_params(load_model(n)) < 1e6
                   for n in names), fam


@pytest.mark.parametrize("name", sorted(named_models()))
def test_shape_survives_hf_round_trip(name):
    """ModelShape -> config.json (rebuilt by the family, through transformers) -> ModelShape."""
    shape = load_model(name)
    bare = ModelShape(**{f: getattr(shape, f) for f in ModelShape.__dataclass_fields__ if f != "hf_config"})
    again = shape_from_hf(hf_config_dict(bare))
    assert again == shape


def test_rope_theta_read_from_rope_parameters():
    # transformers 5 keeps rope_theta in rope_parameters; a default here would silently be 10000.
    assert load_model("llama3-8b").rope_theta == 500000.0
    s = load_model("llama3.1-8b")
    assert s.rope_scaling["rope_type"] == "llama3" and s.rope_scaling["factor"] == 8.0


def test_routing_semantics():
    assert not load_model("mixtral-8x7b").moe.pre_softmax  # softmax over the top-k (renormalised)
    assert load_model("qwen1.5-moe-a2.7b").moe.pre_softmax  # softmax over all, not renormalised
    q = load_model("qwen1.5-moe-a2.7b").moe
    assert q.shared_expert_gate and q.shared_ffn_hidden_size == 5632
    v3 = load_model("deepseek-v3").moe
    assert v3.score_function == "sigmoid" and v3.expert_bias and v3.layers[:4] == (False, False, False, True)


def test_load_from_config_file_and_folder(tmp_path):
    cfg = named_models()["qwen3-8b"]["config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(tmp_path)) == load_model("qwen3-8b")
    assert load_model(str(tmp_path / "config.json")).qk_norm


def test_config_without_architectures_is_read_by_its_model_type(tmp_path):
    """transformers' LlamaConfig(...).save_pretrained() writes no "architectures"; the model_type
    says which family (issue 37: it failed with 'exactly one architecture, got []')."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).save_pretrained(tmp_path / "cfg")
    written = json.loads((tmp_path / "cfg" / "config.json").read_text())
    assert "architectures" not in written and written["model_type"] == "llama"
    shape = load_model(str(tmp_path / "cfg"))
    assert shape.architecture == "LlamaForCausalLM" and (shape.num_layers, shape.hidden_size) == (2, 64)
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({**written, "model_type": "gpt2"}))
    with pytest.raises(SpecError, match="names no architecture and its model_type 'gpt2' is not one of .*llama.*; "
                                        "set 'architectures'"):
        load_model(str(tmp_path / "cfg"))


def test_bad_models(tmp_path):
    with pytest.raises(UnknownNameError, match="did you mean 'llama3-70b'"):
        load_model("llama3-70")
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_model(str(tmp_path))
