"""Qwen3-30B-A3B (fine-grained MoE: 128 experts, top-8, 3B active) pretraining on 16 H100
80GB (2 nodes x 8), bf16, DeepSpeed ZeRO-2 + Megatron-core expert parallelism.

Layout (`toolkit plan --auto`'s pick): EP8 x DP16 (expert data parallel 2: every rank holds
16 of the 128 experts of each of the 48 layers), no tensor or pipeline parallelism, no
recompute, micro 1, global 256, seq 4096, alltoall token dispatcher: 65.9 GiB/GPU, MFU ~30%
(estimated). Not ZeRO-1: at bf16 ZeRO-1 DeepSpeed's BF16_Optimizer keeps an unsharded fp32
gradient buffer beside the bf16 gradients (84.1 GiB/GPU, does not fit). Megatron-Bridge trains it on 8
GPUs with TP4 PP2 EP4 ETP1, micro 2, full recompute (74.8 GiB/GPU, MFU ~18% planned here;
docs/recipes.md).

    deepspeed --hostfile hostfile recipes/qwen3_30b_a3b.py --data /data/corpus_text_document
    deepspeed --num_gpus 2 recipes/qwen3_30b_a3b.py --flavor tiny --set parallel.ep=2
"""
from toolkit.cli.train import main
from toolkit.spec import TrainingSpec

TINY = "qwen3-moe-tiny"


def make_spec() -> TrainingSpec:
    return TrainingSpec.from_dict({
        "model": "qwen3-30b-a3b",
        "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {"tp": 1, "pp": 1, "ep": 8, "etp": 1},
        "zero": {"stage": 2},
        "precision": "bf16",
        "batch": {"micro": 1, "global": 256, "seq_len": 4096},
        "recompute": "none",
        "moe": {"token_dispatcher": "alltoall"},
        "optimizer": {"lr": 3e-4, "min_lr": 3e-5, "weight_decay": 0.1, "warmup_steps": 2000, "clip_grad": 1.0},
        "train": {"steps": 100000, "save_interval": 1000},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
