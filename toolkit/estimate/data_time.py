"""Data-parallel and optimizer seconds of a step: gradient reduction and ZeRO gathers per bucket,
overlapped with the compute that runs meanwhile as each target's engine schedules them, the
optimizer step and offload traffic.

Parameters are gathered in 16-bit over the GPUs holding the same weights (dp x cp for dense
weights, the expert data-parallel group for experts); gradients are reduced in fp32 by
Megatron-LM's default under --bf16, in the 16-bit dtype by DeepSpeed (memory.grad_reduce_bytes).
Each bucket is one NCCL call: its bytes over the group's rings (comm.ring_bandwidth: as many NICs
as the group has members in a node) and NCCL's latency for a ring of the group's size
(comm.nccl_latency), once per call (Buckets.calls). DeepSpeed's gradient buckets and ZeRO-3's
prefetch take whole tensors, so their calls are counted over the stage's tensors in order
(tensor_calls: a tensor larger than the bucket is a call of its own), and so do Megatron-LM's
(megatron_buckets); the other buckets (ZeRO-1/2's step all-gather of flat partitions, FSDP's units)
as elements / size.

Megatron-LM (target megatron-lm; the generated flags set --overlap-grad-reduce and
--overlap-param-gather), buckets of max(40M, 1M x dp) elements, formed as megatron-core's
_ParamAndGradBuffer forms them (megatron_buckets: the parameters in reverse, whole tensors, a
shared embedding alone, routed experts in the dense buffer at ep 1) on the first pipeline stage's first
model chunk only (DistributedDataParallel: every other chunk one bucket, StageParams.bucketed); a
bucket's collective overlaps the compute that runs after its gradients are ready, so the first stage's
last bucket, the first layers' and the embedding's (Buckets.edges), is exposed at least (``_overlapped``),
and a later stage's one bucket a chunk starts when the chunk's last backward is done:
  ZeRO-0/1  the reduce-scatter (ZeRO-0: all-reduce) runs during the last micro-batch's backward
            of the stage and the pipeline drain behind it; the parameter all-gather of ZeRO-1
            during the next step's first forward: dispatched on every stage when the step starts
            with the interleaved schedule (align_param_gather; megatron-core <= 0.8 at any vpp:
            estimate.param_gather_at_start), so a later stage's behind the pipeline fill; without
            interleaving by each stage's first forward pre-hook, on demand (Buckets.aligned false): a
            later stage's one bucket is waited for whole, and the waits add along the pipeline
DeepSpeed (targets recipes and hf: the engine built from toolkit.emit.deepspeed's config,
buckets from toolkit.backends.deepspeed.bucket_sizes), ``dp_engine`` says which of its paths runs:
  allreduce   no ZeRO (engine.allreduce_gradients -> buffered_allreduce_fallback), or ZeRO-1 with
              bf16 weights and fp32 accumulation without offload, which DeepSpeed gives to its
              BF16_Optimizer (engine._do_optimizer_sanity_check): the gradients all-reduced after
              the last micro-batch's backward, nothing overlapped; ZeRO-1's updated shards
              all-gathered inside the step (all_gather_dp_groups), exposed too
  overlapped  stage_1_and_2 / stage3 with overlap_comm (the config's): the reduce-scatter of each
              reduce bucket on its own stream behind the backward that follows, the last bucket
              (deepspeed_tail: the bucket held when the backward ends, the embedding's on the first
              stage) waited for at the backward's end (the reduce epilogue synchronises the stream);
              ZeRO-1 at the last micro-batch, ZeRO-2 at every one; their all-gather in the step,
              exposed. ZeRO-3 every micro-batch: each sub-module's parameters all-gathered before
              it runs, the next ones (stage3_prefetch_bucket_size elements) prefetched behind it
              (partitioned_param_coordinator.fetch_sub_module), so the first fetch of the forward
              (first_bucket: the embedding, on the first stage) is exposed and the rest hidden up
              to the forward's compute; in the backward the
              parameters are gathered again, except those used again within
              stage3_max_reuse_distance elements of the trace (not released), beside the
              gradients' reduce-scatter; with ZeRO++'s hierarchical partitioning
              (zero.hpz_partition_size) that backward gather runs over the secondary partition's
              group, a node's NVLink, instead of the data-parallel group
  exposed     the recipes runtime with pp > 1 turns overlap_comm off (toolkit.runtime.engine):
              every reduction and gather on the compute stream
The step waits for the slowest stage's reduction (the gradient norm spans the stages).
DeepSpeed ZeRO-3's host-side work (its fetch/release hooks on every module holding parameters,
forward and backward: ZERO3_HOST_S per module and micro-batch, StageParams.modules counting the
modules of the model that runs: megatron-core's, or transformers' for target hf, memory.spec_stage_params)
bounds a micro-batch from below: where it outlasts the stage's GPU work
(compute and exposed communication) the difference is exposed. The constant was measured on this
project's CPU (benchmarks/zero3_host_overhead.py), not on a GPU host.
PyTorch FSDP (zero.engine fsdp, a planning input for runs made with it) as DeepSpeed's overlapped
path with its own unit: one all-gather and one reduce-scatter per decoder layer (fsdp_unit), the
forward's gathers prefetched behind the layer before, every unit gathered again for the backward
(FULL_SHARD reshards after the forward), no per-module host work; SHARD_GRAD_OP (stage 2) as
ZeRO-2, NO_SHARD (stage 0) as the all-reduce path.
The optimizer step reads and writes OPTIMIZER_BYTES per parameter of this GPU's shard at
memory bandwidth (Adam in fp32: parameter, gradient, two moments read; parameter and moments
written; the 16-bit copy written). Offload: the gradients to host and parameters back over
PCIe (PCIE_GBPS) and the CPU Adam step (CPU_ADAM_PARAMS_PER_S per GPU) replace it; parameter
offload moves the parameters over PCIe twice per micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from math import ceil, inf
from operator import attrgetter

from ..backends.deepspeed import MAX_REUSE_DISTANCE, MEMORY_OPT_ALLREDUCE_SIZE, hidden_bucket_sizes
from ..hardware import GPU
from ..parallel.layout import Layout
from ..parallel.precision import element_bytes
from ..parallel.zero import sharded, shards
from ..spec import Zero
from .comm import collective, members_per_node, nccl_latency, ring_bandwidth
from .memory import StageParams, bf16_optimizer
from .stage_time import StageTime

# DeepSpeed ZeRO-3's host work per parameter-holding module and micro-batch (its fetch/release hooks, forward and
# backward), over ZeRO-2's: benchmarks/zero3_host_overhead.py, 219 us per one-parameter Linear, measured on this
# project's CPU (DeepSpeed 0.19.8, one rank), not on a GPU host
ZERO3_HOST_S = 219e-6
PCIE_GBPS = 25.0
CPU_ADAM_PARAMS_PER_S = 2.5e8
OPTIMIZER_BYTES = 30
_BACKWARD, _FORWARD = attrgetter("backward"), attrgetter("forward")


@dataclass(frozen=True)
class Buckets:
    """What the exposure of a layout's data-parallel communication depends on besides its
    stages: the engine's path (``dp_engine``) and its bucket sizes in elements."""

    engine: str  # "megatron", "allreduce", "overlapped", "exposed"
    reduce: float  # gradient bucket
    prefetch: float = 0.0  # ZeRO-3's prefetch bucket
    reuse: float = 0.0  # ZeRO-3's stage3_max_reuse_distance
    gather: float = 0.0  # the parameters one all-gather call holds (0: a gradient bucket's)
    # whether a bucket takes whole tensors (DeepSpeed's gradient buckets, ZeRO-3's prefetch, Megatron's
    # buffer): its calls are then counted over the stage's tensors (tensor_calls, megatron_buckets), else
    # as elements / size
    whole_reduce: bool = False
    whole_gather: bool = False
    # Megatron at ep 1: the experts' tensors are in the dense buffer (their ``allreduce`` attribute is set
    # only with expert parallelism), bucketed with the layers' other tensors
    merged_experts: bool = False
    # Megatron's parameter all-gathers: every stage's first one dispatched when the step starts (the
    # interleaved schedule's align_param_gather; megatron-core <= 0.8's zero_grad), else each stage's at its
    # first forward, on demand (Megatron-LM without interleaving since megatron-core 0.9)
    aligned: bool = True

    def calls(self, elements: float, gather: bool = False, p: StageParams | None = None,
              expert: bool = False) -> int:
        """Collectives of a reduction (or a gather) of ``elements``: one per bucket; ``p``: the stage's
        StageParams, whose tensors are read where the bucket takes whole tensors (``expert``: the expert
        group's)."""
        if elements <= 0:
            return 0
        size = (self.gather or self.reduce) if gather else self.reduce
        if p is not None and p.tensors and (self.whole_gather if gather else self.whole_reduce):
            if self.engine == "megatron":  # one buffer's buckets for the gradients and the parameters
                return self._megatron(p.tensors, expert, p.shared, p.bucketed)[0]
            return tensor_calls(p.tensors, expert, size, flush=not gather)
        return ceil(elements / size)

    def _megatron(self, tensors: tuple, expert: bool, shared: tuple, bucketed: bool) -> tuple[int, float]:
        """megatron_buckets of the dense or the ``expert`` buffer (none of its own with merged experts); one
        bucket but a shared embedding's where the stage is not ``bucketed`` (StageParams.bucketed)."""
        size = self.reduce if bucketed else inf
        if self.merged_experts:
            return (0, 0.0) if expert else megatron_buckets(tensors, BOTH, size, shared)
        return megatron_buckets(tensors, int(expert), size, shared)

    def edges(self, p: StageParams) -> tuple[float, float]:
        """Elements of the stage's first bucket gathered in the forward and of its last one reduced in the
        backward, which no compute hides (0: one bucket's size, what _exposed and _zero3 take then).
        Megatron's buffer gathers first the bucket it reduces last (megatron_buckets: the first layers' and
        the embedding's on the first stage). DeepSpeed's gradients arrive in the backward's order and the
        bucket held at the end is reduced in the epilogue (deepspeed_tail); ZeRO-3's first fetch, on demand,
        is the forward's first bucket (first_bucket: the embedding, on the first stage)."""
        if not p.tensors:
            return 0.0, 0.0
        groups = [x for x, n in ((False, p.dense), (True, p.expert)) if n]
        if self.engine == "megatron":
            last = sum(self._megatron(p.tensors, x, p.shared, p.bucketed)[1] for x in groups)
            return last, last
        last = sum(deepspeed_tail(p.tensors, x, self.reduce) for x in groups) if self.whole_reduce else 0.0
        first = sum(first_bucket(p.tensors, x, self.prefetch) for x in groups) if self.whole_gather else 0.0
        return first, last


