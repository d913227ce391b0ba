"""GLM-4.5-Air (106B MoE: 128 routed experts + 1 shared, top-8, sigmoid routing with the expert
bias, partial rope, QKV bias, one dense layer, one multi-token prediction module) pretraining on
32 H100 80GB (4 nodes x 8), bf16, DeepSpeed ZeRO-1 + Megatron-core pipeline and expert parallelism.

Layout: the published Megatron-Bridge recipe (glm45_air_106b_pretrain_32gpu_h100_bf16_config:
TP1 PP4 EP8 ETP1, seq 4096, GBS 2048, MBS 1, MTP 1 with loss scale 0.3, alltoall dispatcher).
Its 46 layers do not divide over 4 stages; megatron places them here as 10 + 13 + 13 + 10
(`parallel.first_stage_layers: 10`, `last_stage_layers: 10`: the last stage also holds the MTP
module and the loss). As Bridge writes it (selective recompute, optimizer states on the GPU) the
plan's first stage needs 111.7 GiB of 79.6: with expert data parallelism 1 (ep8 x pp4 = 32
ranks) ZeRO-1 shards none of the experts' fp32 states, 37 GiB per GPU. `toolkit plan --auto`'s
pick on the same 32 GPUs keeps Bridge's grid and moves the optimizer states to the host
(`zero.offload_optimizer: cpu`) without recompute: 55.2 GiB, 73.8 s per step (estimated; nothing
here has run on a GPU).

    deepspeed --hostfile hostfile recipes/glm45_air.py --data /data/corpus_text_document
    deepspeed --num_gpus 2 recipes/glm45_air.py --flavor tiny --set parallel.ep=2
"""
from toolkit.cli.train import main
from toolkit.spec import TrainingSpec

TINY = "glm4-moe-tiny"


def make_spec() -> TrainingSpec:
    return TrainingSpec.from_dict({
        "model": "glm-4.5-air",
        "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {"tp": 1, "pp": 4, "ep": 8, "etp": 1, "first_stage_layers": 10, "last_stage_layers": 10},
        "zero": {"stage": 1, "offload_optimizer": "cpu"},
        "precision": "bf16",
        "batch": {"micro": 1, "global": 2048, "seq_len": 4096},
        "recompute": "none",
        "moe": {"token_dispatcher": "alltoall"},
        "mtp": {"layers": 1, "loss_scale": 0.3},
        "optimizer": {"lr": 1e-4, "min_lr": 1e-5, "weight_decay": 0.1, "warmup_steps": 2000, "clip_grad": 1.0},
        "train": {"steps": 100000, "save_interval": 1000},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
