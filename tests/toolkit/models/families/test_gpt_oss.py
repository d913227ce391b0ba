"""GPT-OSS (toolkit/models/families/gpt_oss.py) against transformers' GptOssForCausalLM: the
planner counts the parameters transformers builds (and OpenAI's published totals); each feature
the conversion parity tests (tests/support/convert_models.py MOE "gpt_oss") rely on changes
transformers' logits by far more than the tolerance, so carrying it over is what those tests
check; the megatron-core settings each feature becomes; what megatron-core computes
differently, and checkpoints the converters cannot read, are refused with the field named."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import converters
from converters.errors import ConversionSetupError, TensorShapeError, UnsupportedModelError
from converters.layout import conversion_plan, validate_layout
from converters.parity import hf_logits, max_diff, sample_tokens
from toolkit.backends.megatron import load_transformer_config
from toolkit.emit.megatron import gpt_model_kwargs, transformer_config_kwargs
from toolkit.errors import PlanError
from toolkit.models import load_model
from toolkit.models.family import check_convertible, family_of
from toolkit.models.params import active_params, embedding_weights, total_params
from toolkit.models.registry import shape_from_hf
from toolkit.parallel.layout import Layout

from tests.support.convert_checks import TOL
from tests.support.convert_models import VOCAB, hf_config, make_hf

# OpenAI's model card: total and active parameters (active: without the embedding)
PUBLISHED = {"gpt-oss-20b": (20.91e9, 3.61e9), "gpt-oss-120b": (116.83e9, 5.13e9)}


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    return root, make_hf("gpt_oss", root / "hf")


def _variant(root, hf, name: str, **changes):
    d = root / name
    shutil.copytree(hf, d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _tensors(root, hf, name: str, edit):
    d = _variant(root, hf, name)
    t = load_file(d / "model.safetensors")
    edit(t)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return d


def test_planner_counts_what_transformers_builds(oss):
    from transformers import AutoModelForCausalLM

    _, hf = oss
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert total_params(shape_from_hf(hf_config("gpt_oss"))) == sum(p.numel() for p in model.parameters())
    for name, (total, active) in PUBLISHED.items():
        shape = load_model(name)
        embedding = sum(w.total for w in embedding_weights(shape))
        assert round(total_params(shape) / 1e7) == round(total / 1e7), name
        assert round((active_params(shape) - embedding) / 1e7) == round(active / 1e7), name


@pytest.mark.parametrize("change", [
    {"layer_types": ["full_attention"] * 4},  # no sliding window
    {"layer_types": ["full_attention", "sliding_attention"] * 2},  # the window on the other layers
    {"swiglu_limit": 7.0},  # the clamp (limit 0.5 in the tiny test model) left out
    {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},  # no yarn
])
def test_features_are_observable(oss, change):
    root, hf = oss
    tokens = sample_tokens(VOCAB)
    changed = _variant(root, hf, "-".join(change), **change)
    assert max_diff(hf_logits(hf, tokens), hf_logits(changed, tokens)) > 10 * TOL


@pytest.mark.parametrize("tensor", ["self_attn.sinks", "mlp.router.bias", "mlp.experts.gate_up_proj_bias"])
def test_sinks_and_biases_are_observable(oss, tensor):
    root, hf = oss
    d = _tensors(root, hf, f"no-{tensor}", lambda t: t.update({k: torch.zeros_like(v) for k, v in t.items()
                                                                if k.endswith(tensor)}))
    tokens = sample_tokens(VOCAB)
    assert max_diff(hf_logits(hf, tokens), hf_logits(d, tokens)) > 10 * TOL


def test_megatron_settings():
    """Each feature as megatron-core takes it: the window on HF's sliding layers (0 and 2:
    megatron's 1-indexed layer numbers 1 and 3) of 16 tokens = the query and 15 before it,
    learned sinks, quick_gelu GLU with the clamp and the +1, biases, yarn on GPTModel."""
    shape = shape_from_hf(hf_config("gpt_oss"))
    plan = conversion_plan(shape, Layout(tp=1, pp=1), seq_len=64)
    kw = transformer_config_kwargs(plan)
    assert kw["window_size"] == [15, 0] and kw["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert (kw["softmax_type"], kw["activation_func"], kw["activation_func_clamp_value"], kw["glu_linear_offset"],
            kw["add_bias_linear"], kw["gated_linear_unit"]) == ("learnable", "quick_gelu", 0.5, 1.0, True, True)
    assert gpt_model_kwargs(plan)["position_embedding_type"] == "yarn"
    config = load_transformer_config(kw, use_cpu_initialization=True)
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.utils import is_layer_window_attention

    assert config.activation_func is quick_gelu
    assert [is_layer_window_attention(config.window_size, config.window_attn_skip_freq, n) for n in range(1, 5)] == \
        [True, False, True, False]
    assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings,
            config.yarn_correction_range_round_to_int) == (32.0, 128, False)
    assert family_of(shape.architecture).to_hf(shape)["layer_types"] == hf_config("gpt_oss")["layer_types"]
    assert shape_from_hf(family_of(shape.architecture).to_hf(shape)) == shape


def test_what_megatron_computes_differently_is_refused(tmp_path):
    base = hf_config("gpt_oss")
    with pytest.raises(UnsupportedModelError, match=r"swiglu_alpha=1.5: megatron-core's quick_gelu fixes the "
                                                    r"sigmoid gain at 1.702"):
        check_convertible(shape_from_hf({**base, "swiglu_alpha": 1.5}))
    with pytest.raises(UnsupportedModelError, match="attention_bias=false"):
        check_convertible(shape_from_hf({**base, "attention_bias": False}))
    with pytest.raises(PlanError, match=r"etp=2: megatron-core builds experts with biases \(linear_bias\) only at "
                                        r"expert tensor parallelism 1"):
        validate_layout(shape_from_hf(base), Layout(tp=2, pp=1))
    validate_layout(shape_from_hf(base), Layout(tp=2, pp=1, ep=2, etp=1))


def test_stored_experts_land_in_megatron_order(oss, tmp_path):
    """gate_up_proj [E, hidden, 2 ffn]: its even columns are expert e's gate, its odd ones the
    linear half, as [in, out]; megatron's linear_fc1 is [gate; up] as [out, in] (tp=2: each rank
    its half of each), and down_proj [E, ffn, hidden] is linear_fc2 transposed."""
    _, hf = oss
    src = load_file(hf / "model.safetensors")
    mg = converters.hf_to_megatron(hf, tmp_path / "mg", tp=2, pp=1, ep=2, etp=1)
    rank = torch.load(mg / "release/mp_rank_01_001/model_optim_rng.pt", weights_only=False)["model"]
    gate_up, bias = src["model.layers.3.mlp.experts.gate_up_proj"][5], src["model.layers.3.mlp.experts.gate_up_proj_bias"][5]
    fc1 = rank["decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight"]  # expert 5 = ep rank 1, local 1
    assert torch.equal(fc1, torch.cat([gate_up[:, 0::2].T, gate_up[:, 1::2].T]))
    assert torch.equal(rank["decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.bias"],
                       torch.cat([bias[0::2], bias[1::2]]))
    assert torch.equal(rank["decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight"],
                       src["model.layers.3.mlp.experts.down_proj"][5].T)
    assert torch.equal(rank["decoder.layers.3.self_attention.core_attention.softmax_offset"],
                       src["model.layers.3.self_attn.sinks"][2:])  # tp rank 1: heads 2 and 3


def test_bad_checkpoints_are_refused(oss, tmp_path, capsys):
    """Another quantisation (GPTQ) and experts stored in another shape: one line naming the field
    or the tensor, nothing written."""
    from toolkit.cli import main

    root, hf = oss
    gptq = _variant(root, hf, "gptq", quantization_config={"quant_method": "gptq"})
    with pytest.raises(ConversionSetupError, match=r"quantization_config \{'quant_method': 'gptq'\} is not "
                                                   r"supported"):
        converters.hf_to_megatron(gptq, tmp_path / "o", tp=1, pp=1)
    bad = _tensors(root, hf, "wide", lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj":
                                                         torch.zeros(8, 64, 32)}))
    with pytest.raises(TensorShapeError, match=r"tensor 'model.layers.1.mlp.experts.gate_up_proj' has shape "
                                               r"\[8, 64, 32\], expected \[8, 64, 64\]"):
        converters.hf_to_megatron(bad, tmp_path / "o", tp=1, pp=1)
    code = main(["convert", "hf-to-megatron", str(bad), str(tmp_path / "o"), "--tp", "1", "--pp", "1"])
    err = capsys.readouterr().err.strip()
    assert code == TensorShapeError.exit_code == 1 and len(err.splitlines()) == 1 and "gate_up_proj" in err, err
    assert not (tmp_path / "o").exists()


def test_hf_trainer_states_are_refused_for_packed_experts():
    """The runtime -> HF Trainer conversion cuts optimizer states per HF parameter; GPT-OSS's
    packed experts have no such route yet: refused, naming why (before anything is written)."""
    from toolkit.runstate.hf_trainer import _check_unpacked

    with pytest.raises(UnsupportedModelError, match="packs the experts' tensors"):
        _check_unpacked(load_model("gpt-oss-tiny"))
    _check_unpacked(load_model("mixtral-tiny"))


def test_planner_counts_only_the_window():
    """Sliding-window layers attend to w keys, not s/2: the attention core's FLOPs (model FLOPs
    and flash attention's time) count w (1 - w / 2s) keys per query on the windowed half of
    GPT-OSS's layers (toolkit.estimate counts them layer by layer), the mean of min(i + 1, w) over the positions; megatron's unfused local
    attention masks the full score matrix, so its time does not change."""
    from dataclasses import replace

    from toolkit.estimate import compute as C
    from toolkit.estimate.time import forward_flops_per_token

    shape, seq = load_model("gpt-oss-120b"), 4096
    full = replace(shape, sliding_window=None, window_layers=None)
    exact = sum(min(i + 1, 128) for i in range(seq)) / seq
    assert C.attended_keys(seq, 128) == pytest.approx(exact, rel=1e-3)
    assert sum(shape.is_window_layer(i) for i in range(shape.num_layers)) == shape.num_layers // 2
    core = forward_flops_per_token(shape, seq)[1]
    assert core == pytest.approx(forward_flops_per_token(full, seq)[1] * (seq / 2 + exact) / seq, rel=1e-3)
    assert forward_flops_per_token(full, seq)[0] - forward_flops_per_token(shape, seq)[0] == pytest.approx(
        forward_flops_per_token(full, seq)[1] - core)
    dm = C.model_dims(shape)
    assert C.attention_flops(dm, seq, seq, 1, 128) / C.attention_flops(dm, seq, seq, 1) == pytest.approx(
        exact / (seq / 2), rel=1e-3)
    assert C.attended_keys(64, 128) == 32  # a window as long as the sequence changes nothing


def _mxfp4_checkpoint(hf, d):
    """The tiny model with its experts' weights as MXFP4 (random codes and scales around 2^0, the
    hub's tensor names and quantization_config) and everything else in bf16; returns the
    dequantised experts as transformers' convert_moe_packed_tensors computes them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    t, g, expected = load_file(hf / "model.safetensors"), torch.Generator().manual_seed(1), {}
    for k in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = t.pop(k).shape  # [E, in, out]
        t[k + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        t[k + "_scales"] = torch.randint(120, 131, (experts, rows, cols // 32), dtype=torch.uint8, generator=g)
        expected[k] = convert_moe_packed_tensors(t[k + "_blocks"], t[k + "_scales"], dtype=torch.bfloat16)
    d.mkdir()
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in t.items()},
              d / "model.safetensors", metadata={"format": "pt"})
    return expected


def test_mxfp4_experts_are_dequantised_as_transformers_does(oss, tmp_path, capsys):
    """The hub's MXFP4 experts, dequantised an expert at a time on import (at ep=2): the exported
    bf16 checkpoint holds, tensor for tensor, what transformers' own MXFP4 loading
    (Mxfp4Config(dequantize=True)) builds, and says nothing of MXFP4; a wrong blocks shape is
    named."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    _, hf = oss
    d = tmp_path / "mxfp4"
    expected = _mxfp4_checkpoint(hf, d)
    back = converters.megatron_to_hf(converters.hf_to_megatron(d, tmp_path / "mg", tp=1, pp=1, ep=2), tmp_path / "hf")
    got = load_file(back / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    theirs = AutoModelForCausalLM.from_pretrained(d, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.bfloat16).state_dict()
    assert theirs.keys() - {"lm_head.weight"} <= got.keys() and all(torch.equal(theirs[k], got[k]) for k in got)
    from toolkit.cli import main

    assert main(["convert", "hf-to-megatron", str(d), str(tmp_path / "cli"), "--tp", "1", "--pp", "1"]) == 0
    assert "MXFP4 experts (32-value blocks, power-of-two scales): dequantised to bf16" in capsys.readouterr().err
    t = load_file(d / "model.safetensors")
    t["model.layers.2.mlp.experts.down_proj_blocks"] = t["model.layers.2.mlp.experts.down_proj_blocks"][:, :, :, :8].contiguous()
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TensorShapeError, match=r"tensor 'model.layers.2.mlp.experts.down_proj_blocks' has shape "
                                               r"\[8, 64, 1, 8\], expected \[8, 64, 1, 16\]"):
        converters.hf_to_megatron(d, tmp_path / "bad", tp=1, pp=1)
    assert not (tmp_path / "bad").exists()
