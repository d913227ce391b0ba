"""GLM-4.5 (toolkit/models/families/glm4_moe.py) against transformers' Glm4MoeForCausalLM:
the planner counts the parameters transformers builds; the features the conversion parity
tests (tests/convert_models.py MOE "glm4_moe") rely on change transformers' logits by far
more than the tolerance, so carrying them over is what those tests check; what megatron-core
computes differently is refused with the numbers; the named models' published sizes."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import converters
from converters.errors import CheckpointError, UnsupportedModelError
from converters.parity import hf_logits, max_diff, sample_tokens
from toolkit.models import load_model
from toolkit.models.family import check_convertible
from toolkit.models.params import (
    active_params,
    embedding_weights,
    head_weights,
    total_params,
)
from toolkit.models.registry import shape_from_hf

from tests.support.convert_checks import TOL
from tests.support.convert_models import VOCAB, hf_config, make_hf

# published total / active parameters (billions, rounded by the publisher; active without the
# embedding and output layer); the planner counts the model without its MTP layer
PUBLISHED = {"glm-4.5-air": (106e9, 12e9), "glm-4.5": (355e9, 32e9)}


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    return root, make_hf("glm4_moe", root / "hf")


def _variant(root, hf, name: str, **changes):
    d = root / name
    shutil.copytree(hf, d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_planner_counts_what_transformers_builds(glm):
    from transformers import AutoModelForCausalLM

    _, hf = glm
    model = AutoModelForCausalLM.from_pretrained(hf)
    shape = shape_from_hf(hf_config("glm4_moe"))
    assert total_params(shape) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("change", [
    {"partial_rotary_factor": 1.0},  # rope on every dim instead of the first half
    {"routed_scaling_factor": 1.0},
])
def test_features_are_observable(glm, change):
    root, hf = glm
    tokens = sample_tokens(VOCAB)
    key = next(iter(change))
    changed = _variant(root, hf, key, **change)
    if key == "partial_rotary_factor":  # transformers reads it from rope_parameters when present
        cfg = json.loads((changed / "config.json").read_text())
        cfg["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": 1.0}
        (changed / "config.json").write_text(json.dumps(cfg))
    assert max_diff(hf_logits(hf, tokens), hf_logits(changed, tokens)) > 10 * TOL


def test_expert_bias_is_observable(glm, tmp_path):
    """The random e_score_correction_bias (tests/convert_models.randomize) changes the routing."""
    from safetensors.torch import load_file, save_file

    root, hf = glm
    d = _variant(root, hf, "no-bias")
    t = load_file(d / "model.safetensors")
    for k in [k for k in t if k.endswith("e_score_correction_bias")]:
        t[k] = torch.zeros_like(t[k])
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    tokens = sample_tokens(VOCAB)
    assert max_diff(hf_logits(hf, tokens), hf_logits(d, tokens)) > 10 * TOL


def test_what_megatron_computes_differently_is_refused():
    base = hf_config("glm4_moe")
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob=false with top-2 sigmoid routing"):
        check_convertible(shape_from_hf({**base, "norm_topk_prob": False}))
    with pytest.raises(UnsupportedModelError, match=r"n_group=2, topk_group=1, num_experts_per_tok=4\): "
                                                    r"megatron-core ranks a group by the sum of its top topk // "
                                                    r"group_topk = 4 scores, transformers' Glm4Moe by its top 2"):
        check_convertible(shape_from_hf({**base, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 4}))
    check_convertible(shape_from_hf({**base, "n_group": 2, "topk_group": 1}))  # top 2 // 1: transformers' top-2 sum


def test_mtp_layer_converts_bit_for_bit(glm, tmp_path):
    """A GLM checkpoint with its MTP layer (HF layer num_hidden_layers, DeepSeek-V3's names):
    megatron-core's mtp.layers.0 holds it, args say mtp_num_layers=1, and every layout and
    format gives the original bits back; an MTP embedding copy that differs is refused."""
    from safetensors.torch import load_file, save_file

    from tests.support.deepseek_models import mtp_tensors
    from tests.converters.test_roundtrip import assert_identical

    _, hf = glm
    d = _variant(tmp_path, hf, "mtp", num_nextn_predict_layers=1)  # as GLM-4.5's config says
    state = load_file(d / "model.safetensors")
    extra = mtp_tensors(hf_config("glm4_moe"), state, tmp_path / "deeper")
    assert "model.layers.4.mlp.experts.7.down_proj.weight" in extra and "model.layers.4.self_attn.q_norm.weight" in extra
    save_file({**state, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    mg = converters.hf_to_megatron(d, tmp_path / "mg", tp=1, pp=2, ep=2)
    last = torch.load(mg / "release/mp_rank_00_001_001/model_optim_rng.pt", weights_only=False)
    assert last["args"].mtp_num_layers == 1
    assert torch.equal(last["model"]["mtp.layers.0.eh_proj.weight"], extra["model.layers.4.eh_proj.weight"])
    assert torch.equal(last["model"]["mtp.layers.0.transformer_layer.self_attention.q_layernorm.weight"],
                       extra["model.layers.4.self_attn.q_norm.weight"])
    for kw in ({"tp": 2, "pp": 1, "ep": 2}, {"tp": 1, "pp": 2, "fmt": "torch_dist"}):
        out = converters.hf_to_megatron(d, tmp_path / f"mg-{len(kw)}-{kw['tp']}", **kw)
        back = converters.megatron_to_hf(out, tmp_path / f"hf-{len(kw)}-{kw['tp']}")
        assert_identical(d, back)
        assert json.loads((back / "config.json").read_text())["num_nextn_predict_layers"] == 1
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    t = load_file(bad / "model.safetensors")
    t["model.layers.4.embed_tokens.weight"] = t["model.layers.4.embed_tokens.weight"] + 1
    save_file(t, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'model.layers.4.embed_tokens.weight' differs from "
                                              "'model.embed_tokens.weight'"):
        converters.hf_to_megatron(bad, tmp_path / "o", tp=1, pp=1)


def full_size_params(name: str) -> int:
    """Parameters of transformers' own model of a named config, built on the meta device."""
    from transformers import AutoModelForCausalLM

    from toolkit.models import named_models
    from toolkit.models.registry import hf_config_object

    cfg = {k: v for k, v in named_models()[name]["config"].items() if k != "quantization_config"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config_object(cfg))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_planner_counts_the_full_size_model_transformers_builds(name):
    assert total_params(load_model(name)) == full_size_params(name)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_sizes(name):
    shape = load_model(name)
    total, active = PUBLISHED[name]
    emb = sum(w.total for w in embedding_weights(shape) + head_weights(shape)) - shape.hidden_size  # not the norm
    assert abs(total_params(shape) - total) <= 0.01 * total, f"{total_params(shape):,}"
    assert abs(active_params(shape) - emb - active) <= 0.02 * active, f"{active_params(shape) - emb:,}"


def test_named_models_read_as_published():
    air, big = load_model("glm-4.5-air"), load_model("glm-4.5")
    assert air.rotary_fraction == big.rotary_fraction == 0.5 and air.qkv_bias and big.qkv_bias
    assert not air.qk_norm and big.qk_norm and air.head_dim * air.num_attention_heads == 3 * air.hidden_size
    assert air.moe.layers[:2] == (False, True) and big.moe.layers[:4] == (False, False, False, True)
    assert big.moe.topk_scaling_factor == 2.5 and big.moe.expert_bias and big.moe.score_function == "sigmoid"


AIR_SPEC = """model: glm-4.5-air
cluster: {nodes: 8, gpus_per_node: 8, gpu: h100-80gb}
parallel: {tp: 2, pp: 2, ep: 8, sequence_parallel: true}
zero: {stage: 1}
precision: bf16
batch: {micro: 1, global: 512, seq_len: 4096}
recompute: selective
moe: {token_dispatcher: alltoall, grouped_gemm: true}
optimizer: {lr: 1.0e-4, min_lr: 1.0e-5, warmup_steps: 500}
train: {steps: 50000}
"""


@pytest.mark.parametrize("target", ["recipes", "megatron-lm"])
def test_plan_of_glm45_air(tmp_path, capsys, target):
    """`toolkit plan` on GLM-4.5-Air at tp=2 pp=2 ep=8 on 64 H100: valid, the parameters transformers builds."""
    from toolkit.cli import main

    spec = tmp_path / "air.yaml"
    spec.write_text(AIR_SPEC)
    assert main(["plan", str(spec), "--json", "--set", f"target={target}"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert "106852245504" in json.dumps(plan) and "Glm4MoeForCausalLM" in json.dumps(plan)


@pytest.mark.parametrize("model", ["glm-4.5-air", "glm-4.5", "qwen1.5-moe-a2.7b"])
def test_megatron_lm_flags_alone_name_the_architecture(model):
    """A Megatron-LM checkpoint without an HF config: GLM-4.5-Air's switches (MoE, shared
    expert, QKV bias, no QK norm) are Qwen2-MoE's but for its partial rope, which tells them apart."""
    from converters.megatron_args import megatron_args, shape_from_args
    from toolkit.models import load_model
    from toolkit.parallel.layout import Layout

    shape = load_model(model)
    args = megatron_args(shape, Layout(), dtype=torch.bfloat16, fmt="torch_dist")
    del args.hf_config, args.hf_architecture
    assert shape_from_args(args).architecture == shape.architecture