BOTH = 2  # megatron_buckets' ``group``: the dense and the expert tensors in one buffer


def _group_runs(groups: tuple, group: int) -> tuple:
    """A StageParams.tensors entry's runs of ``group``: 0 (False) the dense, 1 (True) the expert, BOTH both,
    each layer's dense tensors before its experts."""
    return groups[0] + groups[1] if group == BOTH else groups[int(group)]


@lru_cache(maxsize=16384)
def tensor_calls(tensors: tuple, expert: bool, size: float, flush: bool = False) -> int:
    """DeepSpeed's collectives over a stage's tensors in order (StageParams.tensors: the dense or the
    ``expert`` group's) with buckets of ``size`` elements that take whole tensors. ZeRO-3's prefetch
    (partitioned_param_coordinator.fetch_sub_module's loop) closes a bucket once it holds ``size``
    elements; the gradient buckets (``flush``: stage3's and stage_1_and_2's
    reduce_independent_p_g_buckets_and_remove_grads) are sent before the tensor that would overflow them.
    Either way a tensor of ``size`` or more is a call of its own. Checked against DeepSpeed's own gather
    calls on 2 CPU ranks (tests/toolkit/estimate/test_zero3_prefetch.py)."""
    step = _flush_run if flush else _close_run
    calls, held = 0, 0.0
    for groups, layers in tensors:
        runs = _group_runs(groups, expert)
        if runs:
            held, calls, _ = _walk(runs, layers, size, step, held, calls, 0.0)
    return calls + (held > 0)


