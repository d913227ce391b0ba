"""Llama-3-70B pretraining on H100 80GB, bf16, DeepSpeed ZeRO-1 + Megatron-core TP/SP/PP.

Layouts (numbers from `toolkit plan`; docs/recipes.md compares them with published ones):
  make_spec()          1024 GPUs (128 nodes x 8): TP8 x PP8 x DP16, sequence parallel,
                       micro 1, global 2048, seq 4096 (the seed document's layout):
                       17.8 GiB/GPU, ~9.0 s/step, MFU ~40% (estimated).
  make_spec(gpus=32)   32 GPUs (4 nodes x 8), micro 1, global 512, seq 8192, no recompute:
                       Megatron-Bridge's published layout for this job, TP4 x PP4 x VPP5 x
                       CP2, sequence parallel (interleaved 1F1B, context parallel p2p ring):
                       76.6 GiB/GPU, MFU ~50% (estimated), 8% more tokens/s than TP8 x PP2.
                       `toolkit plan --auto` (5% memory headroom) ranks TP4 PP4 VPP20 CP2
                       within 1% of it; the tiny flavour runs this shape on 4 ranks:
                       `--set parallel.tp=2 --set parallel.cp=2` or `--set parallel.pp=2
                       --set parallel.vpp=2`.

    deepspeed --hostfile hostfile recipes/llama70b.py --data /data/corpus_text_document
    deepspeed --num_gpus 2 recipes/llama70b.py --flavor tiny --set parallel.tp=2
"""
from toolkit.cli.train import main
from toolkit.spec import TrainingSpec

TINY = "llama-tiny"
LAYOUTS = {
    1024: {"nodes": 128, "parallel": {"tp": 8, "pp": 8}, "batch": {"micro": 1, "global": 2048, "seq_len": 4096}},
    32: {"nodes": 4, "parallel": {"tp": 4, "pp": 4, "vpp": 5, "cp": 2},
         "batch": {"micro": 1, "global": 512, "seq_len": 8192}, "recompute": "none"},
}


def make_spec(gpus: int = 1024) -> TrainingSpec:
    lay = LAYOUTS[gpus]
    return TrainingSpec.from_dict({
        "model": "llama3-70b",
        "cluster": {"nodes": lay["nodes"], "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {**lay["parallel"], "sequence_parallel": True},
        "zero": {"stage": 1},
        "precision": "bf16",
        "batch": lay["batch"],
        "recompute": lay.get("recompute", "selective"),
        "optimizer": {"lr": 1.5e-4, "min_lr": 1.5e-5, "weight_decay": 0.1, "warmup_steps": 2000, "clip_grad": 1.0},
        "train": {"steps": 100000, "save_interval": 1000},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
