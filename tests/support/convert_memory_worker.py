"""One process: random HF models with each number of layers given, then every direction
and format of conversion, each under benchmarks.memory.PeakMemory; prints one JSON line
{layers: {label: [peak anonymous MiB above entry, peak RSS MiB above entry]}}.

    python tests/support/convert_memory_worker.py ROOT LAYERS [LAYERS ...]

A 2-layer model goes through the same conversions first, so that imports and the
writers' buffers are in place before anything is measured.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import converters
from benchmarks.memory import PeakMemory
from converters.dtypes import float32
from converters.synthetic import write_hf_checkpoint

# hidden 256, SwiGLU 768, GQA 8/2 heads: ~3 MB of fp32 weights per layer
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
          "tie_word_embeddings": False}


def conversions(root: Path) -> list[tuple[str, callable]]:
    hf, t, d = root / "hf", root / "torch", root / "dist"
    return [
        ("hf-to-megatron torch tp2", lambda: converters.hf_to_megatron(hf, t, tp=2)),
        ("hf-to-megatron torch_dist tp2", lambda: converters.hf_to_megatron(hf, d, tp=2, fmt="torch_dist")),
        ("megatron-to-hf from torch", lambda: converters.megatron_to_hf(t, root / "hf-t")),
        ("megatron-to-hf from torch_dist", lambda: converters.megatron_to_hf(d, root / "hf-d")),
        ("megatron-to-megatron torch -> torch_dist pp2", lambda: converters.megatron_to_megatron(
            t, root / "t2d", pp=2, fmt="torch_dist")),
        ("megatron-to-megatron torch_dist -> torch tp2", lambda: converters.megatron_to_megatron(
            d, root / "d2t", tp=2, fmt="torch")),
    ]


def run(root: Path, layers: int) -> dict[str, list[float]]:
    write_hf_checkpoint(root / "hf", dict(CONFIG, num_hidden_layers=layers), dtype=float32)
    out = {}
    for label, fn in conversions(root):
        with PeakMemory() as m:
            fn()
        out[label] = [round(m.anon, 2), round(m.rss, 2)]
    return out


def main(argv: list[str]) -> None:
    root = Path(argv[0])
    run(root / "warm", 2)
    print(json.dumps({n: run(root / f"layers{n}", int(n)) for n in argv[1:]}))


if __name__ == "__main__":
    main(sys.argv[1:])
