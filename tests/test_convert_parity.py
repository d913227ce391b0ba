"""Converted checkpoints against code we did not write: megatron-core's GPTModel (loaded
the way Megatron-LM loads them) gives the logits of transformers' model, at several
layouts, in both formats; torch_dist checkpoints load at a different layout than they
were written with (megatron reshards); and checkpoints megatron-core wrote itself export
to HF models with megatron's logits. One torchrun launch per world size.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import converters
from converters.parity import hf_logits, max_diff, megatron_logits, sample_tokens

from .conftest import ROOT, subprocess_env
from .convert_models import DENSE, VOCAB, hf_config, make_hf

pytestmark = pytest.mark.multirank
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    hf = {name: make_hf(name, root / name) for name in DENSE}
    ref = {name: hf_logits(path, sample_tokens(VOCAB)) for name, path in hf.items()}
    return root, hf, ref


def check(results: list[tuple[str, float]]) -> None:
    print("\n" + "\n".join(f"  {label:48s} max|dlogit| = {d:.2e}" for label, d in results))
    bad = [(label, d) for label, d in results if not d <= TOL]
    assert not bad, bad


def test_rope_scaling_variant_is_observable(models):
    """Llama 3.1 rope scaling changes these logits (64 tokens) by over 10x the tolerance, so the
    parity below really checks that it is carried over."""
    _, _, ref = models
    assert max_diff(ref["llama"], ref["llama31"]) > 10 * TOL


def test_parity_two_ranks(models):
    """tp=2, pp=2, pp=2 x vpp=2 and tp=1 (dp=2) for every architecture, legacy format; torch_dist
    written at one layout and loaded by megatron at another."""
    root, hf, ref = models
    jobs, labels = [], []
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
    logits = megatron_logits(jobs, nproc=2)
    check([(label, max_diff(got, ref[name])) for (name, label), got in zip(labels, logits)])


def test_parity_tp2_pp2(models):
    """tp=2 x pp=2 (4 ranks), both formats, and a reshard (megatron-to-megatron) output."""
    root, hf, ref = models
    jobs, labels = [], []
    for name in DENSE:
        for fmt in ("torch", "torch_dist"):
            mg = converters.hf_to_megatron(hf[name], root / f"{name}-{fmt}-t2p2", tp=2, pp=2, fmt=fmt)
            jobs.append({"megatron_dir": str(mg)})
            labels.append((name, f"{name} {fmt} tp=2 pp=2"))
        resharded = converters.megatron_to_megatron(root / f"{name}-torch-t2p2", root / f"{name}-re-t1p4", tp=1,
                                                    pp=4)
        jobs.append({"megatron_dir": str(resharded)})
        labels.append((name, f"{name} torch resharded tp=2 pp=2 -> tp=1 pp=4"))
    logits = megatron_logits(jobs, nproc=4)
    check([(label, max_diff(got, ref[name])) for (name, label), got in zip(labels, logits)])


def test_checkpoints_written_by_megatron_export_exactly(models, tmp_path):
    """megatron-core builds random GPTModels at tp=2, pp=2 and pp=2 x vpp=2, saves them itself
    (dist_checkpointing.save of its sharded state dict; its state_dict in the legacy layout,
    no args), and records its logits; our export (with --hf-config) gives those logits in
    transformers."""
    root, _, _ = models
    jobs = []
    for name in DENSE:
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps(hf_config(name)))
        for tp, pp, vpp in [(2, 1, 1), (1, 2, 1), (1, 2, 2)]:
            out = tmp_path / f"{name}-t{tp}p{pp}v{vpp}"
            out.mkdir()
            jobs.append({"hf_config": str(cfg), "layout": {"tp": tp, "pp": pp, "vpp": vpp}, "out": str(out)})
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(ROOT / "tests/convert_megatron_writer.py"), str(spec)],
                       capture_output=True, text=True, env=subprocess_env(), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    results = []
    for job in jobs:
        want = torch.load(f"{job['out']}/logits.pt", weights_only=True)
        for fmt, sub in (("torch_dist", "dist"), ("torch", "legacy")):
            out = converters.megatron_to_hf(f"{job['out']}/{sub}", f"{job['out']}/hf-{sub}", hf_config=job["hf_config"])
            got = hf_logits(out, sample_tokens(VOCAB))
            results.append((f"{Path(job['hf_config']).stem} {fmt} "
                            f"{job['layout']}", max_diff(got, want)))
    check(results)


def test_verify_command(models):
    """`toolkit verify` end to end: exit 0 and the figure printed."""
    root, hf, _ = models
    mg = converters.hf_to_megatron(hf["qwen3"], root / "verify-cli", tp=2, pp=1)
    r = subprocess.run([sys.executable, "-m", "toolkit", "verify", str(hf["qwen3"]), str(mg)],
                       capture_output=True, text=True, env=subprocess_env(), timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "max |logit diff| = " in r.stdout and ": OK" in r.stdout
