"""Qwen3-Next's multi-token prediction module (``mtp.*``, which transformers drops on load) through
the converters: a random tiny Qwen3NextForCausalLM with the module added as the hub's checkpoints
name it (tests.support.qwen3_next_mtp), converted to megatron's torch format at tp1, tp2, pp2, ep2,
pp2 vpp2 and pp2 split 3 + 1, and to torch_dist at tp2 ep2 (etp1); megatron-core's own
MultiTokenPredictionLayer (GPTModel's MTP block, local spec, tp1 in this process) fed the
converted weights computes the MTP logits vLLM's Qwen3NextMultiTokenPredictor computes from the
HF tensors, and in training its logged loss and its gradients follow; exports and reshards are
bit-exact."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import converters
from converters.errors import CheckpointError
from converters.parity import max_diff, sample_tokens
from toolkit.errors import UnsupportedModelError

from tests.support.convert_models import VOCAB
from tests.support.qwen3_next_mtp import make_hf_with_mtp, reference_mtp_logits

TOL = 1e-5
LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2": {"ep": 2}, "vpp2": {"pp": 2, "vpp": 2},
           "pp2 3+1": {"pp": 2, "first_stage_layers": 3}, "dist": {"tp": 2, "ep": 2, "etp": 1, "fmt": "torch_dist"}}
MTP_NAMES = {"mtp.layers.0.eh_proj.weight": "mtp.fc.weight",
             "mtp.layers.0.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
             "mtp.layers.0.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
             "mtp.layers.0.final_layernorm.weight": "mtp.norm.weight",
             "mtp.layers.0.transformer_layer.self_attention.linear_proj.weight": "mtp.layers.0.self_attn.o_proj.weight",
             "mtp.layers.0.transformer_layer.mlp.router.weight": "mtp.layers.0.mlp.gate.weight"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next_mtp")
    hf = make_hf_with_mtp(root / "hf")
    return root, hf, {name: converters.hf_to_megatron(hf, root / name.replace(" ", "-"), **kw)
                      for name, kw in LAYOUTS.items()}


def test_megatron_names_and_layout(converted):
    """megatron-core's names (Megatron-Bridge's Qwen3NextBridge maps the same), the MTP module on
    the last pipeline stage, recorded as Megatron-LM records it (mtp_num_layers)."""
    _, hf, out = converted
    src = load_file(hf / "model.safetensors")
    model = torch.load(out["tp1"] / "release/mp_rank_00/model_optim_rng.pt", weights_only=False)
    for mg, name in MTP_NAMES.items():
        assert torch.equal(model["model"][mg], src[name]), mg
    assert model["args"].mtp_num_layers == 1
    first = torch.load(out["pp2"] / "release/mp_rank_00_000/model_optim_rng.pt", weights_only=False)
    last = torch.load(out["pp2"] / "release/mp_rank_00_001/model_optim_rng.pt", weights_only=False)
    assert not any(k.startswith("mtp.") for k in first["model"])
    mtp = sum(k.startswith("mtp.layers.0.") for k in model["model"])
    assert mtp > 4 and sum(k.startswith("mtp.") for k in last["model"]) == mtp
    vpp = [torch.load(out["vpp2"] / f"release/mp_rank_00_00{r}/model_optim_rng.pt", weights_only=False) for r in (0, 1)]
    held = [sum(k.startswith("mtp.") for k in f[c]) for f in vpp for c in ("model0", "model1")]
    assert held == [0, 0, 0, mtp]  # the last virtual stage of the last pipeline stage


def test_round_trips_are_bit_exact(converted):
    root, hf, out = converted
    want = load_file(hf / "model.safetensors")
    assert sum(k.startswith("mtp.") for k in want) == 41  # fc, 3 norms, the layer's 37 (8 experts x 3 + 13)
    for name in LAYOUTS:
        got = load_file(converters.megatron_to_hf(out[name], root / f"{name.replace(' ', '-')}-back")
                        / "model.safetensors")
        assert got.keys() == want.keys(), name
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    again = converters.megatron_to_megatron(out["dist"], root / "dist-legacy", fmt="torch", tp=1, pp=2)
    got = load_file(converters.megatron_to_hf(again, root / "again") / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_second_mtp_module_is_refused(converted, tmp_path):
    """The checkpoint format names one fc and one norm: a second module's layer has no place."""
    _, hf, _ = converted
    two = tmp_path / "two"
    shutil.copytree(hf, two)
    t = load_file(two / "model.safetensors")
    t.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in t.items() if k.startswith("mtp.layers.0.")})
    save_file(t, two / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="2 MTP modules: Qwen3-Next's checkpoint format holds one"):
        converters.hf_to_megatron(two, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mtp_tensor_without_its_module_is_refused(converted, tmp_path):
    """An fc and norms without the module's layer: nothing to count the module by, so refused."""
    _, hf, _ = converted
    part = tmp_path / "part"
    shutil.copytree(hf, part)
    t = load_file(part / "model.safetensors")
    save_file({k: v for k, v in t.items() if not k.startswith("mtp.layers.")}, part / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor 'mtp.fc.weight'"):
        converters.hf_to_megatron(part, tmp_path / "out")


@pytest.fixture(scope="module")
def reference(converted, tmp_path_factory):
    """(tokens, main hidden states, MTP logits) from the HF tensors (tests.support.qwen3_next_mtp)."""
    tokens = sample_tokens(VOCAB)
    return (tokens, *reference_mtp_logits(converted[1], tokens, tmp_path_factory.mktemp("reference") / "hf"))


@pytest.fixture
def megatron_grid():
    from toolkit.mcore import distributed
    from toolkit.parallel.layout import Layout

    distributed.init_parallel(Layout())
    yield
    distributed.destroy()


def megatron_mtp(folder, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main hidden states, MTP logits) [batch, seq, ...] of megatron-core's GPTModel with its MTP
    block (toolkit.mcore's specs, as the runtime builds it), loaded as Megatron-LM loads the
    checkpoint (legacy: strict load_state_dict; torch_dist: dist_checkpointing.load, strict)."""
    from converters.formats.megatron import open_megatron
    from converters.parity_worker import build, load_dist, load_legacy
    from toolkit.mcore import cpu_compat
    from toolkit.parallel.layout import Layout

    ck = open_megatron(folder)
    assert ck.shape.mtp_layers == 1
    (model,), _ = build(ck.shape, Layout())
    load_legacy([model], ck) if ck.fmt == "torch" else load_dist([model], ck.source.dir)
    seen = {}
    model.mtp.register_forward_hook(lambda _m, _a, out: seen.setdefault("mtp", out))
    b, s = tokens.shape
    with torch.no_grad():
        model.eval()(input_ids=tokens, position_ids=torch.arange(s).expand(b, s), labels=tokens,
                     attention_mask=cpu_compat.causal_mask(s))
        main, mtp = seen["mtp"].chunk(2, dim=0)  # [s, b, h] each: the decoder's output, the MTP module's
        logits, _ = model.output_layer(mtp)
    return main.transpose(0, 1), logits.transpose(0, 1)[..., :VOCAB]


@pytest.mark.parametrize("name", ["tp1", "dist"])  # dist: written at tp2 ep2, loaded by megatron at tp1
def test_megatron_mtp_computes_the_reference(converted, reference, megatron_grid, name):
    tokens, ref_hidden, ref = reference
    hidden, logits = megatron_mtp(converted[2][name], tokens)
    assert max_diff(hidden, ref_hidden) <= TOL
    assert max_diff(logits, ref) <= TOL, max_diff(logits, ref)
    assert ref.abs().max() > 100 * TOL


def test_megatron_mtp_loss_and_gradient(converted, reference, megatron_grid):
    """Training's path (what the runtime takes): the MTP loss megatron-core logs is the cross entropy
    of the reference MTP logits against the token two ahead (over megatron's padded vocabulary, whose
    extra output rows are zero; the last two positions masked as its rolls mask them), and the
    backward of the main loss reaches every MTP weight (megatron's MTPLossAutoScaler)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from converters.formats.megatron import open_megatron
    from converters.parity_worker import build, load_legacy
    from toolkit.mcore import cpu_compat
    from toolkit.parallel.layout import Layout

    tokens, _, ref = reference
    ck = open_megatron(converted[2]["tp1"])
    (model,), _ = build(ck.shape, Layout())
    load_legacy([model], ck)
    b, s = tokens.shape
    labels, mask = tokens.roll(-1, dims=1), torch.ones(b, s)
    mask[:, -1] = 0
    MTPLossLoggingHelper.tracker.clear()
    per_token = model.train()(input_ids=tokens, position_ids=torch.arange(s).expand(b, s), labels=labels,
                              loss_mask=mask, attention_mask=cpu_compat.causal_mask(s))
    ((per_token * mask).sum() / mask.sum()).backward()
    logged = float(MTPLossLoggingHelper.tracker.pop("values")[0])
    MTPLossLoggingHelper.tracker.clear()
    padded = torch.nn.functional.pad(ref, (0, model.output_layer.weight.shape[0] - VOCAB))
    want = torch.nn.functional.cross_entropy(padded[:, :-2].reshape(-1, padded.shape[-1]), tokens[:, 2:].reshape(-1))
    assert abs(logged - float(want)) <= TOL, (logged, float(want))
    grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("mtp.")}
    assert len(grads) > 4 and all(g is not None and g.abs().max() > 0 for g in grads.values()), \
        [n for n, g in grads.items() if g is None or not g.abs().max() > 0]
