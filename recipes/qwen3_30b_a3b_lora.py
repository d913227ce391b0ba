"""Qwen3-30B-A3B LoRA fine-tuning on chat data, one node of 8 H100 80GB: bf16, expert
parallelism over the 8 GPUs, the base frozen, rank-16 adapters on every attention and dense
linear layer (the experts keep theirs frozen: toolkit.runtime.lora), packed conversations.

    toolkit convert hf-to-megatron HF_DIR ckpt/qwen3-30b --format torch_dist   # HF_DIR: Qwen3-30B-A3B
    toolkit data prepare chat.jsonl --tokenizer HF_DIR --out data/chat --seq-len 4096
    deepspeed --num_gpus 8 recipes/qwen3_30b_a3b_lora.py --load ckpt/qwen3-30b --data data/chat \
        --export-peft runs/q3-lora
    deepspeed --num_gpus 2 recipes/qwen3_30b_a3b_lora.py --flavor tiny --set parallel.ep=2 --load TINY --data TINY_CHAT

Layout: EP8 x DP8 (each GPU holds 16 of the 128 experts of each layer and the whole attention),
ZeRO-1 (only the adapters have gradients and Adam states: 0.03 GiB), micro 1 (packed rows),
global 64 sequences of 4096 tokens, selective recompute: 35.7 GiB/GPU planned, 62,000 tokens/s,
MFU ~18% (estimated; `toolkit plan`). The adapters wrap megatron-core's local linear layers, so
attention runs unfused (megatron's local attention; selective recompute keeps its s x s scores
out of memory) where a full fine-tune would take TransformerEngine's flash attention: a rule
says so (runtime_lora). Learning rate 1e-4 to 1e-5 after 20 warm-up steps, 1,000 steps: typical
LoRA settings, to be chosen for the data at hand.
"""
from toolkit.cli.train import main
from toolkit.spec import TrainingSpec

TINY = "qwen3-moe-tiny"


def make_spec() -> TrainingSpec:
    return TrainingSpec.from_dict({
        "model": "qwen3-30b-a3b",
        "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {"tp": 1, "pp": 1, "ep": 8, "etp": 1},
        "zero": {"stage": 1},
        "precision": "bf16",
        "batch": {"micro": 1, "global": 64, "seq_len": 4096},
        "recompute": "selective",
        "attention": {"backend": "unfused"},
        "moe": {"token_dispatcher": "alltoall"},
        "finetune": {"method": "lora", "lora": {"rank": 16, "alpha": 32, "dropout": 0.0}},
        "optimizer": {"lr": 1e-4, "min_lr": 1e-5, "weight_decay": 0.0, "warmup_steps": 20, "clip_grad": 1.0},
        "train": {"steps": 1000, "save_interval": 250},
        "data": {"packing": True},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
