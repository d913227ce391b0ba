"""The tiny flavour of a recipe: the same spec at a tiny size on the ranks present.

Everything a recipe decides about how to train (ZeRO stage and offload, optimizer type,
MoE settings, seed) is kept; the size goes: the family's tiny model, one node of `ranks`
ranks, no model parallelism (choose it with --set parallel.tp=2 etc.), a small batch and
30 steps. Without CUDA the run is a CPU smoke test: fp32, megatron's local layer spec
(``attention.backend: auto`` resolves to unfused on cpu), megatron's allgather token dispatcher, the "cpu" entry of the
GPU registry (host memory); recompute stays as the recipe sets it (megatron's checkpointing
runs on CPU too).
"""
from __future__ import annotations

from ..spec import TrainingSpec

TINY_BATCH = {"micro": 2, "global": 8, "seq_len": 64}
TINY_TRAIN = {"steps": 30, "log_interval": 1, "save_interval": 15}
TINY_LR = {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 0}


def tiny_flavor(spec: TrainingSpec, model: str, ranks: int, cuda: bool | None = None) -> TrainingSpec:
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    d = spec.to_dict()
    d["model"] = model
    d["cluster"] = {"nodes": 1, "gpus_per_node": ranks, "gpu": spec.cluster.gpu if cuda else "cpu"}
    d["parallel"] = {}
    d["zero"] = {**d["zero"], "offload_param": "none", "nvme_path": None,
                 "offload_optimizer": "cpu" if spec.zero.offload_optimizer != "none" else "none"}
    d["batch"] = dict(TINY_BATCH, **({"micro": 1} if cuda and spec.data.packing else {}))  # THD: one row
    d["train"] = {**d["train"], **TINY_TRAIN, "data_path": None, "tokenizer": None}
    d["optimizer"] = {**d["optimizer"], **TINY_LR}
    if not cuda:
        d.update(precision="fp32")
        d["moe"] = {**d["moe"], "token_dispatcher": "allgather"}
    return TrainingSpec.from_dict(d)
