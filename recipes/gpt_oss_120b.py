"""GPT-OSS-120B (117B MoE: 128 experts with biases, top-4, clamped SwiGLU, learned attention sinks,
sliding-window (128) and full attention alternating, yarn rope) pretraining on 64 H100 80GB
(8 nodes x 8), bf16, DeepSpeed ZeRO-1 + Megatron-core pipeline and expert parallelism.

Layout: Megatron-Bridge's H100 BF16 performance preset for GPT-OSS-120B
(scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py,
GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V1: 64 GPUs, TP1 PP4 EP8 ETP1, MBS 1, GBS 512; seq 4096
from its gpt_oss_120b_pretrain_config). Why it suits the model: the 36 layers split evenly into 4
stages of 9; an expert is small (2880 x 5760 + 2880 x 2880, 25M parameters), so tensor
parallelism would only cut GEMMs that are already narrow, while EP8 keeps each layer's 128 experts
16 to a GPU with the all-to-all inside one NVLink node; megatron-core builds experts with biases
only at ETP 1. Data parallelism is 16 (expert data parallelism 2, over which ZeRO-1 shards the
experts' fp32 states). Bridge recomputes the norms and the MoE activation (module-level recompute
this toolkit does not express); the plan fits without recompute: 63.9 / 56.6 / 52.0 / 54.6 GiB
on the four stages, 3.94 s per step, MFU 27.5%, 8,321 tokens/s per GPU (estimated; nothing here
has run on a GPU). On megatron's local layers (CPU ranks, the tiny flavour) the experts' fc2 has
an output of its own so that megatron-core's in-place expert-bias add can backpropagate
(toolkit.mcore.expert_bias).

    deepspeed --hostfile hostfile recipes/gpt_oss_120b.py --data /data/corpus_text_document
    deepspeed --num_gpus 2 recipes/gpt_oss_120b.py --flavor tiny --set parallel.ep=2
"""
from toolkit.cli.train import main
from toolkit.spec import TrainingSpec

TINY = "gpt-oss-tiny"


def make_spec() -> TrainingSpec:
    return TrainingSpec.from_dict({
        "model": "gpt-oss-120b",
        "cluster": {"nodes": 8, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {"tp": 1, "pp": 4, "ep": 8, "etp": 1},
        "zero": {"stage": 1},
        "precision": "bf16",
        "batch": {"micro": 1, "global": 512, "seq_len": 4096},
        "recompute": "none",
        "moe": {"token_dispatcher": "alltoall"},
        "optimizer": {"lr": 1e-4, "min_lr": 1e-5, "weight_decay": 0.1, "warmup_steps": 2000, "clip_grad": 1.0},
        "train": {"steps": 100000, "save_interval": 1000},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
