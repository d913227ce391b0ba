"""DeepSeek-V3 (671B MoE: MLA, 256 routed experts + 1 shared, top-8, aux-loss-free routing with
the expert bias) pretraining on 1024 H100 80GB (128 nodes x 8), bf16, DeepSpeed ZeRO-1 +
Megatron-core tensor, sequence, pipeline and expert parallelism.

Layout: the published Megatron-Bridge recipe (deepseek_v3_pretrain_1024gpu_h100_bf16: TP2 PP16
EP64 ETP1, SP, seq 4096, GBS 4096), whose PP16 layout puts 4 layers on each of the first 15
stages and 1 on the last (with the loss): here `parallel.last_stage_layers: 1`, megatron's
num_layers_in_first/last_pipeline_stage form of the same placement (4+4x14+1). As in Bridge's
layout, DeepSeek-V3's one multi-token prediction module (`mtp.layers: 1`, megatron's
mtp_loss_scaling_factor 0.1) sits on the last stage with that decoder layer and the loss.
No recompute: the plan's worst stage needs 69.4 GiB of 79.6 (full recompute: 19.4 GiB and
42% slower, the fallback if a GPU run measures more; nothing here has run on a GPU).

    deepspeed --hostfile hostfile recipes/deepseek_v3.py --data /data/corpus_text_document
    deepspeed --num_gpus 2 recipes/deepseek_v3.py --flavor tiny --set parallel.ep=2
    deepspeed --num_gpus 2 recipes/deepseek_v3.py --flavor tiny --set parallel.pp=2 --set parallel.last_stage_layers=1
"""
from toolkit.cli.train import main
from toolkit.spec import TrainingSpec

TINY = "deepseek-v3-tiny"


def make_spec() -> TrainingSpec:
    return TrainingSpec.from_dict({
        "model": "deepseek-v3",
        "cluster": {"nodes": 128, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {"tp": 2, "pp": 16, "ep": 64, "etp": 1, "sequence_parallel": True, "last_stage_layers": 1},
        "zero": {"stage": 1},
        "precision": "bf16",
        "batch": {"micro": 1, "global": 4096, "seq_len": 4096},
        "recompute": "none",
        "moe": {"token_dispatcher": "alltoall", "bias_update_rate": 1e-3},
        "mtp": {"layers": 1, "loss_scale": 0.1},
        "optimizer": {"lr": 2.2e-4, "min_lr": 2.2e-5, "weight_decay": 0.1, "warmup_steps": 2000, "clip_grad": 1.0},
        "train": {"steps": 100000, "save_interval": 1000},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
