"""One micro-batch on one GPU of each pipeline stage: compute by kind and the communication
the compute does not hide, as Megatron schedules it.

Per layer and micro-batch (t tokens of this GPU's sequence shard, activations A = t h w bytes):
  tp   sequence parallel: all-gather before and reduce-scatter after each tensor-parallel
       block (attention; dense MLP or shared expert), (tp-1)/tp A each. Forward: all four
       exposed; backward: the row-parallel all-gather of the output gradient exposed, the
       column-parallel input all-gather and data-gradient reduce-scatter hidden behind the
       data- and weight-gradient GEMMs (megatron/TE's asynchronous backward communication).
       TE's userbuffer overlap (parallel.tp_comm_overlap) hides each behind the GEMM it feeds.
       Without sequence parallel: one all-reduce after each block forward (exposed) and one
       in backward hidden behind the weight-gradient GEMM.
  cp   p2p ring: cp-1 steps each sending this rank's K and V (backward: K, V and their
       gradients) while the attention of the step's block runs; all_gather: K and V gathered
       before attention, their gradients reduce-scattered after (exposed, as in Llama 3);
       a2a: q, k, v and the output exchanged over cp (heads split, the whole sequence per
       call), exposed; a2a+p2p: the all-to-all over cp_a2a ranks, then the ring over the rest.
  ep   dispatch and combine all-to-alls of the routed tokens (forward and backward), exposed;
       with megatron's EP overlap (moe.a2a_overlap) the steady-state micro-batches run each
       all-to-all beside another micro-batch's compute (combined 1F1B): hidden up to the
       stage's compute, the warm-up forwards' and cool-down backwards' still exposed
  etp  all-gather / reduce-scatter of the routed tokens over the expert-tensor group, exposed
  pp   one activation send per chunk boundary each way: exposed with 1F1B, hidden behind the
       next chunk's compute with the interleaved schedule (megatron's overlap_p2p_comm; with
       estimate.pp_overlap false, as in Megatron-LM before May 2023, exposed: vpp times 1F1B's)
Full recompute re-runs each layer's forward (with its forward communication); selective
recompute re-runs the attention core; op recompute (torchtitan's per-op checkpointing, dense
layers) re-runs every second GEMM of the layer (compute.op_recompute_gemms) and all its
memory-bound forward work. The first stage adds the embedding lookup, the last
the output layer GEMM and the cross entropy (memory-bound: compute.loss_bytes per logit
element, t x vocab/tp of them, by the loss's implementation: megatron-core's unfused or fused
cross entropy, TransformerEngine's, transformers' fp32 loss).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

from ..hardware import GPU
from ..parallel.layout import Layout
from ..parallel.precision import element_bytes
from . import compute as C
from .comm import collective, exposed, link_bandwidth

COMM_KINDS = ("tp", "etp", "cp", "ep", "pp")


@dataclass(frozen=True)
class Setting:
    """What a layer's time depends on besides the model and the token count (hashable)."""

    lay: Layout  # the layout's part a layer depends on (Layout.for_layers: tp, sp, cp, ep, etp, the node)
    gpu: GPU
    w: int  # activation bytes
    peak: float
    flash: bool
    cal: C.Calibration
    pp_split: bool = False  # estimate.pp_scatter_gather
    pp_overlap: bool = True  # estimate.pp_overlap
    routed: float = 1.0  # compute.routed_share of moe.capacity_factor / moe.pad_to_capacity
    eager: bool = False  # eager PyTorch modules (target hf without compile): compute.eager_bytes
    loss: str = "none"  # the loss's implementation (compute.LOSS_KINDS): compute.loss_bytes
    fp8: str = ""  # the spec's fp8 recipe (delayed | tensorwise) where the layers' linear GEMMs run in FP8, else ""
    fp8_peak: float = 0.0  # FLOP/s of the FP8 tensor cores
    bf16_layers: int = 0  # fp8.bf16_layers: layers at each end of the model left in the 16-bit precision
    lora: tuple | None = None  # finetune lora: (rank, targets, shared_a); the base weights are frozen

    def __hash__(self) -> int:  # a key of layer_piece's and edge_piece's caches: hashed once
        try:
            return self._hash
        except AttributeError:
            object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))
            return self._hash


