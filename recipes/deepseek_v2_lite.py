"""DeepSeek-V2-Lite (15.7B MoE, 2.4B active: MLA without q LoRA, 64 routed experts + 2 shared,
top-6, the first layer dense) pretraining on 8 H100 80GB (one node), bf16, DeepSpeed ZeRO-1 +
Megatron-core expert parallelism.

Layout: EP4 x DP8 (every rank holds 16 of the 64 experts of each layer), micro 1, global 512,
seq 4096, no recompute: 65.0 GiB/GPU, MFU ~39% (estimated). `toolkit plan --auto` ranks
DP8 without expert parallelism (ZeRO-3, micro 2) 6% faster (67.1 GiB); EP4 keeps ZeRO-1 and
more memory free, within the estimate's error of the fastest.

    deepspeed --num_gpus 8 recipes/deepseek_v2_lite.py --data /data/corpus_text_document
    deepspeed --num_gpus 2 recipes/deepseek_v2_lite.py --flavor tiny --set parallel.ep=2
"""
from toolkit.cli.train import main
from toolkit.spec import TrainingSpec

TINY = "deepseek-v2-tiny"


def make_spec() -> TrainingSpec:
    return TrainingSpec.from_dict({
        "model": "deepseek-v2-lite",
        "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {"tp": 1, "pp": 1, "ep": 4, "etp": 1},
        "zero": {"stage": 1},
        "precision": "bf16",
        "batch": {"micro": 1, "global": 512, "seq_len": 4096},
        "recompute": "none",
        "moe": {"token_dispatcher": "alltoall"},
        "optimizer": {"lr": 4.2e-4, "min_lr": 4.2e-5, "weight_decay": 0.1, "warmup_steps": 2000, "clip_grad": 1.0},
        "train": {"steps": 100000, "save_interval": 1000},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
