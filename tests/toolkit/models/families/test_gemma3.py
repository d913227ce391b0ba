"""Gemma 3 (toolkit/models/families/gemma3.py) against transformers' Gemma3ForCausalLM: the planner
counts the parameters transformers builds; the features the conversion parity tests
(tests/support/convert_models.py DENSE "gemma3") rely on change transformers' logits by far more
than the tolerance, so carrying them over is what those tests check; what megatron-core would
compute differently, and a config the tensors contradict, are one-line errors with nothing written."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.parity import max_diff, sample_tokens
from toolkit.cli import main
from toolkit.models.params import total_params
from toolkit.models.registry import hf_config_object, shape_from_hf

from tests.support.convert_checks import TOL
from tests.support.convert_models import VOCAB, hf_config, make_hf


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return root, make_hf("gemma3", root / "hf")


def _logits(hf, **changes) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    config = hf_config_object({**hf_config("gemma3"), **changes})
    model = AutoModelForCausalLM.from_pretrained(str(hf), config=config, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=sample_tokens(VOCAB)).logits


def test_planner_counts_what_transformers_builds(gemma):
    from transformers import AutoModelForCausalLM

    _, hf = gemma
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert total_params(shape_from_hf(hf_config("gemma3"))) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("change", [
    {"sliding_window": 4096},  # every layer sees all 64 tokens instead of 16
    {"rope_local_base_freq": 1e6},  # the sliding layers rotate with the global base
    {"rope_scaling": None},  # the global layer without linear scaling 8
    {"query_pre_attn_scalar": 32},  # scores scaled by 1/sqrt(head_dim) instead of 1/sqrt(24)
], ids=lambda c: next(iter(c)))
def test_features_change_the_logits(gemma, change):
    _, hf = gemma
    assert max_diff(_logits(hf, **change), _logits(hf)) > 10 * TOL


def _variant(root, hf, name: str, edit_tensors=None, **changes):
    d = root / name
    shutil.copytree(hf, d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))
    if edit_tensors:
        tensors = load_file(d / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _convert(capsys, src, out) -> tuple[int, str]:
    code = main(["convert", "hf-to-megatron", str(src), str(out), "--tp", "1", "--pp", "1"])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("changes, named", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
], ids=["final-softcap", "attn-softcap", "bidirectional", "local-rope-scaling", "activation"])
def test_unsupported_variants_are_refused(gemma, capsys, tmp_path, changes, named):
    root, hf = gemma
    src = _variant(root, hf, "v-" + next(iter(changes)), **changes)
    code, err = _convert(capsys, src, tmp_path / "out")
    assert code == 2 and len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / "out").exists() and not any(tmp_path.iterdir())


def test_config_contradicting_the_tensors(gemma, capsys, tmp_path):
    """A checkpoint without post-norms (Gemma 1/2-style layers under a Gemma 3 config) and a config
    whose head_dim the tensors do not have: one line naming the tensor, nothing written."""
    root, hf = gemma
    no_post = _variant(root, hf, "no-post", lambda t: [t.pop(k) for k in list(t) if "post_feedforward" in k])
    code, err = _convert(capsys, no_post, tmp_path / "a")
    assert code == 1 and len(err.splitlines()) == 1 and "post_feedforward_layernorm.weight" in err, (code, err)
    narrow = _variant(root, hf, "narrow", head_dim=16)
    code, err = _convert(capsys, narrow, tmp_path / "b")
    assert code == 1 and len(err.splitlines()) == 1, (code, err)
    assert "'model.layers.0.self_attn.o_proj.weight' has shape [64, 128], expected [64, 64]" in err
    assert not any(tmp_path.iterdir())
