"""Do two checkouts of the toolkit convert identically? The 18 conversions of a refactor's check:
nine tiny HF models (random weights, seed 0) x both Megatron formats, HF -> Megatron (tp2 pp2,
ep2 for the MoE models, tp1 for DeepSeek's) and back to HF, each with the code of OLD and of NEW
(``python -m toolkit convert`` with PYTHONPATH set to the checkout), then every output file
compared: legacy torch files entry by entry (torch writes a random ``serialization_id`` into
each), torch_dist folders tensor by tensor, everything else byte for byte.

    PYTHONPATH=. python benchmarks/conversion_identity.py OLD_CHECKOUT NEW_CHECKOUT [--work DIR]

Prints "N files compared: IDENTICAL", or the files that differ (exit 1).
"""
from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODELS = ("llama-tiny", "qwen2-tiny", "qwen3-tiny", "mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny",
          "deepseek-v2-tiny", "deepseek-v3-tiny", "mistral-tiny")
FORMATS = ("torch", "torch_dist")


def make_hf(out: Path) -> None:
    """The tiny models as transformers builds them from the registry's configs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.models import named_models

    for name in MODELS:
        cfg = dict(named_models()[name]["config"])
        model_type = cfg.pop("model_type")
        cfg.pop("architectures", None)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg)).save_pretrained(out / name)


def convert(code: Path, hf: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(code), "DS_ACCELERATOR": "cpu"}
    for name in MODELS:
        moe = "moe" in name or name.startswith(("mixtral", "deepseek"))
        tp = "1" if name.startswith("deepseek") else "2"
        for fmt in FORMATS:
            mg, back = out / f"{name}-{fmt}", out / f"{name}-{fmt}-hf"
            to_mg = ["hf-to-megatron", str(hf / name), str(mg), "--tp", tp, "--pp", "2",
                     *(["--ep", "2"] if moe else []), "--format", fmt, "--dtype", "fp32"]
            for argv in (to_mg, ["megatron-to-hf", str(mg), str(back)]):
                subprocess.run([sys.executable, "-m", "toolkit", "convert", *argv], env=env, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{code.name}: {name}", flush=True)


def same_zip(a: Path, b: Path) -> bool:
    za, zb = zipfile.ZipFile(a), zipfile.ZipFile(b)
    na = [i.filename for i in za.infolist() if not i.filename.endswith("serialization_id")]
    nb = [i.filename for i in zb.infolist() if not i.filename.endswith("serialization_id")]
    return na == nb and all(za.read(x) == zb.read(x) for x in na)


def same_value(x, y) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and list(x) == list(y) and all(same_value(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(same_value, x, y))
    return x == y or (hasattr(x, "__dict__") and vars(x) == vars(y))


def same_dcp(a: Path, b: Path) -> bool:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as t:
        dcp_to_torch_save(str(a), f"{t}/a.pt")
        dcp_to_torch_save(str(b), f"{t}/b.pt")
        return same_value(torch.load(f"{t}/a.pt", weights_only=False), torch.load(f"{t}/b.pt", weights_only=False))


def compare(a_root: Path, b_root: Path) -> tuple[int, list[str]]:
    files = sorted(p.relative_to(a_root) for p in a_root.rglob("*") if p.is_file())
    other = sorted(p.relative_to(b_root) for p in b_root.rglob("*") if p.is_file())
    bad = [f"file lists differ: {sorted(map(str, set(files) ^ set(other)))}"] if files != other else []
    dcp = set()
    for rel in sorted(set(files) & set(other)):
        a, b = a_root / rel, b_root / rel
        if rel.suffix == ".distcp" or rel.name == ".metadata":
            dcp.add(rel.parent)
        elif not (same_zip(a, b) if zipfile.is_zipfile(a) else filecmp.cmp(a, b, shallow=False)):
            bad.append(str(rel))
    bad += [f"{d} (tensors)" for d in sorted(dcp) if not same_dcp(a_root / d, b_root / d)]
    return len(files), bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--work", type=Path, default=None,
                    help="where the models and outputs go (default: a temporary folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        make_hf(work / "hf")
        for side, code in (("old", args.old), ("new", args.new)):
            convert(code.resolve(), work / "hf", work / side)
        n, bad = compare(work / "old", work / "new")
    print(f"{n} files compared: " + ("IDENTICAL" if not bad else "DIFFER: " + ", ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
