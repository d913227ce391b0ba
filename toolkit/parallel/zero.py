"""ZeRO's stages as DeepSpeed implements them: which model states each stage partitions over the
data-parallel group (Layout.dp_cp for dense weights, Layout.edp for experts), and how many of
DeepSpeed's communication buckets are alive at once. The planner's memory and time estimates and
the emitters read them here.

  stage | partitioned over the group
  0     | nothing (gradients all-reduced)
  1     | optimizer states (the fp32 master weights, Adam's moments; gradients reduce-scattered)
  2     | + gradients
  3     | + parameters (gathered layer by layer for forward and backward)
"""
from __future__ import annotations

SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}  # model state -> the first ZeRO stage partitioning it


def sharded(stage: int, state: str) -> bool:
    """Whether ZeRO ``stage`` partitions ``state`` ("optimizer", "grads", "params")."""
    return stage >= SHARDED_FROM[state]


def shards(stage: int, state: str, group: int) -> int:
    """Ways ZeRO ``stage`` splits ``state`` held by a data-parallel group of ``group`` ranks."""
    return group if sharded(stage, state) else 1


def buckets_in_flight(stage: int, sizes: dict[str, int]) -> int:
    """Elements of DeepSpeed's communication buckets alive at once (``sizes``: the bucket sizes the
    generated config gives, toolkit.backends.deepspeed.bucket_sizes): with overlap_comm two
    gradient buckets at ZeRO-1/2; a parameter prefetch bucket and a gradient bucket at ZeRO-3."""
    if sharded(stage, "params"):
        return sizes["stage3_prefetch_bucket_size"] + sizes["reduce_bucket_size"]
    if sharded(stage, "optimizer"):
        return 2 * sizes["reduce_bucket_size"]
    return 0
