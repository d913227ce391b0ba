"""A LoRA run's adapters out to Hugging Face: in peft's format (``--export-peft DIR``) or merged
into the base's weights (``--export-hf DIR``).

The adapters are read from the last checkpoint's ``model/`` (global tensors, any layout that
trained them: toolkit.runtime.lora) and renamed with the family's weight table, the one the
converters use (``converters.mapping.ModelMap.global_to_hf``): each HF weight is a set of row
ranges of one global megatron weight (q, k, v of linear_qkv; gate, up of linear_fc1; o_proj and
down_proj whole), and the adapter's B has the rows of its weight, so the HF module's B is the
same row ranges of the megatron B and its A is the megatron A (q, k and v share it: their
combined update B A is the fused one's). A gated delta net's in_proj (Qwen3-Next) is one more
such weight: its rows q, k, v, z, b, a over all heads are HF's in_proj_qkvz and in_proj_ba
regrouped per key head (the converters' DeltaNetInProj), so each of those gets its rows of B and
the shared A; its out_proj is HF's out_proj whole. peft's LoRA computes (alpha / r) B A x per module, as
the runtime does, so HF's base + the exported adapter is the trained model.

peft's format: ``adapter_config.json`` written by peft's own ``LoraConfig.save_pretrained`` and
``adapter_model.safetensors`` with peft's keys (``base_model.model.<HF module>.lora_A.weight``),
loadable with ``peft.PeftModel.from_pretrained(base, DIR)``. Merged: the base exported by the
converters (the adapters' tensors left out of a copy of ``model/``), then each target weight
W + (alpha / r) B A in place, file by file.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

ADAPTER_FILE = "adapter_model.safetensors"  # peft's name (LoraConfig.save_pretrained writes adapter_config.json)
PEFT_PREFIX = "base_model.model."


def read_adapters(model_dir: Path) -> dict[str, torch.Tensor]:
    """{global megatron name ('decoder.layers.3.self_attention.linear_qkv.lora_B.weight'): tensor}
    from a torch_dist folder, each layer of megatron's stacked keys as its own tensor (a key that
    already names its layer, as megatron writes them in MoE models, is that layer's tensor)."""
    import re
    from torch.distributed.checkpoint import FileSystemReader, load

    from converters.formats import dcp

    stacked = {k: torch.empty(info.shape, dtype=torch.float32) for k, info in dcp.tensors(model_dir).items()
               if ".lora_" in k}
    with warnings.catch_warnings():  # reading in this one process is the intent (rank 0 exports)
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        load(stacked, storage_reader=FileSystemReader(str(model_dir)), no_dist=True)
    layer = re.compile(r"decoder\.layers\.\d+\.")
    out = {k: t for k, t in stacked.items() if layer.match(k)}
    out.update({k.replace("decoder.layers.", f"decoder.layers.{i}.", 1): t[i]
                for k, t in stacked.items() if not layer.match(k) for i in range(t.shape[0])})
    return out


def hf_adapters(shape, padded_vocab: int, adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """{HF module ('model.layers.3.self_attn.q_proj'): (A [r, in], B [out, r])} for every HF
    weight made of rows of an adapted megatron weight (module docstring)."""
    from converters.mapping import ModelMap

    mm, out = ModelMap(shape, padded_vocab), {}
    adapters = _joined(adapters, mm.part_keys)
    for hf_name, copies in mm.global_to_hf.items():
        src = {c.src for c in copies}
        if len(src) != 1 or not hf_name.endswith(".weight"):
            continue
        base = next(iter(src)).removesuffix(".weight")
        if f"{base}.lora_A.weight" not in adapters:
            continue
        a, b = adapters[f"{base}.lora_A.weight"], adapters[f"{base}.lora_B.weight"]
        rows = torch.empty(sum(c.rows for c in copies), b.shape[1], dtype=b.dtype)
        for c in copies:  # whole rows of the weight: the same rows of B
            assert c.src_col == 0 and c.dst_col == 0 and c.cols == a.shape[1], (hf_name, c)
            rows[c.dst_row:c.dst_row + c.rows] = b[c.src_row:c.src_row + c.rows]
        out[hf_name.removesuffix(".weight")] = (a.clone(), rows)
    return out


def _joined(adapters: dict[str, torch.Tensor], part_keys: dict) -> dict[str, torch.Tensor]:
    """The adapters with each B stored one key per part (a gated delta net's in_proj:
    ``...in_proj.lora_B.weight.query`` etc., toolkit.runtime.lora) as the one global B whose rows
    are the parts one after the other, as the weight's are (``part_keys``: ModelMap.part_keys)."""
    out = dict(adapters)
    for name, parts in part_keys.items():
        key = f"{name.removesuffix('.weight')}.lora_B.weight"
        if f"{key}.{parts[0][0]}" in out:
            out[key] = torch.cat([out.pop(f"{key}.{part}") for part, _, _ in parts])
    return out


def write_peft(out: Path, modules: dict[str, tuple[torch.Tensor, ...]], lora, base_model: str | None) -> None:
    """peft's adapter folder (module docstring) in `out`, which exists and is empty."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    targets = sorted({name.rsplit(".", 1)[-1] for name in modules})
    LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none",
               task_type="CAUSAL_LM", base_model_name_or_path=base_model).save_pretrained(str(out))
    tensors = {f"{PEFT_PREFIX}{m}.lora_{k}.weight": t.contiguous()
               for m, (a, b) in modules.items() for k, t in (("A", a), ("B", b))}
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})


def merge_into(hf_dir: Path, modules: dict[str, tuple[torch.Tensor, ...]], scaling: float) -> None:
    """W + scaling B A for every adapted weight of the HF folder's safetensors files, in place."""
    from safetensors.torch import load_file, save_file

    for f in sorted(hf_dir.glob("*.safetensors")):
        weights = load_file(str(f))
        hit = [m for m in modules if f"{m}.weight" in weights]
        for m in hit:
            a, b = modules[m]
            w = weights[f"{m}.weight"]
            weights[f"{m}.weight"] = (w.float() + scaling * (b @ a)).to(w.dtype)
        if hit:
            save_file(weights, str(f), metadata={"format": "pt"})


def base_only(model_dir: Path, out: Path) -> None:
    """A copy of a torch_dist ``model/`` without the adapters' tensors (what the converters
    read as the base model): the kept records copied (converters.formats.dcp.select), common.pt,
    metadata.json and the hf/ side folder alongside."""
    import shutil

    from converters.formats import dcp

    out.mkdir(parents=True)
    dcp.select([dcp.Source(model_dir, lambda key: ".lora_" not in key)], out)
    for p in model_dir.iterdir():
        if p.is_file() and not p.name.endswith(".distcp") and p.name != dcp.METADATA:
            shutil.copy2(p, out / p.name)
        elif p.is_dir():
            shutil.copytree(p, out / p.name)
