"""Helpers shared by the parity tests: tolerance check with a printed table, the one launch
per module and world size (megatron-core's logits of converted checkpoints, and megatron
writing its own checkpoints), and a torch_dist checkpoint's storage layout."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import converters
from converters.parity import hf_logits, max_diff, sample_tokens

from tests.conftest import SUPPORT, subprocess_env
from tests.support.convert_models import VOCAB, hf_config

TOL = 1e-4


def check(results: list[tuple[str, float]]) -> None:
    print("\n" + "\n".join(f"  {label:60s} max|dlogit| = {d:.2e}" for label, d in results))
    bad = [(label, d) for label, d in results if not d <= TOL]
    assert not bad, bad


def converted_jobs(hf: dict[str, Path], root: Path, cases: list[tuple[str, dict]]) -> tuple[list, list]:
    """Parity jobs for ``launch``: each HF model (name -> folder) converted by hf_to_megatron at
    each case (label, its keyword arguments; "load": the layout megatron loads a torch_dist
    checkpoint at), with (name, "name label") labels in the same order."""
    jobs, labels = [], []
    for name, folder in hf.items():
        for label, kw in cases:
            kw = dict(kw)
            load = kw.pop("load", None)
            mg = converters.hf_to_megatron(folder, root / f"{name}-{len(jobs)}", **kw)
            jobs.append({"megatron_dir": str(mg), **({"layout": load} if load else {})})
            labels.append((name, f"{name} {label}"))
    return jobs, labels


def writer_jobs(root: Path, names: list[str], layouts: list[dict], configs: dict | None = None,
                mtp: dict[str, int] | None = None) -> list[dict]:
    """Jobs for tests/support/convert_megatron_writer.py: for each model and layout megatron-core
    saves a random GPTModel (``dist``, ``legacy``) and its logits under job["out"].
    ``configs``: HF configs by name (default: tests/support/convert_models.py's); ``mtp``: MTP
    modules megatron builds for a model (none by default)."""
    jobs = []
    for name in names:
        cfg = root / f"{name}.json"
        cfg.write_text(json.dumps(configs[name] if configs else hf_config(name)))
        for layout in layouts:
            out = root / (name + "-" + "-".join(f"{k}{v}" for k, v in layout.items()))
            out.mkdir()
            jobs.append({"name": name, "hf_config": str(cfg), "layout": layout, "out": str(out),
                         "mtp_layers": (mtp or {}).get(name, 0)})
    return jobs


def launch(root: Path, parity: list[dict], writes: list[dict], nproc: int) -> list[torch.Tensor]:
    """ONE torchrun of tests/support/convert_megatron_writer.py (the imports cost about 10 s a rank):
    megatron-core's logits of each ``parity`` job (converters.parity_worker, as `toolkit
    verify` runs it: {"megatron_dir", optional "layout"}) and the checkpoints of each
    ``writes`` job. Returns the parity jobs' logits, in order."""
    parity = [{**job, "out": str(root / f"parity{nproc}-logits{i}.pt")} for i, job in enumerate(parity)]
    spec = root / f"convert-jobs{nproc}.json"
    spec.write_text(json.dumps(parity + writes))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        str(nproc), str(SUPPORT / "convert_megatron_writer.py"), str(spec)],
                       capture_output=True, text=True, env=subprocess_env(), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    # each grid's process groups are destroyed after its job (toolkit.mcore.distributed.
    # release_model_parallel): without that a rank gained ~50 gloo threads per 4-rank grid;
    # with it 3 (one group per grid is still left, not found which)
    threads = json.loads(spec.with_suffix(".threads.json").read_text())
    assert threads[-1] - threads[0] <= 5 * (len(threads) - 1), f"threads after each job: {threads}"
    return [torch.load(job["out"], weights_only=True) for job in parity]


def exported_logits(jobs: list[dict]) -> list[tuple[str, float]]:
    """Export each megatron-written checkpoint (both formats, with --hf-config) and compare
    transformers' logits with the ones megatron recorded."""
    results = []
    for job in jobs:
        want = torch.load(f"{job['out']}/logits.pt", weights_only=True)
        for fmt, sub in (("torch_dist", "dist"), ("torch", "legacy")):
            out = converters.megatron_to_hf(f"{job['out']}/{sub}", f"{job['out']}/hf-{sub}", hf_config=job["hf_config"])
            results.append((f"{job['name']} {fmt} by megatron {job['layout']}",
                            max_diff(hf_logits(out, sample_tokens(VOCAB)), want)))
    return results


def dcp_layout(d: Path) -> dict:
    """key -> (global shape, dtype, sorted chunks) of a torch_dist folder; objects -> None."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(d)).read_metadata()
    out = {}
    for k, v in md.state_dict_metadata.items():
        if hasattr(v, "chunks"):
            out[k] = (tuple(v.size), v.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
        else:
            out[k] = None
    return out


def same_torch_dist_as_megatron(job: dict, tmp_path: Path) -> None:
    """Our torch_dist writer, fed the HF export of megatron's own checkpoint at megatron's
    layout, stores exactly the keys, shapes, dtypes and chunks megatron stored."""
    hf = Path(job["out"]) / "hf-dist"
    ours = converters.hf_to_megatron(hf, tmp_path / f"ours-{Path(job['out']).name}", fmt="torch_dist",
                                     **{"pp": 1, "vpp": 1, "ep": 1, **job["layout"]})
    assert dcp_layout(ours / "release") == dcp_layout(Path(job["out"]) / "dist")
