"""MoE conversion (Mixtral, Qwen2-MoE with a shared expert and a dense layer, Qwen3-MoE):
bit-exact round trips at (tp, pp, ep) in (1,1,2), (2,1,2), (1,2,2), (2,2,1), both formats
and both expert namings; resharding over ep/etp/tp/pp; parity with megatron-core's own MoE
layer (allgather dispatcher) at ep=2, tp=2 with sequence parallel, tp=2 x ep=2 with etp=1
(the 4-rank layouts: tests/converters/test_four_ranks.py); checkpoints megatron wrote itself; bad
MoE input."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import converters
from converters.errors import ConversionSetupError, MissingTensorError, TensorShapeError
from converters.parity import hf_logits, max_diff, sample_tokens
from toolkit.errors import PlanError

from tests.conftest import subprocess_env
from tests.support.convert_checks import (
    TOL,
    check,
    converted_jobs,
    exported_logits,
    launch,
    same_torch_dist_as_megatron,
    writer_jobs,
)
from tests.support.convert_models import BIASED, MOE, VOCAB, make_hf
from tests.converters.test_roundtrip import assert_identical

LAYOUTS = [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 1)]  # (tp, pp, ep)


def layouts(arch: str) -> list[dict]:
    """LAYOUTS as keyword arguments; experts with biases (BIASED: megatron-core builds them at
    etp=1 only) at etp=1, with ep=2 where tp=2."""
    out = [dict(tp=tp, pp=pp, ep=ep) for tp, pp, ep in LAYOUTS]
    return [{**kw, "etp": 1, "ep": max(kw["ep"], kw["tp"])} for kw in out] if arch in BIASED else out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return root, {name: make_hf(name, root / name) for name in MOE}


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("arch", list(MOE))
def test_round_trip(moe, tmp_path, arch, fmt):
    _, hf = moe
    for kw in layouts(arch):
        for grouped in ([False, True] if fmt == "torch" else [False]):
            out = tmp_path / f"t{kw['tp']}p{kw['pp']}e{kw['ep']}{'g' if grouped else ''}"
            mg = converters.hf_to_megatron(hf[arch], out, **kw, fmt=fmt, grouped_gemm=grouped)
            assert_identical(hf[arch], converters.megatron_to_hf(mg, tmp_path / f"hf-{out.name}"))


def test_legacy_expert_files(moe, tmp_path):
    """ep ranks in the folder names, global expert = ep_rank * experts_per_rank + local,
    dense weights repeated on every ep rank, both expert namings."""
    _, hf = moe
    src = load_file(hf["mixtral"] / "model.safetensors")
    for grouped in (False, True):
        mg = converters.hf_to_megatron(hf["mixtral"], tmp_path / f"g{grouped}", tp=1, pp=1, ep=2, grouped_gemm=grouped)
        names = sorted(p.name for p in (mg / "release").iterdir())
        assert names == ["mp_rank_00_000", "mp_rank_00_001"]
        ck = torch.load(mg / "release/mp_rank_00_001/model_optim_rng.pt", weights_only=False)
        model = ck["model"]
        assert ck["args"].moe_grouped_gemm == grouped and ck["args"].expert_model_parallel_size == 2
        key = "decoder.layers.3.mlp.experts." + ("linear_fc2.weight1" if grouped else "local_experts.1.linear_fc2.weight")
        assert torch.equal(model[key], src["model.layers.3.block_sparse_moe.experts.3.w2.weight"])
        assert torch.equal(model["embedding.word_embeddings.weight"][:VOCAB], src["model.embed_tokens.weight"])


def test_reshard_moe(moe, tmp_path):
    """ep, etp, tp, pp, naming and format changes chained, then export: the original bits."""
    _, hf = moe
    for arch in MOE:
        a = converters.hf_to_megatron(hf[arch], tmp_path / f"{arch}-a", tp=2, pp=1, ep=2, etp=1, grouped_gemm=True)
        b = converters.megatron_to_megatron(a, tmp_path / f"{arch}-b", tp=1, pp=2, ep=2, fmt="torch_dist")
        last = dict(ep=2, etp=1) if arch in BIASED else dict(ep=1)  # experts with biases: etp=1
        c = converters.megatron_to_megatron(b, tmp_path / f"{arch}-c", tp=2, pp=2, **last, fmt="torch",
                                            grouped_gemm=False)
        assert_identical(hf[arch], converters.megatron_to_hf(c, tmp_path / f"{arch}-hf"))


def test_routing_settings_are_observable(moe):
    """Softmax before top-k without renormalisation (Qwen2-MoE) vs renormalised top-k gives
    logits far apart, so the parity below checks the router settings are carried over."""
    root, hf = moe
    flipped = root / "qwen2_moe-renorm"
    shutil.copytree(hf["qwen2_moe"], flipped)
    cfg = (flipped / "config.json").read_text().replace('"norm_topk_prob": false', '"norm_topk_prob": true')
    (flipped / "config.json").write_text(cfg)
    tokens = sample_tokens(VOCAB)
    assert max_diff(hf_logits(hf["qwen2_moe"], tokens), hf_logits(flipped, tokens)) > 10 * TOL


WRITTEN = [{"tp": 1, "ep": 2}, {"tp": 2, "pp": 1}]  # layouts megatron saves its own MoE models at
WRITTEN_BIASED = [{"tp": 1, "ep": 2}, {"tp": 2, "ep": 2, "etp": 1}]


@pytest.fixture(scope="module")
def two_ranks(moe, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-two")
    (root / "written").mkdir()
    plain = [name for name in MOE if name not in BIASED]
    writes = writer_jobs(root / "written", plain, WRITTEN) + writer_jobs(root / "written", sorted(BIASED),
                                                                         WRITTEN_BIASED)
    _, hf = moe
    jobs, labels = converted_jobs({n: hf[n] for n in plain}, root, [
        ("torch ep=2", dict(tp=1, pp=1, ep=2)),
        ("torch tp=2 (sequence parallel)", dict(tp=2, pp=1)),
        ("torch tp=2 ep=2 etp=1", dict(tp=2, pp=1, ep=2, etp=1)),
        ("torch ep=2 grouped-gemm naming", dict(tp=1, pp=1, ep=2, grouped_gemm=True)),
        ("torch_dist ep=2, loaded at tp=2", dict(tp=1, pp=1, ep=2, fmt="torch_dist", load={"tp": 2})),
    ])
    more, more_labels = converted_jobs({n: hf[n] for n in sorted(BIASED)}, root / "biased", [
        ("torch tp=1", dict(tp=1, pp=1)),
        ("torch ep=2", dict(tp=1, pp=1, ep=2)),
        ("torch tp=2 ep=2 etp=1 (sequence parallel)", dict(tp=2, pp=1, ep=2, etp=1)),
        ("torch ep=2 grouped-gemm naming", dict(tp=1, pp=1, ep=2, grouped_gemm=True)),
        ("torch_dist ep=2, loaded at tp=2 ep=2 etp=1", dict(tp=1, pp=1, ep=2, fmt="torch_dist",
                                                            load={"tp": 2, "ep": 2, "etp": 1})),
        ("torch_dist tp=2 ep=2 etp=1, loaded at ep=2", dict(tp=2, pp=1, ep=2, etp=1, fmt="torch_dist",
                                                            load={"tp": 1, "ep": 2})),
    ])
    jobs, labels = jobs + more, labels + more_labels
    logits = launch(root, jobs, writes, nproc=2)  # megatron saving its own models rides along
    refs = {arch: hf_logits(hf[arch], sample_tokens(VOCAB)) for arch in MOE}
    return [(label, max_diff(got, refs[arch])) for (arch, label), got in zip(labels, logits)], writes


@pytest.mark.multirank
def test_parity_two_ranks(two_ranks):
    check(two_ranks[0])


@pytest.mark.multirank
def test_checkpoints_written_by_megatron(two_ranks, tmp_path):
    """megatron-core's own MoE models at ep=2 and tp=2 (sequence parallel), saved by megatron
    (torch_dist and legacy, no args), export to HF with megatron's logits; our torch_dist
    writer stores what megatron stored."""
    _, jobs = two_ranks
    assert [j["layout"] for j in jobs] == WRITTEN * (len(MOE) - len(BIASED)) + WRITTEN_BIASED * len(BIASED)
    check(exported_logits(jobs))
    for job in jobs:
        same_torch_dist_as_megatron(job, tmp_path)


@pytest.mark.multirank
def test_verify_command_on_moe(moe, tmp_path):
    """`toolkit verify` end to end on a bf16 MoE checkpoint at ep=2: exit 0 with the figure."""
    _, hf = moe
    mg = converters.hf_to_megatron(hf["qwen3_moe"], tmp_path / "mg", tp=1, pp=1, ep=2)
    r = subprocess.run([sys.executable, "-m", "toolkit", "verify", str(hf["qwen3_moe"]), str(mg)],
                       capture_output=True, text=True, env=subprocess_env(), timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    diff = float(re.search(r"max \|logit diff\| = (\S+) \(tolerance 0.0001\): OK \(\d+\.\d s\)", r.stdout).group(1))
    assert diff <= TOL
    # progress (issue 37: 20-36 s without a word): the two runs as they start, and nothing else on stderr
    steps = [re.sub(r"^\[\s*\d+\.\d s\] ", "", line) for line in r.stderr.splitlines()]
    assert steps == ["logits of megatron-core's GPTModel at tp=1 pp=1 vpp=1 ep=2 etp=1 on 2 CPU rank(s)",
                     "logits of transformers' Qwen3MoeForCausalLM"], r.stderr[-2000:]


def test_verify_fails_above_tolerance(moe, tmp_path, monkeypatch, capsys):
    """Exit 1 naming the difference when megatron's logits are off (here: shifted by 1e-3;
    the megatron run itself is exercised by the test above)."""
    import converters.parity as parity
    from toolkit.cli import main

    _, hf = moe
    mg = converters.hf_to_megatron(hf["mixtral"], tmp_path / "mg", tp=1, pp=1, ep=2)
    shifted = hf_logits(hf["mixtral"], sample_tokens(VOCAB)) + 1e-3
    monkeypatch.setattr(parity, "megatron_logits", lambda jobs, nproc, timeout=0: [shifted])
    assert main(["verify", str(hf["mixtral"]), str(mg)]) == 1
    assert re.search(r"error: max \|logit diff\| = 0.001 exceeds the tolerance 0.0001", capsys.readouterr().err)


# ----------------------------------------------------------------------------- bad input
def test_ep_not_dividing_experts(moe, tmp_path, capsys):
    from toolkit.cli import main

    _, hf = moe
    code = main(["convert", "hf-to-megatron", str(hf["mixtral"]), str(tmp_path / "o"), "--tp", "1", "--pp", "1",
                 "--ep", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--ep 3 does not divide num_experts=4" in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(PlanError, match="etp=2 needs a MoE model"):
        converters.hf_to_megatron(make_hf("llama", tmp_path / "llama"), tmp_path / "o", tp=1, pp=1, etp=2)


def _edited(hf_dir, tmp_path, edit):
    d = tmp_path / "edited"
    shutil.copytree(hf_dir, d)
    t = load_file(d / "model.safetensors")
    edit(t)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return d


def test_missing_experts_are_named(moe, tmp_path):
    _, hf = moe

    def drop(t):
        for e in (2, 3):
            del t[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"]

    d = _edited(hf["mixtral"], tmp_path, drop)
    with pytest.raises(MissingTensorError, match=r"missing tensors: model\.layers\.1\.block_sparse_moe\.experts\.2\.w3"
                                                 r"\.weight, model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1, ep=2)
    assert not (tmp_path / "o").exists()


def test_router_shape_mismatch(moe, tmp_path):
    _, hf = moe
    d = _edited(hf["qwen3_moe"], tmp_path, lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(6, 64)}))
    with pytest.raises(TensorShapeError, match=r"'model.layers.0.mlp.gate.weight' has shape \[6, 64\], expected \[8, 64\]"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)


def test_legacy_refuses_etp_above_tp(moe, tmp_path):
    _, hf = moe
    with pytest.raises(ConversionSetupError, match="legacy torch format cannot hold etp=2 with tp=1"):
        converters.hf_to_megatron(hf["mixtral"], tmp_path / "o", tp=1, pp=1, ep=2, etp=2)
    mg = converters.hf_to_megatron(hf["mixtral"], tmp_path / "d", tp=1, pp=1, ep=2, etp=2, fmt="torch_dist")
    assert_identical(hf["mixtral"], converters.megatron_to_hf(mg, tmp_path / "hf"))