def setting(lay: Layout, gpu: GPU, precision: str, flash: bool, cal: C.Calibration, pp_split: bool = False,
            pp_overlap: bool = True, routed: float = 1.0, eager: bool = False, fp8: str = "",
            bf16_layers: int = 0, loss: str = "none", lora: tuple | None = None) -> Setting:
    """``fp8``: the FP8 recipe of the layers' linear GEMMs ("": none; a GPU without FP8 tensor cores
    has none either, which the rules refuse); ``lora``: LoRA's (rank, targets, shared_a) on a frozen base."""
    fp8_peak = C.peak_flops(gpu, "fp8") if fp8 else 0.0
    return Setting(lay.for_layers(), gpu, element_bytes(precision), C.peak_flops(gpu, precision), flash,
                   cal.for_gpu(gpu), pp_split, pp_overlap, routed, eager, loss, fp8 if fp8_peak else "", fp8_peak,
                   bf16_layers if fp8_peak else 0, lora)


def bf16_setting(s: Setting) -> Setting:
    """The setting of a layer FP8 leaves out (fp8.bf16_layers): its GEMMs in the 16-bit precision."""
    return replace(s, fp8="", fp8_peak=0.0, bf16_layers=0) if s.fp8 else s


@dataclass(frozen=True)
class Piece:
    """Forward seconds by kind and forward/backward exposed communication of some work."""

    gemm_f: float = 0.0
    attn_f: float = 0.0
    attn_b: float = 0.0
    mem_f: float = 0.0
    comm_f: dict[str, float] = field(default_factory=dict)
    comm_b: dict[str, float] = field(default_factory=dict)
    selective: bool = True  # whether selective recompute runs attn_f again (megatron's core_attn; no delta rule)
    mem_b: float | None = None  # backward memory-bound seconds (None: twice mem_f, fused kernels)
    redo_op: float = 0.0  # what op recompute runs again: every second GEMM and the memory-bound forward
    gemm_b: float | None = None  # backward GEMM seconds (None: twice gemm_f, the data and weight gradients)


