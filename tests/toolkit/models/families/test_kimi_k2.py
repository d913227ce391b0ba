"""Kimi-K2 is DeepSeek-V3's architecture (transformers' DeepseekV3ForCausalLM) at 384 experts,
one dense layer, no expert groups, routed scaling 2.827 and yarn rope with beta_fast =
beta_slow = 1; its config.json names the type ``kimi_k2`` (Moonshot's remote-code copy of
DeepSeek's DeepseekV3Config), read as ``deepseek_v3`` (Family.config_types). The conversion
proof is DeepSeek-V3's: the tiny flavour at Kimi's settings runs through
tests/test_convert_deepseek.py (round trips, parity with megatron-core at tp=2, pp=2, ep=2
and torch_dist, FP8 dequantisation); here: the named model, the settings that flavour relies
on are observable, and a ``kimi_k2`` checkpoint converts as the same model."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import converters
from converters.parity import hf_logits, max_diff, sample_tokens
from toolkit.models import load_model, named_models
from toolkit.models.family import check_convertible, config_type, family_of
from toolkit.models.params import active_params, total_params
from toolkit.models.registry import shape_from_hf

from tests.support.convert_checks import TOL
from tests.support.convert_models import VOCAB
from tests.support.deepseek_models import make_hf
from tests.converters.test_roundtrip import assert_identical
from tests.toolkit.models.families.test_glm4_moe import full_size_params

# Moonshot's model card: 1T total, 32B activated parameters; the planner counts 1.026T / 32.9B
PUBLISHED_TOTAL, PUBLISHED_ACTIVE = 1.0e12, 32e9


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    return root, make_hf("kimi_k2", root / "hf")


def test_named_model_is_deepseek_v3_at_kimis_settings():
    s = load_model("kimi-k2-base")
    assert config_type("kimi_k2") == "deepseek_v3" and family_of(s.architecture).name == "deepseek_v3"
    m = s.moe
    assert (m.num_experts, m.topk, m.num_groups, m.topk_scaling_factor, m.layers[:2]) == (384, 8, None, 2.827,
                                                                                        (False, True))
    assert m.score_function == "sigmoid" and m.expert_bias and s.mtp_layers == 0
    assert s.rope_scaling["beta_fast"] == s.rope_scaling["beta_slow"] == 1.0
    check_convertible(s)
    cfg = named_models()["kimi-k2-base"]["config"]
    assert s == shape_from_hf({**cfg, "model_type": "deepseek_v3"})  # read exactly as DeepSeek-V3's config


def test_planner_counts_the_full_size_model_transformers_builds():
    assert total_params(load_model("kimi-k2-base")) == full_size_params("kimi-k2-base")


def test_published_sizes():
    s = load_model("kimi-k2-base")
    assert abs(total_params(s) - PUBLISHED_TOTAL) <= 0.03 * PUBLISHED_TOTAL, f"{total_params(s):,}"
    assert abs(active_params(s) - PUBLISHED_ACTIVE) <= 0.03 * PUBLISHED_ACTIVE, f"{active_params(s):,}"


def _with_config(root, hf, name: str, **changes):
    d = root / name
    shutil.copytree(hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_kimis_rope_and_scaling_are_observable(kimi):
    """Kimi's yarn (beta_fast = beta_slow = 1) and routed scaling change these logits by over 10x
    the tolerance, so the DeepSeek parity of the tiny flavour checks they are carried over."""
    root, hf = kimi
    tokens = sample_tokens(VOCAB)
    ref = hf_logits(hf, tokens)
    plain = _with_config(root, hf, "plain-rope", rope_scaling=None, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 50000.0})
    betas = _with_config(root, hf, "v3-betas", rope_scaling=None, rope_parameters={
        **json.loads((hf / "config.json").read_text())["rope_parameters"], "beta_fast": 32.0})
    scale = _with_config(root, hf, "no-scaling", routed_scaling_factor=1.0)
    for other in (plain, betas, scale):
        assert max_diff(ref, hf_logits(other, tokens)) > 10 * TOL, other.name


def test_a_kimi_k2_checkpoint_converts_as_deepseek_v3(kimi, tmp_path):
    """config.json with model_type kimi_k2 (as Moonshot publishes it): the same megatron
    checkpoint as the deepseek_v3-typed one, the same transformers logits, and back to the
    original bits and config."""
    root, hf = kimi
    typed = _with_config(root, hf, "kimi-typed", model_type="kimi_k2")
    a = converters.hf_to_megatron(typed, tmp_path / "a", tp=2, pp=1, ep=2)
    b = converters.hf_to_megatron(hf, tmp_path / "b", tp=2, pp=1, ep=2)
    files = sorted(p.relative_to(a) for p in a.rglob("*.pt"))
    assert files == sorted(p.relative_to(b) for p in b.rglob("*.pt")) and files
    for f in files:
        ma, mb = (torch.load(d / f, weights_only=False)["model"] for d in (a, b))
        assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma if torch.is_tensor(ma[k]))
    tokens = sample_tokens(VOCAB)  # transformers builds it as DeepSeek-V3 (the logits `toolkit verify` compares)
    assert torch.equal(hf_logits(typed, tokens), hf_logits(hf, tokens))
    out = converters.megatron_to_hf(a, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k2"
    assert_identical(typed, out)
