"""FLOPs per step and the step-time model (its assumptions are stated in the modules it uses).

FLOPs: each matmul parameter a token passes through costs 2 FLOPs forward (MoE: router +
top-k experts + shared expert), the output layer 2hV, causal attention 2 x a x s x
(d_qk + d_v) / 2 per layer; training is 3 x forward (model FLOPs, used for MFU). Hardware
FLOPs add the recomputed forward (full: every layer; selective: the attention core; op: every
second GEMM of a layer, torchtitan's per-op checkpointing).

Step time, from the work of one GPU of each pipeline stage:
  stage_time.py  one micro-batch on one GPU of a stage: GEMMs, attention and memory-bound
                 work at the efficiency their per-GPU shapes allow (compute.py), recompute,
                 and the tp, etp, cp, ep and pp communication the compute does not hide
  pipeline       m x the slowest stage + (the other stages' times) / vpp: 1F1B and
                 interleaved 1F1B fill and drain (even stages: the (p-1)/(m v + p-1) bubble)
  data_time.py   data-parallel reduction and ZeRO gathers per bucket, overlapped with the
                 backward/forward that runs meanwhile; the optimizer step; offload
``TimeEstimate.seconds`` says where the step's seconds go on the slowest stage (compute by
kind, each exposed communication, the pipeline's fill and drain, dp, optimizer, offload);
they add up to the step time.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..backends.deepspeed import bucket_sizes
from ..backends.megatron import padded_vocab
from ..hardware import GPU
from ..kernels import spec_kernels
from ..models import ModelShape
from ..models.params import layer_weights
from ..parallel.layout import BatchPlan, Layout
from ..parallel.pipeline import warmup_forwards
from ..spec import TrainingSpec, Zero
from . import compute as C
from .data_time import buckets, dp_seconds, fsdp_unit, offload_seconds, optimizer_seconds, stage_comms
from .lora import shared_a, spec_adapter_params
from .memo import IdMemo
from .memory import (StageParams, grad_reduce_bytes, layer_kind_keys, micro_batch_tokens, signature_slots,
                     spec_stage_params, stage_signatures)
from .stage_time import (COMM_KINDS, Setting, StageSums, StageTime, bf16_setting, edge_piece, layer_piece, pp_seconds,
                         redo_seconds, setting, stage_sums, stage_time)


# ---------------------------------------------------------------------------- FLOPs
# no GEMM: attention sinks, the gated delta net's decay parameters and its norm (norms: "layernorm")
NOT_MATMUL = ("softmax_offset", "A_log", "dt_bias", "out_norm")


def _layer_matmul_params(shape: ModelShape, layer: int) -> float:
    """Weights a token multiplies once (2 FLOPs each): GEMMs, and the delta net's depthwise conv1d
    (kernel x channels multiply-adds per token)."""
    n = 0.0
    for w in layer_weights(shape, layer):
        if "layernorm" in w.module or w.module.endswith(NOT_MATMUL):
            continue
        n += w.numel * (shape.moe.topk if w.split == "expert" else 1)
    return n


def _attention_dims(shape: ModelShape) -> tuple[int, int]:
    if shape.mla is not None:
        m = shape.mla
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return shape.head_dim, shape.head_dim


def delta_rule_flops(shape: ModelShape) -> float:
    """Forward FLOPs per token of one gated delta net layer's recurrence, as Megatron-LM counts
    them: per value head 4 products with the dk x dv state (k k^T, v k^T, the state update and
    its product with q; Megatron-LM writes dv^2, equal for every Qwen3-Next)."""
    la = shape.linear_attention
    return 2 * 4 * la.value_heads * la.key_head_dim * la.value_head_dim if la else 0.0


def forward_flops_per_token(shape: ModelShape, seq_len: int) -> tuple[float, float]:
    """(all forward FLOPs, attention-core part) per token: every GEMM (the router's too), the
    causal attention core (a sliding window's layers: only the keys in the window) and the output layer; each multi-token prediction module as one more
    decoder layer of the last layer's kind, its projection (2h -> h) and its own output layer,
    as Megatron-LM's num_floating_point_operations counts them (tests/toolkit/estimate/test_time.py compares).
    A gated delta net layer has no softmax core: its projections and conv1d are counted with the
    GEMMs, its recurrence (delta_rule_flops, linear in the sequence) with them too."""
    dqk, dv = _attention_dims(shape)
    per_key = 2 * shape.num_attention_heads * (dqk + dv)
    # each MTP module is a decoder layer of the last layer's kind
    counts = Counter(range(shape.num_layers)) + Counter({shape.num_layers - 1: shape.mtp_layers})
    softmax = {i: n for i, n in counts.items() if not shape.is_linear_attention_layer(i)}
    core = sum(n * per_key * C.attended_keys(seq_len, shape.sliding_window if shape.is_window_layer(i) else None)
               for i, n in softmax.items())
    kinds: dict[tuple[bool, bool], list[int]] = {}  # a layer's weights depend on its index through these only
    for i in range(shape.num_layers):
        kinds.setdefault((shape.is_moe_layer(i), shape.is_linear_attention_layer(i)), []).append(i)
    linear = sum(2 * _layer_matmul_params(shape, idx[0]) * len(idx) for idx in kinds.values())
    linear += delta_rule_flops(shape) * (counts.total() - sum(softmax.values()))
    h = shape.hidden_size
    linear += shape.mtp_layers * 2 * (_layer_matmul_params(shape, shape.num_layers - 1) + 2 * h * h)
    return linear + core + _output_flops(shape), core


def _output_flops(shape: ModelShape) -> float:
    """Forward FLOPs per token of the output layers (the main one and each MTP module's)."""
    return (1 + shape.mtp_layers) * 2 * shape.hidden_size * shape.vocab_size


def step_flops(shape: ModelShape, batch: BatchPlan, recompute: str, lora: tuple | None = None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one optimizer step. With ``lora`` (rank, targets, shared_a) the
    base is frozen: its backward computes the data gradients alone (as many FLOPs as the forward's
    linear layers, twice the attention core's), the adapters' both (tests/toolkit/estimate/test_lora_time.py
    holds it against torch's FLOP counter on a peft model)."""
    fwd, core = forward_flops_per_token(shape, batch.seq_len)
    adapters = _lora_flops(shape, lora) if lora else 0.0
    model = (3 * fwd if not lora else 2 * fwd + core + 3 * adapters) * batch.tokens
    extra = {"none": 0.0, "selective": core, "full": fwd - _output_flops(shape) + adapters,
             "op": _op_flops(shape)}[recompute]
    return model, model + extra * batch.tokens


def _lora_flops(shape: ModelShape, lora: tuple) -> float:
    """Forward FLOPs per token of LoRA's adapters (compute.lora_gemms), every layer."""
    dm = C.model_dims(shape)
    return sum(g.flops for i in range(shape.num_layers)
               for g in C.lora_gemms(dm, 1.0, 1, shape.is_moe_layer(i), lora, shape.is_linear_attention_layer(i)))


def _op_flops(shape: ModelShape) -> float:
    """FLOPs per token op recompute runs again: each layer's wk, wo and w3 (compute.op_recompute_gemms;
    dense layers: rule op_recompute_model)."""
    return shape.num_layers * sum(g.flops for g in C.op_recompute_gemms(C.model_dims(shape), 1.0, 1))


# ---------------------------------------------------------------------------- time
KINDS = ("gemm", "attention", "memory", "recompute") + COMM_KINDS + ("bubble", "dp", "optimizer", "offload")


@dataclass(frozen=True)
class TimeEstimate:
    model_flops: float
    hardware_flops: float
    seconds: dict[str, float]  # where the step's seconds go (KINDS), on the slowest stage; they sum to the step
    stage_s: tuple[float, ...]  # one micro-batch's seconds on each pipeline stage
    step_time_s: float
    tokens_per_s: float  # tokens of the data: every position, times data.fill for chat data (as a run counts)
    mfu: float
    train_tokens: float
    time_to_train_s: float
    fill: float = 1.0  # data.fill: the share of positions holding data tokens

    @property
    def compute_s(self) -> float:
        return sum(self.seconds[k] for k in ("gemm", "attention", "memory", "recompute"))

    @property
    def comm_s(self) -> dict[str, float]:
        """Exposed communication (and offload traffic) seconds per step by kind."""
        return {k: self.seconds[k] for k in COMM_KINDS + ("dp", "offload")}

    @property
    def bubble_fraction(self) -> float:
        return self.seconds["bubble"] / self.step_time_s

    @property
    def slowest_stage(self) -> int:
        return max(range(len(self.stage_s)), key=self.stage_s.__getitem__)

    @property
    def terms(self) -> dict[str, float]:
        """Seconds per step by cause (the kinds of ``seconds`` that take any), for tables and charts."""
        return {k: v for k, v in self.seconds.items() if v > 0}

    @property
    def dominant(self) -> str:
        return max(self.seconds, key=self.seconds.get)

    def as_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "model_tflops_per_step": self.model_flops / 1e12, "compute_s": self.compute_s,
                "bubble_fraction": self.bubble_fraction, "comm_s": dict(self.comm_s),
                "seconds": dict(self.seconds), "stage_seconds_per_microbatch": list(self.stage_s),
                "slowest_stage": self.slowest_stage, "dominant": self.dominant,
                "train_tokens": self.train_tokens, "time_to_train_days": self.time_to_train_s / 86400,
                "fill": self.fill}


def stage_work(shape: ModelShape, lay: Layout, batch: BatchPlan, gpu: GPU, *, precision: str, flash: bool,
               cal: C.Calibration | None = None, dims: C.Dims | None = None, s: Setting | None = None,
               pp_split: bool = False, sigs: tuple | None = None, works: list[tuple] | None = None,
               distinct: bool = False) -> list[tuple]:
    """What stage_time needs of every stage besides the recompute choice: (its layer pieces and edge
    piece summed, pipeline p2p seconds), one shared tuple per stage signature. ``s``: setting(lay, gpu,
    precision, flash, cal) when the caller has it; ``sigs``: stage_signatures(shape, lay), likewise;
    ``works``: signature_works(shape, lay, batch, dims, s, sigs), likewise. ``distinct``: each
    signature's tuple once, in signature_slots' order (times_of's ``slots`` maps the stages to them)."""
    dm = dims or C.model_dims(shape)
    s = s or setting(lay, gpu, precision, flash, cal or C.CALIBRATION, pp_split)
    t = micro_batch_tokens(lay, batch)
    sigs = sigs or stage_signatures(shape, lay)
    per_signature = [(sums, pp_seconds(lay, t, dm, s, fwd / lay.vpp))
                     for sums, fwd in works or signature_works(shape, lay, batch, dm, s, sigs)]
    return per_signature if distinct else list(map(per_signature.__getitem__, signature_slots(sigs)[1]))


def signature_works(shape: ModelShape, lay: Layout, batch: BatchPlan, dm: C.Dims, s: Setting,
                    sigs: tuple) -> list[tuple]:
    """(StageSums, forward compute seconds) of each distinct stage signature, in
    signature_slots' order: stage_work's part before the pipeline sends (kept across layouts)."""
    t, seq, vocab = micro_batch_tokens(lay, batch), batch.seq_len, padded_vocab(shape.vocab_size, lay.tp)
    return [_signature_work(shape, dm, s, t, seq, vocab, sigs[k]) for k in signature_slots(sigs)[0]]


def step_floor(works: list[tuple], recompute: str, grad_accum: int) -> float:
    """A lower bound of the step time of every layout whose distinct stages have these
    signature_works, under this recompute choice: grad_accum x the largest stage compute
    (GEMMs, attention, memory-bound work and recompute, summed as stage_time sums them). The step
    adds to it the other terms, none negative: each stage's exposed communication (StageTime.total),
    the pipeline's fill and drain (pipeline_seconds: m x the slowest stage + the rest / vpp), exposed
    dp, the optimizer step and offload; and floating-point addition of terms >= 0 never rounds
    below a partial sum."""
    return grad_accum * max(_compute(sums, recompute) for sums, _ in works)


def layer_floor(shape: ModelShape, lay: Layout, batch: BatchPlan, dm: C.Dims, s: Setting, recompute: str,
                kinds: tuple) -> float:
    """A lower bound of step_floor for every pipeline split and vpp of this layout (so of its step
    time), without its stages: some stage holds at least ceil(num_layers / pp) decoder layers, each
    costing at least the least compute (and recompute) of the model's layer ``kinds``
    (memory.layer_kind_keys' distinct values); 1e-9 under it for the different order of the sums.
    0 when FP8 keeps some layers in 16 bits (those layers' setting differs)."""
    if s.bf16_layers:
        return 0.0
    least = _least_layer(shape, dm, s, micro_batch_tokens(lay, batch), batch.seq_len, recompute, kinds)
    return batch.grad_accum * -(-shape.num_layers // lay.pp) * least * (1 - 1e-9)


_LEAST_LAYER = IdMemo()  # keyed by the shape's, dims' and kinds' ids


def _least_layer(shape: ModelShape, dm: C.Dims, s: Setting, t: float, seq: int, recompute: str,
                 kinds: tuple) -> float:
    """The least compute (and recompute) of one layer of the ``kinds``: layer_floor's per-layer term,
    the same for every pipeline size and micro-batch count (kept across layouts)."""
    return _LEAST_LAYER.get((id(shape), id(dm), s, t, seq, recompute, id(kinds)), (shape, dm, kinds), lambda: min(
        _layer_compute(layer_piece(dm, moe, t, seq, s, shape.sliding_window if window else None, linear), recompute)
        for moe, window, linear in kinds))


def _layer_compute(p, recompute: str) -> float:
    """One layer's part of StageSums.gemm + attention + memory and of its recompute (stage_sums)."""
    rec = (p.gemm_f + p.attn_f + p.mem_f if recompute == "full" else
           p.attn_f * p.selective if recompute == "selective" else p.redo_op if recompute == "op" else 0.0)
    return 3 * p.gemm_f + (p.attn_f + p.attn_b) + (p.mem_f + (2 * p.mem_f if p.mem_b is None else p.mem_b)) + rec


def _compute(s: StageSums, recompute: str) -> float:
    return s.gemm + s.attention + s.memory + redo_seconds(s, recompute)  # StageTime.total's first terms, in its order


_SIGNATURE_WORK = IdMemo()  # keyed by the shape's and dims' ids


def _signature_work(shape: ModelShape, dm: C.Dims, s: Setting, t: float, seq: int, vocab: int,
                    sig: tuple) -> tuple:
    """(StageSums, forward compute seconds) of a stage signature's layers and edge: the same for
    every vpp and pipeline split that gives a stage this signature (kept across layouts)."""
    return _SIGNATURE_WORK.get((id(shape), id(dm), s, t, seq, vocab, sig), (shape, dm),
                               lambda: _make_signature_work(shape, dm, s, t, seq, vocab, sig))


def _make_signature_work(shape: ModelShape, dm: C.Dims, s: Setting, t: float, seq: int, vocab: int,
                         sig: tuple) -> tuple:
    kinds, first, last = sig
    pieces = [(layer_piece(dm, shape.is_moe_layer(i), t, seq, ls,
                           shape.sliding_window if shape.is_window_layer(i) else None,
                           shape.is_linear_attention_layer(i)), n)
              for i, n, ls in fp8_kinds(shape, kinds, first, last, s)]
    fwd = sum((p.gemm_f + p.attn_f + p.mem_f) * n for p, n in pieces)
    edge = edge_piece(dm, first, last, t, vocab, s, 1 + shape.mtp_layers)
    return stage_sums(pieces, edge), fwd


def fp8_kinds(shape: ModelShape, kinds: tuple, first: bool, last: bool, s: Setting) -> list[tuple]:
    """A stage's (layer kind, count, setting): the layers fp8.bf16_layers keeps out of FP8 (megatron's
    first_last_layers_bf16: the model's first and last N, on the first and last stages) with the
    16-bit setting, the others with ``s``."""
    out = [(i, n, s) for i, n in kinds]
    if not (s.bf16_layers and (first or last)):
        return out
    keys, n_layers = layer_kind_keys(shape), shape.num_layers
    ids = set(range(s.bf16_layers)) if first else set()
    ids |= set(range(n_layers - s.bf16_layers, n_layers)) if last else set()
    held = dict(kinds)
    plain: dict[int, int] = {}
    for j in ids:
        rep = keys.index(keys[j])
        if held.get(rep, 0) > plain.get(rep, 0):  # a stage without layers (an uneven split) has none to keep
            plain[rep] = plain.get(rep, 0) + 1
    bf16 = bf16_setting(s)
    kept = [(i, n - plain.get(i, 0), s) for i, n in kinds if n > plain.get(i, 0)]
    return kept + [(i, n, bf16) for i, n in plain.items()]


def times_of(work: list[tuple], recompute: str, a2a_shares: list[float] | None = None,
             slots: tuple[int, ...] | None = None) -> list[StageTime]:
    """stage_work's stages timed under a recompute choice (a shared work, a shared StageTime);
    ``a2a_shares``: a2a_overlap_shares of the layout, when its EP overlap is on. ``slots``: ``work``
    is stage_work(distinct=True), and stage k's entry is work[slots[k]] (signature_slots(sigs)[1]):
    without the overlap each distinct entry is timed once."""
    if slots is not None:
        if a2a_shares:
            return [_stage_time(work[k], recompute, share) for k, share in zip(slots, a2a_shares)]
        return list(map([_stage_time(w, recompute, 0.0) for w in work].__getitem__, slots))
    return [_stage_time(w, recompute, share) for w, share in zip(work, a2a_shares or [0.0] * len(work))]


def _stage_time(work: tuple, recompute: str, share: float) -> StageTime:
    """stage_time of a stage_work entry, kept with its sums across layouts: stages of different
    splits, vpp or data-parallel sizes often have the same sums and pipeline seconds (the search
    times ~40,000, ~22,000 of them distinct)."""
    sums, pp = work
    key = (recompute, pp, share)
    hit = sums.times.get(key)
    if hit is None:
        hit = sums.times[key] = stage_time(sums, recompute, pp, share)
    return hit


def a2a_overlap_shares(lay: Layout, grad_accum: int) -> list[float] | None:
    """Per stage, the share of its micro-batch chunks whose expert-parallel all-to-alls
    megatron's combined 1F1B runs beside another micro-batch's compute: all but the warm-up
    forwards (pipeline.warmup_forwards, one more with the overlap) and as many cool-down
    backwards. None without the overlap."""
    if not lay.ep_a2a_overlap:
        return None
    total = grad_accum * lay.vpp
    return [(total - warmup_forwards(lay.pp, lay.vpp, k, True, grad_accum)) / total for k in range(lay.pp)]


def pipeline_seconds(stage_s: list[float], grad_accum: int, vpp: int) -> float:
    """m x the slowest stage plus the fill and drain through the others (a 1/vpp chunk each)."""
    slowest = max(stage_s)
    return grad_accum * slowest + (sum(stage_s) - slowest) / vpp


def pipeline_breakdown(stages: list[StageTime], grad_accum: int, vpp: int) -> dict[str, float]:
    """The pipeline's seconds per step by kind (KINDS up to bubble) on the slowest stage."""
    totals = [s.total for s in stages]
    k = max(range(len(stages)), key=totals.__getitem__)
    st, m = stages[k], grad_accum
    out = {"gemm": m * st.gemm, "attention": m * st.attention, "memory": m * st.memory, "recompute": m * st.recompute}
    out.update({c: m * st.comm[c] for c in COMM_KINDS})
    out["bubble"] = pipeline_seconds(totals, m, vpp) - m * totals[k]
    return out


def step_breakdown(pipeline: dict[str, float], dp: float, optimizer: float, offload: float) -> dict[str, float]:
    """Seconds per step by kind (KINDS): the pipeline's, then dp, the optimizer step, offload."""
    return {**pipeline, "dp": dp, "optimizer": optimizer, "offload": offload}


def data_seconds(lay: Layout, gpu: GPU, stages: list[StageTime], params: list[StageParams], zero: Zero, *,
                 grad_accum: int, precision: str, target: str, hidden: int, grad_bytes: int = 4,
                 layers: int, comms: list[tuple] | None = None,
                 sizes: dict[str, int] | None = None, gather_at_start: bool = False) -> tuple[float, float, float]:
    """(exposed dp, optimizer step, offload) seconds of a step (``comms``: stage_comms, if at hand;
    ``layers``: the model's decoder layers, FSDP's units; ``sizes``: the DeepSpeed config's bucket
    sizes, backends.deepspeed.bucket_sizes, None for the model-based ones; ``gather_at_start``:
    estimate.param_gather_at_start)."""
    unit = fsdp_unit(params, layers) if zero.engine == "fsdp" else None
    bucket = buckets(target, precision, zero, lay, hidden, unit, sizes, gather_at_start)
    comms = comms or stage_comms(lay, gpu, params, zero, precision, grad_bytes, bucket)
    return (dp_seconds(lay, stages, comms, zero.stage, grad_accum=grad_accum, bucket=bucket),
            optimizer_seconds(lay, gpu, params, zero), offload_seconds(lay, params, zero, grad_accum))


def finish(spec: TrainingSpec, lay: Layout, batch: BatchPlan, gpu: GPU, flops: tuple[float, float],
           seconds: dict[str, float], stage_s: list[float]) -> TimeEstimate:
    step, fill = sum(seconds.values()), spec.data.fill or 1.0
    tokens_per_s = batch.tokens * fill / step
    train_tokens = spec.estimate.tokens or float(spec.train.steps * batch.tokens * fill)
    peak = gpu.peak_tflops(spec.precision) * 1e12
    return TimeEstimate(flops[0], flops[1], seconds, tuple(stage_s), step, tokens_per_s,
                        flops[0] / (step * lay.world * peak), train_tokens, train_tokens / tokens_per_s, fill)


def spec_setting(spec: TrainingSpec, lay: Layout, gpu: GPU) -> Setting:
    """The layer-time setting of a spec's layout (make_plan's and the search's)."""
    return setting(lay, gpu, spec.precision, spec_kernels(spec).attention == "flash", C.CALIBRATION,
                   spec.estimate.pp_scatter_gather, spec.estimate.pp_overlap,
                   C.routed_share(spec.moe), eager_modules(spec), spec.fp8.recipe if spec.fp8.on else "",
                   spec.fp8.bf16_layers, C.loss_kind(spec), spec_lora(spec))


def spec_lora(spec: TrainingSpec) -> tuple | None:
    """LoRA's (rank, targets, shared_a) when the spec fine-tunes with adapters on a frozen base: the
    recipes' runtime shares A across a fused projection's parts, peft (target hf) has one per HF module."""
    f = spec.finetune
    return (f.lora.rank, tuple(f.lora.targets), shared_a(spec)) if f.method == "lora" else None


def trained_params(spec: TrainingSpec, shape: ModelShape, lay: Layout) -> list[StageParams]:
    """Per stage, the parameters the optimizer trains, whose gradients are reduced and states stepped:
    every weight (spec_stage_params), or LoRA's adapters alone (the base is frozen: estimate.lora)."""
    if spec.finetune.method != "lora":
        return [spec_stage_params(spec, shape, lay, k) for k in range(lay.pp)]
    return [spec_adapter_params(spec, shape, lay, k) for k in range(lay.pp)]


def eager_modules(spec: TrainingSpec) -> bool:
    """Whether the run's elementwise work is eager PyTorch, one kernel per op: the HF Trainer runs
    transformers' modules, eagerly unless ``compile``; megatron-core (recipes) and Megatron-LM run
    TransformerEngine's / megatron's fused kernels either way."""
    return spec.target == "hf" and not spec.compile


def estimate_time(spec: TrainingSpec, shape: ModelShape, lay: Layout, batch: BatchPlan, gpu: GPU) -> TimeEstimate:
    s = spec_setting(spec, lay, gpu)
    stages = times_of(stage_work(shape, lay, batch, gpu, precision=spec.precision, flash=s.flash, s=s),
                      spec.recompute, a2a_overlap_shares(lay, batch.grad_accum))
    params = trained_params(spec, shape, lay)
    dp, opt, off = data_seconds(lay, gpu, stages, params, spec.zero, grad_accum=batch.grad_accum,
                                grad_bytes=grad_reduce_bytes(spec),
                                precision=spec.precision, target=spec.target, hidden=shape.hidden_size,
                                layers=shape.num_layers, sizes=bucket_sizes(spec, shape),
                                gather_at_start=spec.estimate.param_gather_at_start)
    seconds = step_breakdown(pipeline_breakdown(stages, batch.grad_accum, lay.vpp), dp, opt, off)
    return finish(spec, lay, batch, gpu, step_flops(shape, batch, spec.recompute, spec_lora(spec)), seconds,
                  [s.total for s in stages])
