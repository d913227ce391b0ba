"""Collectives: how long one takes on a group of GPUs, and how much of it the compute hides.

A ring collective over n GPUs moves a bus-bandwidth factor times the buffer over each GPU's
slowest link: all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, a
point-to-point send 1 (NCCL's "bus bandwidth"). The link is NVLink while the group stays in
one node and the GPU's InfiniBand NIC once it spans nodes; groups are consecutive in
Megatron's rank order tp-cp-(ep)-dp-pp, so a group of n members with stride s spans n x s
ranks. A ring collective (all-reduce, all-gather, reduce-scatter) over a group with k members in
each node runs one ring per NIC (NCCL's channels; rail-optimised nodes give each GPU its own NIC),
each ring leaving a node once: k NICs carry it, up to NVLink (``ring_bandwidth``). An all-to-all
or a send has no such rings: one NIC per GPU. The data-parallel collectives, one per bucket, pay
NCCL's own latency model (``nccl_latency``: a ring's steps grow with its ranks, the steps between
nodes cost more); the others pay LATENCY_S. NCCL is assumed to reach NCCL_EFFICIENCY of the
link's nominal bandwidth on large messages (an assumption, not measured here and not fitted: no
reference in the calibration set isolates it; a 4-node nccl-tests run agrees within 3% for 8
NICs a node, docs/planner.md) and LATENCY_S likewise.

Overlap (what a collective's time is charged against): ``hidden(comm, work)`` is the part of
``comm`` that ``work`` (compute that runs meanwhile) does not cover, max(0, comm - work).
"""
from __future__ import annotations

from ..hardware import GPU

NCCL_EFFICIENCY = 0.8
LATENCY_S = 10e-6
# NCCL's latency model (NVIDIA/nccl src/graph/tuning.cc at 5067397: ncclTunerConstantsDefaults and
# ncclTopoTuneModel), the Simple protocol NCCL picks for bucket-sized messages, microseconds
NCCL_BASE_US = 8.4  # baseLatencies, ring and tree
NCCL_NVLINK_US = {"ring": 3.4, "tree": 4.0}  # hwLatencies[NVLINK]: a step inside a node
NCCL_NET_US = 14.0  # hwLatencies[NET], ring and tree: a step between nodes
NCCL_NET_OVERHEAD_US = 3.0  # getNetOverhead (1 us on x86) x 3 for Simple: the least a step of a ring across nodes costs


def link_bandwidth(span: int, gpu: GPU, gpus_per_node: int) -> float:
    """Bytes/s NCCL reaches on the slowest link of a group spanning ``span`` consecutive ranks."""
    gbps = gpu.intra_node_gbps if span <= gpus_per_node else gpu.inter_node_gbps
    return gbps * 1e9 * NCCL_EFFICIENCY


def ring_bandwidth(n: int, stride: int, gpu: GPU, gpus_per_node: int) -> float:
    """Bytes/s NCCL reaches in a ring collective over ``n`` GPUs ``stride`` ranks apart: NVLink in
    one node; across nodes, one ring per NIC of the group's k = gpus_per_node / stride members in
    a node, each ring crossing between nodes once on its own NIC, so the rings share k NICs'
    bandwidth, up to NVLink's (the data every ring also moves inside the node). NCCL's maintainer:
    "8 NICs ... the algorithm bandwidth could be up to 8 x [a NIC's]; at this point the bottleneck
    becomes NVLink" (NVIDIA/nccl#320); 46-48 GB/s per NDR NIC (NVIDIA/nccl-tests#290)."""
    if n * stride <= gpus_per_node:
        return link_bandwidth(n * stride, gpu, gpus_per_node)
    k = members_per_node(n, stride, gpus_per_node)
    return min(gpu.intra_node_gbps, k * gpu.inter_node_gbps) * 1e9 * NCCL_EFFICIENCY


def members_per_node(n: int, stride: int, gpus_per_node: int) -> int:
    """How many of a group's ``n`` members, ``stride`` ranks apart, share a node."""
    return max(1, min(n, gpus_per_node // stride))


def nccl_latency(kind: str, n: int, per_node: int) -> float:
    """Seconds of latency NCCL's own model gives one ring collective over ``n`` ranks, ``per_node``
    of them in each node: a base, then each of the ring's steps (n - 1 for an all-gather or a
    reduce-scatter, 2 (n - 1) for an all-reduce) at NVLink's cost inside a node and the network's
    between nodes. An all-reduce may run as a tree instead (2 (per_node - 1) NVLink steps and 2
    log2(nodes) network ones): the lower of the two."""
    if n <= 1:
        return 0.0
    nodes = -(-n // per_node)
    intra = max(NCCL_NVLINK_US["ring"], NCCL_NET_OVERHEAD_US if nodes > 1 else 0.0)
    twice = kind == "allreduce"
    steps, across = (2 if twice else 1) * (n - 1), (2 if twice else 1) * (nodes - 1)
    us = NCCL_BASE_US + (steps - across) * intra + across * NCCL_NET_US
    if twice:
        tree = NCCL_BASE_US + 2 * ((per_node - 1) * NCCL_NVLINK_US["tree"] + (nodes.bit_length() - 1) * NCCL_NET_US)
        us = min(us, tree)
    return us * 1e-6


def collective(kind: str, n: int, nbytes: float, bw: float, latency: float = LATENCY_S) -> float:
    """Seconds of one collective of ``nbytes`` (the full buffer: the all-reduce's input, the
    all-gather's output, the all-to-all's per-GPU send buffer, the message of a send); ``latency``:
    what it pays besides its bytes (several collectives' when ``nbytes`` is split in buckets)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reducescatter": (n - 1) / n,
              "alltoall": (n - 1) / n, "send": 1.0}[kind]
    return latency + factor * nbytes / bw


def exposed(comm: float, work: float) -> float:
    """The part of a collective that compute running at the same time does not hide."""
    return max(0.0, comm - work)