def _tp_block(s: Setting, a_bytes: float, col: float, row: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one tensor-parallel block whose column-parallel
    GEMMs take ``col`` and row-parallel ones ``row`` seconds forward."""
    if s.lay.tp == 1:
        return 0.0, 0.0
    bw = link_bandwidth(s.lay.tp, s.gpu, s.lay.gpus_per_node)
    wgrad = 0.0 if s.lora else col  # what hides the backward's: the weight-gradient GEMM (none when frozen)
    if not s.lay.sequence_parallel:
        ar = collective("allreduce", s.lay.tp, a_bytes, bw)
        return ar, exposed(ar, wgrad)
    c = collective("allgather", s.lay.tp, a_bytes, bw)
    if s.lay.tp_comm_overlap:
        return exposed(c, col) + exposed(c, row), exposed(c, row) + 2 * exposed(c, wgrad)
    return 2 * c, c + 2 * exposed(c, wgrad)


def _cp(s: Setting, dm: C.Dims, t: float, attn_f: float, attn_b: float) -> tuple[float, float]:
    """(forward, backward) exposed context-parallel seconds of one layer's attention."""
    if s.lay.cp == 1:
        return 0.0, 0.0
    heads = dm.heads / s.lay.tp
    kv = t * s.w * (2 * dm.groups / s.lay.tp * dm.d_qk if dm.mla is None else heads * (dm.d_qk + dm.d_v))
    ring_bw = link_bandwidth(s.lay.tp * s.lay.cp, s.gpu, s.lay.gpus_per_node)
    if s.lay.cp_comm == "all_gather":
        ag = collective("allgather", s.lay.cp, s.lay.cp * kv, ring_bw)
        return ag, ag + collective("reducescatter", s.lay.cp, s.lay.cp * kv, ring_bw)
    ring, a2a_n = s.lay.cp, 1
    f = b = 0.0
    if s.lay.cp_comm in ("a2a", "a2a+p2p"):
        # (the rules reject a2a+p2p without cp_a2a)
        a2a_n = s.lay.cp if s.lay.cp_comm == "a2a" else (s.lay.cp_a2a or 1)
        ring = max(1, s.lay.cp // a2a_n)
        qkv = t * s.w * ((dm.heads + 2 * dm.groups) / s.lay.tp * dm.d_qk if dm.mla is None
                         else heads * (2 * dm.d_qk + dm.d_v))
        bw = link_bandwidth(s.lay.tp * a2a_n, s.gpu, s.lay.gpus_per_node)
        both = collective("alltoall", a2a_n, qkv, bw) + collective("alltoall", a2a_n, t * s.w * heads * dm.d_v, bw)
        f, b = both, both
    if ring > 1:
        send = collective("send", 2, kv, ring_bw)
        f += (ring - 1) * exposed(send, attn_f / ring)
        b += (ring - 1) * exposed(2 * send, attn_b / ring)
    return f, b


def attention_chunk(s: Setting, seq: int) -> float:
    """Query length of one attention call on this GPU."""
    if s.lay.cp_comm == "a2a":
        return seq
    if s.lay.cp_comm == "a2a+p2p" and s.lay.cp > 1:
        return seq * (s.lay.cp_a2a or 1) / s.lay.cp
    return seq / s.lay.cp


@lru_cache(maxsize=65536)
def layer_piece(dm: C.Dims, moe: bool, t: float, seq: int, s: Setting, window: int | None = None,
                linear: bool = False) -> Piece:
    """One layer of a kind (dense or MoE; ``window``: its sliding window; ``linear``: a gated
    delta net layer, whose recurrence stands where the attention core is, backward 2x as GEMMs),
    one micro-batch."""
    cal, peak, mem_bw = s.cal, s.peak, C.memory_bandwidth(s.gpu)
    work = C.layer_work(dm, moe, t, s.lay.tp, s.lay.etp, s.lay.ep, s.lay.sequence_parallel, s.w, s.routed, linear)
    linear_peak = s.fp8_peak if s.fp8 else peak  # TE's FP8 runs the linear layers' GEMMs, not attention's
    g = lambda gs: sum(C.gemm_seconds(x, linear_peak, cal) for x in gs)  # noqa: E731
    attn_g, mlp_g, exp_g = g(work.attn_gemms), g(work.mlp_gemms), g(work.expert_gemms)
    if linear:
        attn_f = C.delta_rule_seconds(dm, t, s.lay.tp, peak, cal)
        attn_b = 2 * attn_f
    elif s.flash:
        attn_f = C.flash_seconds(dm, t, seq, s.lay.tp, attention_chunk(s, seq), peak, cal, window)
        attn_b = 2.5 * attn_f
    else:
        attn_f, attn_b = C.unfused_seconds(dm, t, seq, s.lay.tp, peak, mem_bw, cal, s.w)
    a_bytes = t * dm.h * s.w
    cols = work.attn_gemms[:-1]
    tp_f, tp_b = _tp_block(s, a_bytes, g(cols), g(work.attn_gemms[-1:]))
    if work.mlp_gemms:
        mf, mb = _tp_block(s, a_bytes, g(work.mlp_gemms[:1]), g(work.mlp_gemms[1:]))
        tp_f, tp_b = tp_f + mf, tp_b + mb
    cp_f, cp_b = _cp(s, dm, t, attn_f, attn_b)
    comm_f, comm_b = {"tp": tp_f, "cp": cp_f}, {"tp": tp_b, "cp": cp_b}
    if moe:
        slots = C.routed_tokens(dm, t, s.lay.tp) * dm.topk * s.routed * dm.h * s.w
        ep_bw = link_bandwidth(s.lay.etp * s.lay.ep, s.gpu, s.lay.gpus_per_node)
        a2a = 2 * collective("alltoall", s.lay.ep, slots, ep_bw)
        etp_bw = link_bandwidth(s.lay.etp, s.gpu, s.lay.gpus_per_node)
        gather = 2 * collective("allgather", s.lay.etp, s.lay.etp * slots, etp_bw)
        comm_f.update(ep=a2a, etp=gather)
        comm_b.update(ep=a2a, etp=gather)
    mem_f, mem_b = work.elementwise_bytes / mem_bw, None
    if s.eager and not (moe or linear or dm.mla):  # the dense attention layer the eager count is of
        mem_f, mem_b = (x / mem_bw for x in C.eager_bytes(dm, t, s.lay.tp, s.w))
    if s.fp8:
        cast = C.fp8_cast_bytes(s.fp8, s.w) / mem_bw
        fwd, bwd = C.fp8_cast_elements(work.attn_gemms + work.mlp_gemms + work.expert_gemms)
        mem_b = (2 * mem_f if mem_b is None else mem_b) + cast * bwd
        mem_f += cast * fwd
    # op recompute (dense attention layers: rule op_recompute_model refuses the others; their value is
    # then the whole forward's, as full recompute's)
    dense = not (moe or linear or dm.mla or dm.gate)
    redo_op = (g(C.op_recompute_gemms(dm, t, s.lay.tp)) + mem_f if dense else attn_g + mlp_g + exp_g + attn_f + mem_f)
    gemm_f, gemm_b = attn_g + mlp_g + exp_g, None
    if s.lora:  # the frozen base's backward: its data gradients only; the adapters': both
        adapters = g(C.lora_gemms(dm, t, s.lay.tp, moe, s.lora, linear))
        gemm_f, gemm_b = gemm_f + adapters, gemm_f + 2 * adapters
    return Piece(gemm_f, attn_f, attn_b, mem_f, comm_f, comm_b, selective=not linear, mem_b=mem_b,
                 redo_op=redo_op, gemm_b=gemm_b)


@dataclass(frozen=True)
class StageTime:
    """Seconds of one micro-batch on one GPU of a pipeline stage."""

    gemm: float  # forward + backward GEMMs
    attention: float  # attention core, forward + backward
    memory: float  # memory-bound work, forward + backward
    recompute: float  # forward work run again in backward
    comm: dict[str, float]  # exposed: tp, etp, cp, ep, pp
    forward: float  # the forward part (compute and exposed communication)
    total: float = field(init=False)  # everything above
    backward: float = field(init=False)  # total - forward

    def __post_init__(self) -> None:
        total = self.gemm + self.attention + self.memory + self.recompute + sum(self.comm.values())
        object.__setattr__(self, "total", total)
        object.__setattr__(self, "backward", total - self.forward)


@dataclass(frozen=True)
class StageSums:
    """A stage's pieces summed once for every recompute choice (the search times each stage's
    work under up to three choices): stage_time's sums before the choice is applied."""

    gemm: float  # forward + backward GEMMs
    attention: float
    memory: float
    redo_full: float  # the layers' forward work, run again by full recompute
    redo_selective: float  # the layers' attention core, run again by selective recompute
    redo_op: float  # the layers' every second GEMM and memory-bound forward, run again by op recompute
    layer_comm_f: dict[str, float]  # the layers' forward communication (run again by full recompute)
    other_comm: dict[str, float]  # backward communication, and the edge's forward
    forward: float  # forward compute and exposed communication
    ep_forward: float  # forward ep all-to-alls
    # stage_time's results by (recompute, pp_comm, a2a_share), kept with the sums they come from (time._stage_time:
    # the search asks ~40,000 times for ~22,000 of them); not part of the value
    times: dict = field(default_factory=dict, compare=False, repr=False)


def stage_sums(pieces: list[tuple[Piece, int]], edge: Piece) -> StageSums:
    """Sum a stage's layers (piece, how many) and its embedding/output work ``edge`` (time._signature_work
    keeps the result per stage signature)."""
    gemm = attn = mem = full = sel = op = fwd = ep_f = 0.0
    layer_f, other = dict.fromkeys(COMM_KINDS, 0.0), dict.fromkeys(COMM_KINDS, 0.0)
    for p, n, layer in [*((p, n, True) for p, n in pieces), (edge, 1, False)]:
        gemm += (p.gemm_f + (2 * p.gemm_f if p.gemm_b is None else p.gemm_b)) * n
        attn += (p.attn_f + p.attn_b) * n
        mem += (p.mem_f + (2 * p.mem_f if p.mem_b is None else p.mem_b)) * n
        if layer:
            full += n * (p.gemm_f + p.attn_f + p.mem_f)
            sel += n * p.attn_f * p.selective  # megatron's core_attn; a delta-rule layer has none
            op += n * p.redo_op
        into = layer_f if layer else other
        for k, v in p.comm_f.items():
            into[k] += n * v
        for k, v in p.comm_b.items():
            other[k] += n * v
        fwd += n * (p.gemm_f + p.attn_f + p.mem_f + sum(p.comm_f.values()))
        ep_f += n * p.comm_f.get("ep", 0.0)
    return StageSums(gemm, attn, mem, full, sel, op, layer_f, other, fwd, ep_f)


def stage_time(s: StageSums, recompute: str, pp_comm: float, a2a_share: float = 0.0) -> StageTime:
    """A stage under a recompute choice from its summed pieces (``pp_comm``: its exposed pipeline
    sends; ``a2a_share``: the share of micro-batches whose ep all-to-alls run beside another
    micro-batch's compute, time.a2a_overlap_shares): full recompute runs the layers' forward (and its
    communication) again, selective their attention core, op every second GEMM and the memory-bound
    forward (tp = cp = 1: rule op_recompute_model); the edge is never recomputed."""
    rec = redo_seconds(s, recompute)
    twice = 2 if recompute == "full" else 1
    comm = {k: s.other_comm[k] + twice * s.layer_comm_f[k] for k in COMM_KINDS}
    fwd = s.forward
    if a2a_share and comm["ep"]:
        hidden = a2a_share * min(comm["ep"], s.gemm + s.attention + s.memory + rec)
        fwd -= hidden * s.ep_forward / comm["ep"]
        comm["ep"] -= hidden
    comm["pp"] += pp_comm
    return StageTime(s.gemm, s.attention, s.memory, rec, comm, fwd + pp_comm / 2)


def redo_seconds(s: StageSums, recompute: str) -> float:
    """The forward work a recompute choice runs again in a stage's backward."""
    if recompute == "full":
        return s.redo_full
    if recompute == "selective":
        return s.redo_selective
    return s.redo_op if recompute == "op" else 0.0


@lru_cache(maxsize=65536)
def edge_piece(dm: C.Dims, first: bool, last: bool, t: float, padded_vocab: int, s: Setting, heads: int = 1) -> Piece:
    """The embedding lookup (first stage) and output layer + cross entropy (last stage; ``heads``
    times: the main one and each MTP module's, whose decoder layers count as layers). The
    vocab-parallel embedding's output is reduce-scattered (all-reduced without sequence
    parallel) in forward; the output layer is column-parallel (its input all-gathered)."""
    mem_bw, a_bytes = C.memory_bandwidth(s.gpu), t * dm.h * s.w
    one, bw = 0.0, link_bandwidth(s.lay.tp, s.gpu, s.lay.gpus_per_node)
    if s.lay.tp > 1:
        one = collective("allgather" if s.lay.sequence_parallel else "allreduce", s.lay.tp, a_bytes, bw)
    gemm_f = mem = comm_f = comm_b = 0.0
    mem_b = None  # backward: twice the forward bytes, as for every fused memory-bound piece
    if first:
        mem += a_bytes / mem_bw  # the looked-up rows written
        comm_f += one
    if last:
        gemm_f = heads * C.gemm_seconds(C.head_gemm(dm, t, s.lay.tp, padded_vocab), s.peak, s.cal)
        logits, (loss_f, loss_b) = heads * t * padded_vocab / s.lay.tp, C.loss_bytes(s.loss, s.w)
        mem_b = 2 * mem + logits * loss_b / mem_bw  # the loss has its own backward count
        mem += logits * loss_f / mem_bw
        if s.lay.sequence_parallel:
            comm_f += exposed(one, gemm_f) if s.lay.tp_comm_overlap else one
        comm_b += exposed(one, 0.0 if s.lora else gemm_f)  # hidden behind the output layer's weight gradient
        # each MTP module's eh_proj (2h -> h, column-parallel, its output gathered over tp: megatron-core's
        # MultiTokenPredictionLayer._concat_embeddings); its decoder layer counts as a layer
        mtp = heads - 1
        gemm_f += mtp * C.gemm_seconds(C.Gemm(t, dm.h / s.lay.tp, 2 * dm.h), s.peak, s.cal)
        if mtp and s.lay.tp > 1:
            out = collective("allgather", s.lay.tp, a_bytes, bw)  # the h output gathered (its backward: a split)
            # with SP the 2h input all-gathered over the sequence, backward reduce-scatters its gradient
            if s.lay.sequence_parallel:
                comm_f += mtp * (out + collective("allgather", s.lay.tp, 2 * a_bytes, bw))
                comm_b += mtp * collective("reducescatter", s.lay.tp, 2 * a_bytes, bw)
            else:  # the input's gradient all-reduced
                comm_f += mtp * out
                comm_b += mtp * collective("allreduce", s.lay.tp, 2 * a_bytes, bw)
    # a frozen output layer (LoRA): its backward is the data gradient alone
    return Piece(gemm_f, 0.0, 0.0, mem, {"tp": comm_f}, {"tp": comm_b}, mem_b=mem_b,
                 gemm_b=gemm_f if s.lora else None)


def pp_seconds(lay: Layout, t: float, dm: C.Dims, s: Setting, chunk: float) -> float:
    """Exposed pipeline send/receive seconds per micro-batch on a stage (both directions, every
    chunk boundary); ``chunk`` is the compute of one model chunk the interleaved schedule
    overlaps a send with when ``s.pp_overlap`` (else all 2 vpp sends are waited for). With
    sequence parallelism each tp rank sends its sequence shard; with ``s.pp_split``
    (Megatron-LM's scatter/gather, Narayanan et al. 2021 section 4.1) without it, each sends
    1/tp of the activation and the receivers all-gather it over the tp group."""
    if lay.pp == 1:
        return 0.0
    split = s.lay.sequence_parallel or s.pp_split
    a_bytes = t * dm.h * s.w
    send = collective("send", 2, a_bytes / (s.lay.tp if split else 1),
                      link_bandwidth(lay.stage_ranks + 1, s.gpu, s.lay.gpus_per_node))
    if s.pp_split and not s.lay.sequence_parallel:
        send += collective("allgather", s.lay.tp, a_bytes, link_bandwidth(s.lay.tp, s.gpu, s.lay.gpus_per_node))
    hidden = lay.vpp > 1 and s.pp_overlap
    return 2 * lay.vpp * (exposed(send, chunk) if hidden else send)