WALKED_LAYERS = 4096  # layers of one kind walked one by one at most; more than any model has


def _walk(runs: tuple, layers: int, size: float, step, held: float, calls: int,
          last: float) -> tuple[float, int, float]:
    """``layers`` layers of ``runs`` through ``step`` (_close_run, _flush_run) from (``held``, ``calls``,
    ``last``), the state after them. The layers are alike, so once the bucket being filled holds at a
    layer's start what it held at an earlier one, the layers between repeat until the end: whole
    repetitions are counted at once. Past WALKED_LAYERS without a repetition (only a spec beyond any model
    gets there) the rest are counted as elements / size."""
    seen: dict[float, tuple[int, int]] = {}
    k = 0
    while k < layers:
        if held in seen:
            k0, calls0 = seen.pop(held)
            times = (layers - k) // (k - k0)
            calls, k = calls + times * (calls - calls0), k + times * (k - k0)
            seen.clear()  # fewer layers than a repetition are left: walked
            if k == layers:
                break
        elif k >= WALKED_LAYERS:  # the rest as elements / size, the bucket being filled kept
            rest = held + (layers - k) * sum(n * count for n, count in runs)
            return rest % size, calls + int(rest // size), last
        seen[held] = (k, calls)
        for n, count in runs:
            held, calls, closed = step(held, calls, n, count, size)
            last = closed or last
        k += 1
    return held, calls, last


@lru_cache(maxsize=16384)
def deepspeed_tail(tensors: tuple, expert: bool, size: float) -> float:
    """Elements of DeepSpeed's last gradient bucket over a stage's tensors (StageParams.tensors; ``expert``:
    the expert group's): the gradients arrive in the backward's order, the tensors reversed, a bucket is
    sent before the tensor that would overflow it (reduce_independent_p_g_buckets_and_remove_grads), and
    the one held at the end is reduced in the epilogue after the backward. Checked against DeepSpeed's own
    buckets on 2 CPU ranks (tests/toolkit/estimate/test_zero3_prefetch.py)."""
    held = 0.0
    for groups, layers in reversed(tensors):
        runs = _group_runs(groups, expert)
        if runs:
            held = _walk(runs[::-1], layers, size, _flush_run, held, 0, 0.0)[0]
    return held


@lru_cache(maxsize=16384)
def first_bucket(tensors: tuple, expert: bool, size: float) -> float:
    """Elements of the first bucket of tensors in order that closes at ``size`` (ZeRO-3's prefetch rule), or
    of all of them if none closes: the forward's first gather."""
    held = 0.0
    for groups, layers in tensors:
        runs = _group_runs(groups, expert)
        per_layer = sum(n * count for n, count in runs)
        if not per_layer:
            continue
        alike = min(layers, max(0, ceil((size - held) / per_layer) - 1))  # whole layers that do not close it
        held += alike * per_layer
        if alike < layers:  # the next layer closes it
            for n, count in runs:
                if held + count * n >= size:
                    return held + max(1, ceil((size - held) / n)) * n
                held += count * n
    return held


@lru_cache(maxsize=16384)
def megatron_buckets(tensors: tuple, group: int, size: float, shared: tuple = ()) -> tuple[int, float]:
    """(buckets, elements of the last one) of megatron-core's gradient buffer over a stage's tensors
    (StageParams.tensors, ``shared``: its shared-embedding entries; ``group``: 0 the dense buffer's, 1 the
    expert buffer's, BOTH one buffer of both, each layer's dense tensors before its experts):
    _ParamAndGradBuffer walks the parameters in reverse, backprop order, and closes a bucket once it holds
    ``size`` elements, a whole tensor at a time; a shared embedding is a bucket of its own. Its last bucket,
    the first layers' and the embedding's, is reduced after the backward and gathered before the forward.
    Checked against megatron-core's own buffer (tests/toolkit/estimate/test_megatron_buckets.py)."""
    calls, held, last = 0, 0.0, 0.0
    for i in range(len(tensors) - 1, -1, -1):
        groups, layers = tensors[i]
        runs = _group_runs(groups, group)
        if not runs:
            continue
        if i in shared:  # the bucket being filled is closed, and this tensor closes its own
            if held:
                calls, last = calls + 1, held
            calls, held, last = calls + 1, 0.0, float(sum(n * count for n, count in runs))
            continue
        held, calls, last = _walk(runs[::-1], layers, size, _close_run, held, calls, last)
    if held:
        calls, last = calls + 1, held
    return calls, last


def _close_run(held: float, calls: int, n: int, count: int, size: float) -> tuple[float, int, float]:
    """``count`` tensors of ``n`` elements into buckets that close at ``size``: (elements held, calls,
    elements of the last bucket closed, 0 if none)."""
    if n <= 0 or count <= 0 or held + count * n < size:  # (size: inf, buckets off)
        return held + max(0, count) * max(0, n), calls, 0.0
    first = max(1, ceil((size - held) / n))  # the tensors that close the bucket being filled
    per = max(1, ceil(size / n))
    rest = count - first
    return (rest % per) * n, calls + 1 + rest // per, float(per * n if rest // per else held + first * n)


def _flush_run(held: float, calls: int, n: int, count: int, size: float) -> tuple[float, int, float]:
    """``count`` tensors of ``n`` elements into buckets sent before one would overflow ``size``: (elements
    held, calls, 0: the last bucket sent is not kept)."""
    if n <= 0 or count <= 0:
        return held, calls, 0.0
    per = max(1, int(size // n))  # tensors a bucket holds (one, if a tensor alone overflows it)
    room = max(0, int((size - held) // n)) if held else per
    if count <= room:
        return held + count * n, calls, 0.0
    rest = count - room  # the held bucket is sent; the rest fill buckets of ``per``, the last one held
    sent = (1 if held or room else 0) + (rest - 1) // per
    return (rest - (rest - 1) // per * per) * n, calls + sent, 0.0


def dp_engine(target: str, precision: str, zero: Zero, pp: int) -> str:
    """Which path of the target's engine reduces the gradients (module docstring)."""
    if target == "megatron-lm":
        return "megatron"
    if zero.stage == 0 or bf16_optimizer(target, precision, zero):
        return "allreduce"
    return "exposed" if target == "recipes" and pp > 1 else "overlapped"


def buckets(target: str, precision: str, zero: Zero, lay: Layout, hidden: int, unit: float | None = None,
            sizes: dict[str, int] | None = None, gather_at_start: bool = False) -> Buckets:
    """``unit``: the parameters of one FSDP unit (fsdp_unit), needed with zero.engine fsdp; ``sizes``: the
    DeepSpeed config's bucket sizes and reuse distance (backends.deepspeed.bucket_sizes of the spec; None:
    the model-based ones of ``hidden``, what a spec without ``deepspeed.zero_optimization`` sizes gets);
    ``gather_at_start``: estimate.param_gather_at_start (Megatron's all-gathers aligned without interleaving)."""
    engine = dp_engine(target, precision, zero, lay.pp)
    if engine == "megatron":  # DistributedDataParallel's default bucket_size; the buffer takes whole tensors
        return Buckets(engine, max(40e6, 1e6 * lay.dp_cp), whole_reduce=True, whole_gather=True,
                       merged_experts=lay.ep == 1, aligned=lay.vpp > 1 or gather_at_start)
    if zero.engine == "fsdp":  # one collective per unit, each unit gathered again for the backward (reshard)
        if not unit:
            raise ValueError("zero.engine fsdp: buckets() needs the parameters of one FSDP unit (fsdp_unit)")
        return Buckets("allreduce" if zero.stage == 0 else "overlapped", unit, unit, 0.0, unit)
    b = sizes or hidden_bucket_sizes(hidden)
    prefetch = float(b["stage3_prefetch_bucket_size"])
    # engine.allreduce_gradients' buffers (MEMORY_OPT_ALLREDUCE_SIZE) on the all-reduce path; ZeRO-3 gathers
    # what a fetch prefetches, ZeRO-1/2 their updated shards by allgather_bucket_size
    reduce = float(MEMORY_OPT_ALLREDUCE_SIZE if engine == "allreduce" else b["reduce_bucket_size"])
    # DeepSpeed's gradient buckets (ZeRO-1/2's ipg bucket, ZeRO-3's reduce_independent_p_g_buckets...) and
    # ZeRO-3's prefetch take whole tensors; ZeRO-1/2's step all-gather splits flat partitions by size
    whole = engine in ("overlapped", "exposed")
    return Buckets(engine, reduce, prefetch, float(b.get("stage3_max_reuse_distance", MAX_REUSE_DISTANCE)),
                   prefetch if zero.stage == 3 else float(b["allgather_bucket_size"]), whole, whole and zero.stage == 3)


def fsdp_unit(params: list[StageParams], layers: int) -> float:
    """Parameters of one FSDP unit on a GPU: FSDP wraps each decoder layer (torchtitan's
    apply_fsdp, llm-foundry's fsdp_wrap_fn), the root the embedding and output layer; taken as the
    model's parameters over its layers (the root's counted into them: one call per layer)."""
    return sum(p.dense + p.expert for p in params) / layers


def _overlapped(comm: float, work: float, bucket_fraction: float) -> float:
    """Exposed seconds of a bucketed collective overlapped with ``work``: at least one bucket."""
    return max(comm * bucket_fraction, comm - work)


def _group_collective(kind: str, n: int, stride: int, elements: float, nbytes: float, gpu: GPU, gpus_per_node: int,
                      bucket: Buckets, p: StageParams | None = None, expert: bool = False,
                      calls: int | None = None) -> float:
    """Seconds of a data-parallel group's collective of ``elements`` (``nbytes``), one NCCL call per
    bucket: its bytes over the group's rings, each call's latency by NCCL's model (``p``: the stage's
    StageParams, whose tensors Buckets.calls reads, ``expert``: its expert group's; ``calls``: the count,
    where the caller has it)."""
    if calls is None:
        calls = bucket.calls(elements, kind == "allgather", p, expert)
    latency = calls * nccl_latency(kind, n, members_per_node(n, stride, gpus_per_node))
    return collective(kind, n, nbytes, ring_bandwidth(n, stride, gpu, gpus_per_node), latency)


def _stage_comm(lay: Layout, gpu: GPU, p: StageParams, zero: Zero, w_param: int,
                grad_bytes: int, bucket: Buckets) -> tuple[float, float, float, float, float, float]:
    """(gradient reduction, parameter gather, parameters, backward gather, ZeRO-3's host work per
    micro-batch, Buckets.edges) of one GPU of a stage, per occurrence."""
    # the GPUs holding the same weights; Megatron's rank order tp-cp-dp-pp (experts: etp-ep-edp-pp): the
    # dense group's members tp apart, the expert data-parallel group's etp x ep apart
    groups = ((lay.dp_cp, lay.tp, p.dense, False), (lay.edp, lay.etp * lay.ep, p.expert, True))
    partitioned = sharded(zero.stage, "optimizer")  # each rank steps its shard: reduce-scatter, then gather it
    reduce = "allreduce" if bucket.engine == "allreduce" or not partitioned else "reducescatter"
    gpn = lay.gpus_per_node
    grads = sum(_group_collective(reduce, n, stride, e, grad_bytes * e, gpu, gpn, bucket, p, x)
                for n, stride, e, x in groups)
    gather = 0.0 if not partitioned else sum(
        _group_collective("allgather", n, stride, e, w_param * e, gpu, gpn, bucket, p, x)
        for n, stride, e, x in groups)
    deepspeed3 = zero.stage == 3 and zero.engine == "deepspeed" and bucket.engine in ("overlapped", "exposed")
    host = ZERO3_HOST_S * p.modules if deepspeed3 else 0.0
    again = secondary_gather(lay, gpu, p, zero, w_param, gather, bucket)
    return grads, gather, p.dense + p.expert, again, host, bucket.edges(p)


def secondary_gather(lay: Layout, gpu: GPU, p: StageParams, zero: Zero, w_param: int, gather: float,
                     bucket: Buckets) -> float:
    """Seconds of ZeRO-3's backward all-gather: the forward's over the data-parallel group, or with
    ZeRO++'s hierarchical partitioning (zero.hpz_partition_size = N) over the N neighbouring ranks
    holding the secondary partitions (DeepSpeed's _create_zero_param_parallel_group: consecutive
    global ranks, a node's NVLink when N <= gpus_per_node)."""
    n = zero.hpz_partition_size
    if zero.stage != 3 or n <= 1:
        return gather
    e = p.dense + p.expert
    calls = bucket.calls(p.dense, True, p) + bucket.calls(p.expert, True, p, True)
    return _group_collective("allgather", n, 1, e, w_param * e, gpu, lay.gpus_per_node, bucket, calls=calls)


def stage_comms(lay: Layout, gpu: GPU, params: list[StageParams], zero: Zero, precision: str,
                grad_bytes: int, bucket: Buckets) -> list[tuple]:
    """(gradient reduction, parameter gather, parameters, ZeRO-3's backward gather, ZeRO-3's host
    work, Buckets.edges) seconds/count of one GPU of each stage; ``grad_bytes``: memory.grad_reduce_bytes;
    ``bucket``: buckets()."""
    w_param = element_bytes(precision)
    seen: dict = {}
    for p in params:  # one per distinct stage (not setdefault: that would compute it for every stage)
        if (p.dense, p.expert, p.modules, p.bucketed) not in seen:
            seen[(p.dense, p.expert, p.modules, p.bucketed)] = _stage_comm(lay, gpu, p, zero, w_param, grad_bytes,
                                                                            bucket)
    return [seen[(p.dense, p.expert, p.modules, p.bucketed)] for p in params]


def _regathered(again: float, n: float, b: Buckets) -> float:
    """ZeRO-3's backward gather (``again``: secondary_gather) less the parameters kept for reuse:
    the forward's last stage3_max_reuse_distance / 2 elements."""
    return again * (1 - min(1.0, b.reuse / 2 / n))


def _zero3(st: StageTime, grads: float, gather: float, n: float, b: Buckets, again: float, host: float,
           edges: tuple[float, float]) -> float:
    """Exposed seconds of one micro-batch's ZeRO-3 traffic on a stage (module docstring): the
    forward's first gather (``edges``: Buckets.edges; 0: a prefetch bucket) and what its compute does not
    hide; the backward's gathers (``again``: secondary_gather; less the parameters kept for reuse) and
    reduce-scatter, the last reduce bucket at least; and the hooks' host work (``host``) where it outlasts
    the GPU's."""
    regathered = _regathered(again, n, b)
    if b.engine == "exposed":
        comm = gather + regathered + grads
    else:
        first, last = edges
        comm = (_overlapped(gather, st.forward, min(1.0, (first or b.prefetch) / n))
                + max(grads * min(1.0, (last or b.reduce) / n), regathered + grads - st.backward))
    return comm + max(0.0, host - st.total - comm)


def _exposed(zero_stage: int, st: StageTime, grads: float, gather: float, n: float, m: int, b: Buckets,
             drain_b: float, fill_f: float, v: int, again: float, host: float,
             edges: tuple[float, float], first_stage: bool) -> tuple[float, float]:
    """(reduction, gather) exposed seconds of a step on one stage, by the engine's path; ``edges``:
    Buckets.edges."""
    frac = min(1.0, (edges[1] or b.reduce) / n)
    if b.engine == "megatron":  # drain: earlier stages still run their last backward; fill: before the first forward
        if zero_stage == 2:
            return m * _overlapped(grads, st.backward, frac), _overlapped(gather, st.forward + fill_f / v, frac)
        if zero_stage == 3:
            return (m * _overlapped(grads + gather, st.backward, frac),
                    m * _overlapped(gather, st.forward, frac))
        if not first_stage:  # a bucket a model chunk (StageParams.bucketed), reduced once the chunk's last
            # backward is done: the first chunk's share behind the earlier stages' drain, the others' behind
            # the stage's remaining backward too; gathered behind the fill likewise where aligned, else whole
            # at the first forward, which dp_seconds adds along the pipeline
            reduce = max(0.0, (grads - drain_b) / v, grads - st.backward - drain_b / v)
            return reduce, max(0.0, (gather - fill_f) / v, gather - st.forward - fill_f / v) if b.aligned else 0.0
        return _overlapped(grads, st.backward, frac), _overlapped(gather, st.forward, frac)
    if zero_stage == 3:
        return m * _zero3(st, grads, gather, n, b, again, host, edges), 0.0
    per_step = 1 if zero_stage <= 1 else m  # ZeRO-2 reduces every micro-batch
    reduce = grads if b.engine in ("allreduce", "exposed") else _overlapped(grads, st.backward, frac)
    return per_step * reduce, gather  # the step's all-gather (ZeRO-1/2), on the compute stream


def dp_seconds(lay: Layout, stages: list[StageTime], comms: list[tuple], zero_stage: int, *, grad_accum: int,
               bucket: Buckets, first: list[int] | None = None) -> float:
    """Exposed data-parallel seconds of a step; ``comms`` from stage_comms, ``bucket`` from buckets;
    ``first``: the index of each distinct (stage, comm) pair's first stage, in order, when the caller
    knows them (the search: the first stage of each stage signature)."""
    m, v = grad_accum, lay.vpp
    reduce_exposed = gather_exposed = 0.0
    if first is None:  # a repeated (stage, comm) exposes no more: its windows only grow along the pipeline
        seen: dict[tuple[int, int], int] = {}
        for k, key in enumerate(zip(map(id, stages), map(id, comms))):
            seen.setdefault(key, k)
        first = list(seen.values())
    # the backward / forward of the stages before each (the drain behind it, the fill before it): read by
    # Megatron-LM's path only
    megatron = bucket.engine == "megatron"
    if megatron:
        drains = [0.0, *accumulate(map(_BACKWARD, stages))]
        fills = [0.0, *accumulate(map(_FORWARD, stages))]
    for k in first:
        st, (grads, gather, n, again, host, edges) = stages[k], comms[k]
        if n and grads + gather + host:
            r, g = _exposed(zero_stage, st, grads, gather, n, m, bucket, drains[k] if megatron else 0.0,
                            fills[k] if megatron else 0.0, v, again, host, edges, k == 0)
            reduce_exposed, gather_exposed = max(reduce_exposed, r), max(gather_exposed, g)
    if megatron and not bucket.aligned and zero_stage <= 1:  # gathered on demand: each later stage's whole
        # gather waits in the first micro-batch's forward, and the stages after it wait for that forward
        gather_exposed += sum(c[1] for c in comms[1:] if c[2])
    return reduce_exposed + gather_exposed


def zero3_traffic_seconds(lay: Layout, gpu: GPU, params: list[StageParams], zero: Zero, precision: str,
                          grad_bytes: int, bucket: Buckets, grad_accum: int) -> float:
    """Seconds per step of DeepSpeed ZeRO-3's parameter gathers and gradient reduce-scatters on its
    busiest stage with none of them hidden (forward gather, backward regather less what is kept for
    reuse, reduce-scatter, every micro-batch); 0 unless ``bucket`` is DeepSpeed's overlapped path at
    stage 3. What the planner hides of it is this less the step's ``dp`` seconds."""
    if zero.stage != 3 or zero.engine != "deepspeed" or bucket.engine != "overlapped":
        return 0.0
    comms = stage_comms(lay, gpu, params, zero, precision, grad_bytes, bucket)
    return grad_accum * max(gather + _regathered(again, n, bucket) + grads
                            for grads, gather, n, again, _, _ in comms if n)


def optimizer_seconds(lay: Layout, gpu: GPU, params: list[StageParams], zero: Zero) -> float:
    """The optimizer step on this GPU's shard at memory bandwidth (0 when offloaded to the CPU)."""
    if zero.offload_optimizer != "none":
        return 0.0
    dense_n, expert_n = (shards(zero.stage, "optimizer", n) for n in (lay.dp_cp, lay.edp))
    shard = lambda p: p.dense / dense_n + p.expert / expert_n  # noqa: E731
    return max(shard(p) for p in params) * OPTIMIZER_BYTES / (gpu.memory_gbps * 1e9)


def offload_seconds(lay: Layout, params: list[StageParams], zero: Zero, grad_accum: int) -> float:
    p = max(params, key=lambda x: x.dense + x.expert)
    dense_shard = lay.dp_cp
    n = p.dense + p.expert
    t = 0.0
    if zero.offload_optimizer != "none":
        part = n / shards(zero.stage, "optimizer", dense_shard)
        t += part * 4 / (PCIE_GBPS * 1e9) + part / CPU_ADAM_PARAMS_PER_S
    if zero.offload_param != "none":
        t += grad_accum * 2 * n / dense_shard * 2 / (PCIE_GBPS * 1e9)
    return t
