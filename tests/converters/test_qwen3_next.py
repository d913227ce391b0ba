"""Qwen3-Next conversion (toolkit/models/families/qwen3_next.py): a random tiny Qwen3NextForCausalLM
(gated delta net layers 1-3, gated attention 4, (1 + w) norms, gated norm w around 1, 8 experts
with a gated shared expert) converted to megatron's legacy torch format at tp1, ep2, pp2, tp2
(sequence parallel) and tp2 ep2 (etp1), and to torch_dist at tp2 ep2 (etp1: in_proj and conv1d one key
per part, as GatedDeltaNet.sharded_state_dict stores them) loaded by megatron at pp2 (its
dist_checkpointing.load, strict);
megatron-core's GPTModel (its GatedDeltaNet through the CPU shim, toolkit.mcore.gated_delta_net)
computes transformers' logits; exports and reshards (torch_dist included) are bit-exact. One 1-rank
and one 2-rank launch."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import converters
from converters.parity import hf_logits, max_diff, megatron_logits, sample_tokens

from tests.support.convert_models import NEXT, VOCAB, make_hf

TOL = 1e-5
LAYOUTS = {"tp1": {}, "ep2": {"ep": 2}, "pp2": {"pp": 2}, "tp2": {"tp": 2}, "tp2ep2": {"tp": 2, "ep": 2, "etp": 1},
           "dist": {"tp": 2, "ep": 2, "etp": 1, "fmt": "torch_dist"}}
LOADED = {"dist": {"pp": 2}}  # torch_dist: megatron reshards at load


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next")
    hf = make_hf("qwen3_next", root / "hf", NEXT)
    out = {name: converters.hf_to_megatron(hf, root / name, **kw) for name, kw in LAYOUTS.items()}
    return root, hf, out


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_megatron_computes_transformers_logits(converted):
    _, hf, out = converted
    tokens = sample_tokens(VOCAB)
    ref = hf_logits(hf, tokens)
    got = megatron_logits([{"megatron_dir": str(out["tp1"])}], 1)
    got += megatron_logits([{"megatron_dir": str(out[name]), **({"layout": LOADED[name]} if name in LOADED else {})}
                            for name in list(LAYOUTS)[1:]], 2)
    diffs = {name: max_diff(logits, ref) for name, logits in zip(LAYOUTS, got)}
    print("qwen3_next max |dlogit| against transformers:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert all(d <= TOL for d in diffs.values()), diffs
    assert ref.abs().max() > 100 * TOL


def test_round_trips_are_bit_exact(converted):
    root, hf, out = converted
    want = hf_tensors(hf)
    back = converters.megatron_to_hf(out["ep2"], root / "back")
    got = hf_tensors(back)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    for src, kw in (("pp2", {"ep": 2}), ("tp2ep2", {"pp": 2}), ("tp1", {"tp": 2})):
        resharded = converters.megatron_to_megatron(out[src], root / f"{src}-resharded", **kw)
        again = hf_tensors(converters.megatron_to_hf(resharded, root / f"{src}-back"))
        assert all(torch.equal(again[k], want[k]) for k in want), src
    for name in ("tp2", "dist"):
        back = hf_tensors(converters.megatron_to_hf(out[name], root / f"{name}-back"))
        assert all(torch.equal(back[k], want[k]) for k in want), name
    legacy = converters.megatron_to_megatron(out["dist"], root / "dist-legacy", fmt="torch", tp=1, ep=2)
    again = converters.megatron_to_megatron(legacy, root / "legacy-dist", fmt="torch_dist", tp=2)
    got = hf_tensors(converters.megatron_to_hf(again, root / "again"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    norm = "model.layers.0.linear_attn.norm.weight"
    assert 0.5 < want[norm].min() and want[norm].max() < 2  # stored in megatron as w - 1: exact there
