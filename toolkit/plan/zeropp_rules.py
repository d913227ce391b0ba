"""ZeRO++'s hierarchical partitioning (zero.hpz_partition_size, DeepSpeed's zero_hpz_partition_size)
as rules: where DeepSpeed can build its secondary groups and where they hold copies of the same
partition.

DeepSpeed's engine ran it on this machine (2026-11-28: ZeRO-3, bf16, one CPU rank over gloo,
zero_hpz_partition_size 2, three steps), so the toolkit's runtime has no rule of its own; one rank
makes a secondary group of one, so the secondary partition itself was not exercised there.
"""
from __future__ import annotations

from collections.abc import Iterator

from .rules import Context, Finding, error, rule, warning


@rule(scope="training")
def zero_hpz(c: Context) -> Iterator[Finding]:
    """DeepSpeed builds the secondary groups from consecutive global ranks
    (groups._create_zero_param_parallel_group, world size divisible by their size); they must be
    ranks of one data-parallel group, which megatron's rank order (tp, then cp, fastest) gives only
    at tp = cp = 1."""
    n, z, lay = c.spec.zero.hpz_partition_size, c.spec.zero, c.layout
    if n <= 1:
        return
    if z.stage != 3:
        yield error(f"zero.hpz_partition_size={n} needs zero.stage=3 (zero.stage={z.stage}): ZeRO++'s secondary "
                    "partition is of ZeRO-3's partitioned parameters")
    if lay.tp * lay.cp > 1:
        yield error(f"zero.hpz_partition_size={n} with tp*cp = {lay.tp}*{lay.cp} = {lay.tp * lay.cp}: DeepSpeed "
                    "groups consecutive global ranks, which are tensor/context-parallel ranks holding different "
                    "shards; use tp = cp = 1")
    if lay.dp % n:
        yield error(f"zero.hpz_partition_size={n} does not divide dp={lay.dp}: each secondary group must hold "
                    "ranks of one data-parallel group")
    if n > lay.gpus_per_node:
        yield warning(f"zero.hpz_partition_size={n} > gpus_per_node={lay.gpus_per_node}: the backward's "
                      "all-gather leaves the node, which hierarchical partitioning is meant to avoid")
