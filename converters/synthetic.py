"""Random Hugging Face checkpoints of real shapes, for benchmarks and memory tests.

Every tensor the model's weight table names, with its real shape, random normal values
(x 0.02) in bf16 or fp32, in safetensors shards of at most ``shard_bytes`` with an index
(as transformers splits them), written a tensor at a time so that making a 16 GB model
needs no more memory than its largest tensor.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .dtypes import DType, bfloat16, float32
from .formats.safetensors_io import header_bytes
from .mapping import ModelMap

def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    """Normal values x 0.02 as raw bytes of ``dtype`` (bf16 rounded to nearest even)."""
    x = (rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * 0.02).view(np.uint32)
    if dtype == float32:
        return x.view(np.uint8)
    if dtype != bfloat16:
        raise ValueError(f"synthetic checkpoints are bf16 or fp32, not {dtype}")
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)


def _shards(tensors: list[tuple[str, tuple[int, ...]]], dtype: DType, shard_bytes: int) -> list[list]:
    out, cur, size = [], [], 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * dtype.itemsize
        if cur and size + n > shard_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    return out + [cur]


def write_hf_checkpoint(d: Path, config: dict, dtype: DType = bfloat16, shard_bytes: int = 5 << 30,
                        seed: int = 0) -> int:
    """An HF folder (config.json, shards, index) with random weights; returns the bytes of weights."""
    from toolkit.models import shape_from_hf

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    tensors = list(ModelMap(shape_from_hf(config), 0).hf_shapes.items())
    if config.get("tie_word_embeddings"):
        tensors = [(n, s) for n, s in tensors if n != "lm_head.weight"]
    shards = _shards(tensors, dtype, shard_bytes)
    rng, weight_map, total = np.random.default_rng(seed), {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(d / fname, "wb") as f:
            f.write(header_bytes([(n, s, dtype) for n, s in shard]))
            for name, shape in shard:
                data = _random(rng, shape, dtype)
                f.write(memoryview(data))
                weight_map[name] = fname
                total += data.nbytes
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total
