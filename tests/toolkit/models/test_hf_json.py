"""config.json read as JSON (toolkit.models.hf_json) gives the shapes transformers' own
config objects give: every named model, each with every key left out in turn (so the
class defaults are used), and the rope forms transformers normalises."""
import pytest

from toolkit.models import family_of, named_models
from toolkit.models.hf_json import hf_view
from toolkit.models.registry import hf_config_object
from tools.sync_hf_defaults import main as sync_defaults

KEPT = {"architectures", "model_type"}
ROPE_FORMS = {
    "legacy theta": {"rope_theta": 123456.0},
    "legacy linear": {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "yarn outside": {"rope_scaling": {"type": "yarn", "factor": 4.0}, "original_max_position_embeddings": 4096},
    "transformers 5": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "none": {"rope_theta": None, "rope_scaling": None},
}


def both(cfg: dict):
    """(shape from JSON, shape from transformers), or None when transformers refuses the config."""
    fam = family_of(cfg["architectures"][0])
    try:
        want = fam.from_hf(hf_config_object(cfg))
    except Exception:  # noqa: BLE001  (transformers' validation: nothing to compare)
        return None
    return fam.from_hf(hf_view(cfg)), want


def test_defaults_file_matches_installed_transformers():
    assert sync_defaults(["--check"]) == 0, "run `python tools/sync_hf_defaults.py`"


@pytest.mark.parametrize("name", sorted(named_models()))
def test_named_model_with_each_key_left_out(name):
    cfg = named_models()[name]["config"]
    compared = 0
    for left_out in [None, *sorted(set(cfg) - KEPT)]:
        pair = both({k: v for k, v in cfg.items() if k != left_out})
        if pair is not None:
            assert pair[0] == pair[1], f"{name} without {left_out}"
            compared += 1
    assert compared >= len(cfg) // 2


@pytest.mark.parametrize("form", sorted(ROPE_FORMS))
def test_rope_forms(form):
    for name in ("llama3-8b", "qwen3-8b", "deepseek-v3-tiny"):
        cfg = {k: v for k, v in named_models()[name]["config"].items() if k not in ("rope_theta", "rope_scaling")}
        pair = both({**cfg, **ROPE_FORMS[form]})
        if pair is not None:
            assert pair[0] == pair[1], f"{name}, {form}"


LAYER_TYPE_ROPE_FORMS = {  # Gemma 3: a rope base per attention kind
    "legacy local base": {"rope_local_base_freq": 3e4, "rope_theta": 5e5, "rope_scaling": {"rope_type": "linear",
                                                                                          "factor": 4.0}},
    "transformers 5": {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}},
    "defaults": {},
}


@pytest.mark.parametrize("form", sorted(LAYER_TYPE_ROPE_FORMS))
def test_layer_type_rope_forms(form):
    cfg = {k: v for k, v in named_models()["gemma3-4b"]["config"].items()
           if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq")}
    got, want = both({**cfg, **LAYER_TYPE_ROPE_FORMS[form]})
    assert got == want
    assert (got.rope_theta, got.local_rope_theta) == {"defaults": (1e6, 1e4), "transformers 5": (5e5, 2e4),
                                                      "legacy local base": (5e5, 3e4)}[form]
