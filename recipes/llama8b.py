"""Llama-3-8B pretraining on one node of 8 H100 80GB, bf16, DeepSpeed ZeRO-2, data parallel.

Layout (`toolkit plan --auto`'s fastest layout this runtime runs): TP1 x DP8, ZeRO-2, no
recompute, micro 1, global 128, seq 8192: 73.3 GiB/GPU, MFU ~53% (estimated). TP2 x DP4
with ZeRO-1 and sequence parallelism leaves more memory free (51 GiB) for 5% less.

    deepspeed --num_gpus 8 recipes/llama8b.py --data /data/corpus_text_document
    deepspeed --num_gpus 2 recipes/llama8b.py --flavor tiny
"""
from toolkit.cli.train import main
from toolkit.spec import TrainingSpec

TINY = "llama-tiny"


def make_spec() -> TrainingSpec:
    return TrainingSpec.from_dict({
        "model": "llama3-8b",
        "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {"tp": 1},
        "zero": {"stage": 2},
        "precision": "bf16",
        "batch": {"micro": 1, "global": 128, "seq_len": 8192},
        "recompute": "none",
        "optimizer": {"lr": 3e-4, "min_lr": 3e-5, "weight_decay": 0.1, "warmup_steps": 2000, "clip_grad": 1.0},
        "train": {"steps": 100000, "save_interval": 1000},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
