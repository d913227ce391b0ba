"""Collectives: how long one takes on a group of GPUs, and how much of it the compute hides.

A ring collective over n GPUs moves a bus-bandwidth factor times the buffer over each GPU's
slowest link: all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, a
point-to-point send 1 (NCCL's "bus bandwidth"). The link is NVLink while the group stays in
one node and the GPU's InfiniBand NIC once it spans nodes; groups are consecutive in
Megatron's rank order tp-cp-(ep)-dp-pp, so a group of n members with stride s spans n x s
ranks. NCCL is assumed to reach NCCL_EFFICIENCY of the link's nominal bandwidth on large
messages and every collective or send to pay LATENCY_S (assumptions, not measured here and not
fitted: no reference in the calibration set isolates them).

Overlap (what a collective's time is charged against): ``hidden(comm, work)`` is the part of
``comm`` that ``work`` (compute that runs meanwhile) does not cover, max(0, comm - work).
"""
from __future__ import annotations

from ..hardware import GPU

NCCL_EFFICIENCY = 0.8
LATENCY_S = 10e-6


def link_bandwidth(span: int, gpu: GPU, gpus_per_node: int) -> float:
    """Bytes/s NCCL reaches on the slowest link of a group spanning ``span`` consecutive ranks."""
    gbps = gpu.intra_node_gbps if span <= gpus_per_node else gpu.inter_node_gbps
    return gbps * 1e9 * NCCL_EFFICIENCY


def collective(kind: str, n: int, nbytes: float, bw: float) -> float:
    """Seconds of one collective of ``nbytes`` (the full buffer: the all-reduce's input, the
    all-gather's output, the all-to-all's per-GPU send buffer, the message of a send)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reducescatter": (n - 1) / n,
              "alltoall": (n - 1) / n, "send": 1.0}[kind]
    return LATENCY_S + factor * nbytes / bw


def exposed(comm: float, work: float) -> float:
    """The part of a collective that compute running at the same time does not hide."""
    return max(0.0, comm - work)
