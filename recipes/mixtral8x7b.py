"""Mixtral-8x7B pretraining on 64 H100 80GB (8 nodes x 8), bf16, DeepSpeed ZeRO-2 +
Megatron-core expert parallelism (8 experts, top-2).

Layout (`toolkit plan --auto`'s pick): EP8 x DP64 (expert data parallel 8), no tensor or
pipeline parallelism, no recompute, micro 1, global 512, seq 4096, alltoall token dispatcher:
57.5 GiB/GPU, MFU ~50% (estimated). Not ZeRO-1: at bf16 ZeRO-1 DeepSpeed's BF16_Optimizer
keeps an unsharded fp32 gradient buffer beside the bf16 gradients (93.9 GiB/GPU, does not fit).
NeMo 2's recipe is TP1 PP4 VPP8 EP8.

    deepspeed --hostfile hostfile recipes/mixtral8x7b.py --data /data/corpus_text_document
    deepspeed --num_gpus 2 recipes/mixtral8x7b.py --flavor tiny --set parallel.ep=2
"""
from toolkit.cli.train import main
from toolkit.spec import TrainingSpec

TINY = "mixtral-tiny"


def make_spec() -> TrainingSpec:
    return TrainingSpec.from_dict({
        "model": "mixtral-8x7b",
        "cluster": {"nodes": 8, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {"tp": 1, "pp": 1, "ep": 8},
        "zero": {"stage": 2},
        "precision": "bf16",
        "batch": {"micro": 1, "global": 512, "seq_len": 4096},
        "recompute": "none",
        "moe": {"token_dispatcher": "alltoall"},
        "optimizer": {"lr": 1e-4, "min_lr": 1e-5, "weight_decay": 0.1, "warmup_steps": 2000, "clip_grad": 1.0},
        "train": {"steps": 100000, "save_interval": 1000},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
