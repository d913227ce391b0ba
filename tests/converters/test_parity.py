"""Converted checkpoints against code we did not write: megatron-core's GPTModel (loaded
the way Megatron-LM loads them) gives the logits of transformers' model, at several
layouts, in both formats; torch_dist checkpoints load at a different layout than they
were written with (megatron reshards); and checkpoints megatron-core wrote itself export
to HF models with megatron's logits. One 2-rank torchrun launch (the parity jobs and megatron
writing its own checkpoints together); the 4-rank layouts: tests/converters/test_four_ranks.py.
"""
from __future__ import annotations

import pytest
import torch

import converters
from converters.parity import hf_logits, max_diff, sample_tokens

from tests.support.convert_checks import TOL, check, exported_logits, launch, same_torch_dist_as_megatron, writer_jobs
from tests.support.convert_models import DENSE, VOCAB, make_hf

# yarn rope on a model without multi-latent attention (GPTModel's YarnRotaryEmbedding, as GPT-OSS
# uses it): Qwen2 tiny with transformers' default truncate (megatron's integer correction range)
YARN = {"qwen2_yarn": ("qwen2-tiny", {"rope_theta": None, "rope_parameters": {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1000000.0}},
    torch.float32)}

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    hf = {name: make_hf(name, root / name) for name in DENSE}
    ref = {name: hf_logits(path, sample_tokens(VOCAB)) for name, path in hf.items()}
    return root, hf, ref


def test_rope_scaling_variant_is_observable(models):
    """Llama 3.1 rope scaling changes these logits (64 tokens) by over 10x the tolerance, so the
    parity below really checks that it is carried over."""
    _, _, ref = models
    assert max_diff(ref["llama"], ref["llama31"]) > 10 * TOL


def _uneven(root, hf) -> tuple[list, list]:
    """Llama and Qwen2 (tied output layer on the last stage) at megatron's uneven split
    3 + 1, and torch_dist written at tp=2 then loaded by megatron split 1 + 3."""
    jobs, labels = [], []
    for name in ("llama", "qwen2"):
        mg = converters.hf_to_megatron(hf[name], root / f"{name}-uneven", tp=1, pp=2, first_stage_layers=3)
        jobs.append({"megatron_dir": str(mg)})
        labels.append((name, f"{name} torch pp=2 split 3+1"))
        mg = converters.hf_to_megatron(hf[name], root / f"{name}-dist-uneven", tp=2, pp=1, fmt="torch_dist")
        jobs.append({"megatron_dir": str(mg), "layout": {"pp": 2, "last_stage_layers": 3}})
        labels.append((name, f"{name} torch_dist written tp=2, loaded pp=2 split 1+3"))
    return jobs, labels


WRITTEN = [{"tp": 2, "pp": 1}, {"tp": 1, "pp": 2, "vpp": 2}]  # layouts megatron saves its own models at


@pytest.fixture(scope="module")
def two_ranks(models):
    """The 2-rank launch: tp=2, pp=2, pp=2 x vpp=2 and tp=1 (dp=2) for every architecture,
    legacy format; torch_dist written at one layout and loaded by megatron at another; uneven
    pipeline splits; and megatron-core's own random models saved at WRITTEN."""
    root, hf, ref = models
    jobs, labels = _uneven(root, hf)
    yarn = make_hf("qwen2_yarn", root / "qwen2_yarn", YARN)
    ref["qwen2_yarn"] = hf_logits(yarn, sample_tokens(VOCAB))
    for tp in (1, 2):
        jobs.append({"megatron_dir": str(converters.hf_to_megatron(yarn, root / f"qwen2_yarn-t{tp}", tp=tp, pp=1))})
        labels.append(("qwen2_yarn", f"qwen2_yarn torch tp={tp}"))
    for name in DENSE:
        for tp, pp, vpp in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2)]:
            mg = converters.hf_to_megatron(hf[name], root / f"{name}-t{tp}p{pp}v{vpp}", tp=tp, pp=pp, vpp=vpp)
            jobs.append({"megatron_dir": str(mg)})
            labels.append((name, f"{name} torch tp={tp} pp={pp} vpp={vpp}"))
        for (wtp, wpp, wvpp), load in [((2, 1, 1), (1, 2, 1)), ((1, 2, 2), (2, 1, 1))]:
            mg = converters.hf_to_megatron(hf[name], root / f"{name}-dist-t{wtp}p{wpp}v{wvpp}", tp=wtp, pp=wpp,
                                           vpp=wvpp, fmt="torch_dist")
            jobs.append({"megatron_dir": str(mg), "layout": dict(zip(("tp", "pp", "vpp"), load))})
            labels.append((name, f"{name} torch_dist written tp={wtp} pp={wpp} vpp={wvpp}, loaded tp={load[0]} "
                                 f"pp={load[1]}"))
    (root / "written").mkdir()
    writes = writer_jobs(root / "written", list(DENSE), WRITTEN)
    logits = launch(root, jobs, writes, nproc=2)
    return [(label, max_diff(got, ref[name])) for (name, label), got in zip(labels, logits)], writes


def test_parity_two_ranks(two_ranks, models):
    check(two_ranks[0])
    assert all(d <= 1e-5 for label, d in two_ranks[0] if label.startswith("gemma3")), "Gemma 3 above 1e-5 in fp32"
    _, _, ref = models
    assert max_diff(ref["qwen2"], ref["qwen2_yarn"]) > 10 * TOL  # the yarn rows above check the scaling


def test_checkpoints_written_by_megatron_export_exactly(two_ranks, tmp_path):
    """megatron-core builds random GPTModels at tp=2 and pp=2 x vpp=2, saves them itself
    (dist_checkpointing.save of its sharded state dict; its state_dict in the legacy layout,
    no args) and records its logits; our export (with --hf-config) gives those logits in
    transformers. Our torch_dist writer stores what megatron stored, chunk for chunk."""
    _, jobs = two_ranks
    assert [j["layout"] for j in jobs] == WRITTEN * len(DENSE)
    check(exported_logits(jobs))
    for job in jobs:
        same_torch_dist_as_megatron(job, tmp_path)
