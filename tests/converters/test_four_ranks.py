"""Converted checkpoints at the 4-rank layouts, dense and MoE in ONE torchrun launch of
4 ranks (tests/support/convert_megatron_writer.py; the imports cost about 10 s a rank): megatron-core's
GPTModel (loaded the way Megatron-LM loads) gives transformers' logits.

- every dense architecture: legacy at tp=2 x pp=2; torch_dist written at tp=1 pp=1 and loaded
  by megatron at tp=2 pp=2; a reshard (megatron-to-megatron) tp=2 pp=2 -> tp=1 pp=4;
- every MoE architecture: legacy at tp=2 x ep=2, pp=2 x ep=2 and tp=2 x pp=2; torch_dist
  written at tp=2 pp=2 and loaded by megatron at tp=2 ep=2.
"""
from __future__ import annotations

import pytest

import converters
from converters.parity import hf_logits, max_diff, sample_tokens

from tests.support.convert_checks import check, converted_jobs, launch
from tests.support.convert_models import BIASED, DENSE, MOE, VOCAB, make_hf

pytestmark = pytest.mark.multirank

MOE_CASES = [
    ("torch tp=2 ep=2", dict(tp=2, pp=1, ep=2)),
    ("torch pp=2 ep=2", dict(tp=1, pp=2, ep=2)),
    ("torch tp=2 pp=2", dict(tp=2, pp=2, ep=1)),
    ("torch_dist tp=2 pp=2, loaded at tp=2 ep=2", dict(tp=2, pp=2, fmt="torch_dist", load={"tp": 2, "ep": 2})),
]
# experts with biases (megatron-core: etp=1 only): the same grids with etp=1 (and ep=2 where tp=2)
BIASED_CASES = [
    ("torch tp=2 ep=2 etp=1", dict(tp=2, pp=1, ep=2, etp=1)),
    ("torch pp=2 ep=2", dict(tp=1, pp=2, ep=2)),
    ("torch tp=2 pp=2 ep=2 etp=1", dict(tp=2, pp=2, ep=2, etp=1)),
    ("torch_dist tp=2 pp=2 ep=2 etp=1, loaded at tp=2 ep=2 etp=1",
     dict(tp=2, pp=2, ep=2, etp=1, fmt="torch_dist", load={"tp": 2, "ep": 2, "etp": 1})),
]


def dense_jobs(root, hf) -> tuple[list, list]:
    jobs, labels = [], []
    for name in DENSE:
        mg = converters.hf_to_megatron(hf[name], root / f"{name}-torch-t2p2", tp=2, pp=2)
        jobs.append({"megatron_dir": str(mg)})
        labels.append((name, f"{name} torch tp=2 pp=2"))
        dist = converters.hf_to_megatron(hf[name], root / f"{name}-dist-t1p1", tp=1, pp=1, fmt="torch_dist")
        jobs.append({"megatron_dir": str(dist), "layout": {"tp": 2, "pp": 2}})
        labels.append((name, f"{name} torch_dist written tp=1 pp=1, loaded tp=2 pp=2"))
        resharded = converters.megatron_to_megatron(mg, root / f"{name}-re-t1p4", tp=1, pp=4)
        jobs.append({"megatron_dir": str(resharded)})
        labels.append((name, f"{name} torch resharded tp=2 pp=2 -> tp=1 pp=4"))
    return jobs, labels


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("four")
    hf = {name: make_hf(name, root / name) for name in (*DENSE, *MOE)}
    dense, dense_labels = dense_jobs(root, hf)
    moe, moe_labels = converted_jobs({name: hf[name] for name in MOE if name not in BIASED}, root, MOE_CASES)
    biased, biased_labels = converted_jobs({name: hf[name] for name in BIASED}, root / "biased", BIASED_CASES)
    moe, moe_labels = moe + biased, moe_labels + biased_labels
    logits = launch(root, dense + moe, [], nproc=4)
    ref = {name: hf_logits(path, sample_tokens(VOCAB)) for name, path in hf.items()}
    results = [(label, max_diff(got, ref[name])) for (name, label), got in zip(dense_labels + moe_labels, logits)]
    return results[:len(dense)], results[len(dense):]


def test_dense_tp2_pp2(four_ranks):
    dense, _ = four_ranks
    assert len(dense) == 3 * len(DENSE)
    check(dense)


def test_moe_four_ranks(four_ranks):
    _, moe = four_ranks
    assert len(moe) == len(MOE_CASES) * (len(MOE) - len(BIASED)) + len(BIASED_CASES) * len(BIASED)
    check(moe)
