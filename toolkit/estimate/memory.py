"""Per-GPU memory estimate, stage by stage; the plan reports the worst stage.

Model states (bytes per parameter held by this GPU, N = the ZeRO sharding degree),
mixed precision with Adam:

  stage | params | grads                 | optimizer (fp32 master + m + v)
  0     | 2      | 2 + 4 (fp32 copy)     | 12
  1     | 2      | 2 + 4/N               | 12/N
  2     | 2      | 2/N + 4/N             | 12/N
  3     | 2/N    | 4/N                   | 12/N      + 4 x largest module (gathered 16-bit param + grad)

DeepSpeed converts its gradient partition to fp32 for the optimizer step, hence the 4-byte
term: this is exactly DeepSpeed's own estimate (ZeRO-2: 2P + 18P/N; ZeRO-3: 4L + 18P/N;
with optimizer offload 2P and 4L + 2P/N; with parameter offload too 4L). The ZeRO paper's
(and the seeds') 16 bytes/parameter count params 2 + grads 2 + optimizer 12 and is reported
as ``classic_model_states``. fp32 training: params 4, grads 4, optimizer 8 (m + v).
Megatron-LM (target megatron-lm) with bf16 keeps an fp32 gradient buffer of every parameter
and its optimizer reads the shard in place: grads 4 at ZeRO 0 and 1 (fp32_grad_buffer).
With a 16-bit buffer (optimizer.grad_reduce_dtype bf16, --grad-reduce-in-bf16; fp16) its
optimizer copies the shard to fp32 for the step (``shard_main_param.grad =
shard_model_grad.float()`` in megatron-core's DistributedOptimizer._copy_model_grads_to_main_grads,
the whole gradient in Float16OptimizerWithFloat16Params) and its train_step frees that copy
(``optimizer.zero_grad()``, set_to_none) before the next forward: the 4/N bytes exist only
while the activations are gone (StageMemory.step_only; the peak is the larger of the two
phases). DeepSpeed's count (the table above) keeps them beside the activations, as DeepSpeed's
own estimator does.
DeepSpeed with bf16 at ZeRO-1 without offload is not that count: its engine gives the step to
BF16_Optimizer (bf16_optimizer), which keeps an fp32 gradient buffer of every parameter, not
sharded, beside the bf16 gradients (bf16.immediate_grad_update is left at its default, false):
params 2, grads 2 + 4, optimizer 12/N, and a 2-byte copy of the buffer for its all-reduce at the
accumulation boundary (step_only; bf16_states). ZeRO-1 in fp16, or with optimizer offload, runs
DeepSpeed's ZeRO optimizer: the table's 2 + 4/N.
N is the number of GPUs holding the same weights: dp x cp for dense weights (context-parallel
ranks hold the same weights and reduce their gradients together, as Megatron's data-parallel
group "with context parallel" does; its distributed optimizer shards over that group) and
the expert data-parallel size for expert weights (world / (etp x ep x pp), CP included).

Activations (per layer, per token): toolkit.estimate.activations, counted from what autograd
keeps in megatron-core's layers for the kernels the spec builds (toolkit.kernels: flash or
unfused attention, fused or unfused SwiGLU and RMSNorm); with flash attention and fused
kernels on GPUs, Llama-70B keeps 33.5h bytes per token per layer (Korthikanti et al.: 34h
for GPT). Full recompute keeps each layer's input plus one layer's working set; op recompute
(torchtitan's per-op checkpointing) the outputs its policy saves plus one layer's working set.
Pipeline: stage k holds the activations of megatron's warm-up forwards plus one, each of one
model chunk: min(m v, w_k + 1) / v stages' worth, with w_k = p - k - 1 (1F1B) or
2(p - k - 1) + (v - 1) p (interleaved, ``get_pp_rank_microbatches``): p - k for 1F1B,
(2(p - k - 1) + (v - 1) p + 1) / v interleaved (Korthikanti's L(1 + (p - 1)/(pv)) on stage 0,
more than p - k on the later stages: 6.6 instead of 1 on the last of p = 8, v = 5). Where a
stage's chunks differ (the embedding's or the loss's accounted chunk holds a layer fewer),
megatron's schedule order is followed chunk by chunk: its first chunk runs most often in the
warm-up, its last chunk least (Llama-405B at pp 16 x vpp 8 and 32 micro-batches keeps 112
layer-activations on the first stage, not the 125 of the stage mean, and 113 on the last, not 99).
Every activation term is linear in the tokens of a micro-batch (micro x seq_len / cp), so a
stage is described once per token (StageActivations) and scaled.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from ..backends.deepspeed import bucket_sizes
from ..backends.megatron import padded_vocab
from ..kernels import Kernels, spec_kernels
from ..models import ModelShape
from ..models.params import embedding_weights, head_weights, hf_layer_weights, layer_weights
from ..parallel.layout import BatchPlan, Layout
from ..parallel.pipeline import PipelineSplit, warmup_forwards
from ..parallel.precision import element_bytes
from ..parallel.zero import buckets_in_flight, sharded, shards
from ..spec import TrainingSpec, Zero
from .activations import layer_activation_bytes, mtp_module_bytes
from .compute import loss_kind, routed_share

GiB = 1024**3


@dataclass(frozen=True)
class StageMemory:
    stage: int
    params: float  # bytes
    grads: float
    optimizer: float
    activations: float
    buffers: float
    cpu_offloaded: float  # bytes of this GPU's model states kept in host memory / NVMe
    step_only: float = 0.0  # bytes that exist only during the optimizer step, when the activations are freed

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The peak: forward/backward (activations) or the optimizer step (step_only)."""
        return self.model_states + max(self.activations, self.step_only) + self.buffers

    def gib(self) -> dict[str, float]:
        return {k: round(v / GiB, 3) for k, v in
                dict(params=self.params, grads=self.grads, optimizer=self.optimizer,
                     activations=self.activations, buffers=self.buffers, step_only=self.step_only,
                     total=self.total).items()}


def peak_phase(g: dict, fmt: str) -> str:
    """The peak phase's term of a ``StageMemory.gib()`` breakdown: the activations, or, when they
    are larger, the fp32 gradient copies that exist only at the optimizer step (step_only)."""
    if g["step_only"] > g["activations"]:
        return f"fp32 gradient copies at the optimizer step {g['step_only']:{fmt}} (activations {g['activations']:{fmt}})"
    return f"activations {g['activations']:{fmt}}"


def usable_bytes(gpu_gib: float, headroom: float) -> float:
    return gpu_gib * GiB * (1 - headroom)  # the headroom fraction is kept free


@dataclass(frozen=True)
class MemoryEstimate:
    stages: tuple[StageMemory, ...]
    gpu_gib: float
    classic_model_states: float  # 16 bytes x all parameters (unsharded), bytes

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    def fits(self, headroom: float = 0.0) -> bool:
        return self.worst.total <= usable_bytes(self.gpu_gib, headroom)


# ---------------------------------------------------------------------------- model states
def fp32_grad_buffer(spec: TrainingSpec) -> bool:
    """Megatron-LM's bf16 default: gradients accumulated and reduced in an fp32 buffer
    (arguments.py sets accumulate_allreduce_grads_in_fp32 unless --grad-reduce-in-bf16), which
    the optimizer then reads in place: 4 bytes per parameter, not sharded, and no separate fp32
    copy of the shard."""
    return spec.target == "megatron-lm" and spec.precision == "bf16" and spec.optimizer.grad_reduce_dtype != "bf16"


def bf16_optimizer(target: str, precision: str, zero: Zero) -> bool:
    """Whether DeepSpeed's engine gives the step to its BF16_Optimizer: bf16 weights with fp32
    gradient accumulation (the generated config's data_types.grad_accum_dtype at ZeRO >= 1), ZeRO-1,
    no optimizer offload (engine._do_optimizer_sanity_check). It all-reduces a full fp32 gradient
    buffer instead of ZeRO-1's reduce-scatter (data_time.dp_engine, module docstring)."""
    return target != "megatron-lm" and precision == "bf16" and zero.stage == 1 and zero.offload_optimizer == "none"


def grad_copy(spec: TrainingSpec) -> str:
    """How the stage's states count the optimizer's fp32 copy of 16-bit gradients: "none" (read in
    place from Megatron-LM's fp32 buffer), "step" (Megatron-LM with a 16-bit buffer, bf16 with
    --grad-reduce-in-bf16 or fp16: only during the optimizer step, module docstring), "kept"
    (DeepSpeed's count; Megatron-LM before July 2021, estimate.grad_copy_freed false, whose Float16
    optimizer's zero_grad left the fp32 main parameters' gradients alone), "full" (DeepSpeed with
    bf16: its BF16_Optimizer's unsharded fp32 buffer where bf16_optimizer says it runs, "kept" at
    the other ZeRO stages and with offload; not a function of the stage, which the search varies)."""
    if fp32_grad_buffer(spec):
        return "none"
    if spec.target != "megatron-lm" and spec.precision == "bf16":
        return "full"
    freed = spec.target == "megatron-lm" and spec.precision != "fp32" and spec.estimate.grad_copy_freed
    return "step" if freed else "kept"


def grad_reduce_bytes(spec: TrainingSpec) -> int:
    """Bytes per gradient element the data-parallel reduction moves. Megatron-LM: 2 with
    --grad-reduce-in-bf16, else 4 (its fp32 buffer). DeepSpeed (targets recipes, hf): its
    engine's communication_data_type, the 16-bit dtype of a bf16/fp16 run (the config sets none),
    even though it accumulates into an fp32 partition (ZeRO's reduce casts to it before the
    collective: stage_1_and_2.gradient_reduction_w_predivide, stage3's ipg bucket per comm dtype)."""
    if spec.target != "megatron-lm":
        return element_bytes(spec.precision)
    return 2 if spec.optimizer.grad_reduce_dtype == "bf16" else 4


def model_state_bytes(n: float, shard: int, *, stage: int, precision: str, offload_optimizer: bool,
                      offload_param: bool, copy: str = "kept") -> tuple[float, float, float, float, float]:
    """(params, grads, optimizer, offloaded, step_only) bytes on one GPU for n parameters held by
    it before ZeRO, sharded `shard` ways by ZeRO; ``copy``: grad_copy (the fp32 copy of 16-bit
    gradients: "kept" with the grads, "step" only during the optimizer step, "none": the grads
    are Megatron-LM's fp32 buffer, ZeRO 0-1, "full": DeepSpeed's BF16_Optimizer at ZeRO-1 without
    offload, bf16_states)."""
    if copy == "full" and stage == 1 and not offload_optimizer and precision == "bf16":
        return bf16_states(n, shard)
    mixed = precision != "fp32"
    w, g, opt = (2, 2, 12) if mixed else (4, 4, 8)
    fp32_grad = 4 if mixed else 0
    if copy == "none" and mixed:
        g, fp32_grad = 4, 0
    shard_w, shard_g, shard_o = (shards(stage, state, shard) for state in ("params", "grads", "optimizer"))
    step_only = 0.0
    if copy == "step" and mixed and not offload_optimizer:
        step_only, fp32_grad = fp32_grad * n / shard_o, 0
    params = w * n / shard_w
    grads = (g * n / shard_g if stage < 3 else 0) + fp32_grad * n / shard_o
    optimizer = opt * n / shard_o
    offloaded = 0.0
    if offload_optimizer:
        offloaded += optimizer + fp32_grad * n / shard_o
        optimizer, grads = 0.0, (g * n if stage < 2 else 0.0)
    if offload_param:
        offloaded += params
        params = 0.0
    return params, grads, optimizer, offloaded, step_only


def bf16_states(n: float, shard: int) -> tuple[float, float, float, float, float]:
    """What DeepSpeed's BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py) holds for n
    parameters, ZeRO-1 over `shard` ranks: the bf16 weights, flattened (2); an fp32 gradient
    buffer of EVERY parameter, not sharded (fp32_groups_gradients_flat, zeros_like the flat bf16
    group in grad_accum_dtype: 4); the bf16 ``.grad`` of every parameter, zeroed (not freed) at
    each backward's start and summed into the fp32 buffer at its end, freed by the step's
    zero_grad (the generated config leaves bf16.immediate_grad_update at its default, false: 2);
    the fp32 master partition (fp32_groups_flat_partition: 4/N) and Adam's moments on it (8/N).
    At the accumulation boundary the engine all-reduces the whole fp32 buffer in its
    communication_data_type (engine.allreduce_bucket: ``tensor.to(bf16)``), a 2-byte copy of
    every parameter while the activations are gone (step_only)."""
    return 2 * n, (2 + 4) * n, 12 * n / shard, 0.0, 2 * n


@dataclass(frozen=True)
class StageParams:
    """Parameters one GPU of a pipeline stage holds before ZeRO sharding."""

    dense: float
    expert: float
    largest: int  # largest single module (what ZeRO-3 gathers at once), after tp/etp splitting
    modules: float = 0.0  # modules holding parameters (megatron-core's: a routed expert's fc1 and fc2 each)
    # the tensors in order, as runs: ((dense runs, expert runs), layers), a run (elements, how many in a row)
    # after tp/etp splitting, in the order the model registers them: the embedding, the layers, the head
    # (data_time.tensor_calls and megatron_buckets: DeepSpeed's and Megatron's buckets take whole tensors)
    tensors: tuple = field(default=(), compare=False)
    # the entries of ``tensors`` that are megatron-core's shared embedding (tied or MTP embeddings with pp > 1:
    # the param's ``shared_embedding``), which its gradient buffer puts in a bucket of its own
    shared: tuple = field(default=(), compare=False)
    # whether megatron-core's gradient buffer is bucketed: on the first pipeline stage only
    # (DistributedDataParallel sets bucket_size None at pp rank > 0: one bucket, behind the pipeline's drain)
    bucketed: bool = field(default=True, compare=False)


def _rank_params(weights, layout: Layout) -> StageParams:
    dense = expert = modules = 0.0
    largest = 0
    runs: tuple[list, list] = ([], [])
    for w in weights:
        if w.split == "expert":
            expert += w.total / (layout.ep * layout.etp)
            largest = max(largest, int(w.numel / layout.etp))
            modules += w.count / layout.ep
            for part in w.parts or (w.numel,):
                _add_run(runs[1], int(part / layout.etp), max(1, round(w.count / layout.ep)))
        else:
            split = layout.tp if w.split in ("tp", "vocab") else 1
            dense += w.numel / split
            largest = max(largest, int(w.numel / split))
            modules += 1
            for part in w.parts or (w.numel,):
                _add_run(runs[0], int(part / split), 1)
    return StageParams(dense, expert, largest, modules, ((tuple(runs[0]), tuple(runs[1])), 1))


def _add_run(runs: list, size: int, count: int) -> None:
    if runs and runs[-1][0] == size:
        runs[-1] = (size, runs[-1][1] + count)
    else:
        runs.append((size, count))


class _KeptHash(tuple):
    """A tuple with its hash kept: layer_kind_keys' (one triple per layer) and stage_signatures'
    (one entry per stage) key the estimate's and the search's caches, and a tuple is hashed anew,
    element by element, at every lookup otherwise."""

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = tuple.__hash__(self)
            return self._hash


_KIND_KEYS: dict[int, tuple[ModelShape, tuple]] = {}  # id(shape) -> (shape, its keys): shapes hold dicts, unhashable


def layer_kind_keys(shape: ModelShape) -> tuple[tuple[bool, bool, bool], ...]:
    """Per layer, what its weights and work depend on: (MoE layer, sliding-window attention,
    gated delta net).
    Kept per shape object (the search asks ~10^4 times per model; the entry holds the shape, so
    its id cannot be reused while cached)."""
    hit = _KIND_KEYS.get(id(shape))
    if hit is None or hit[0] is not shape:
        if len(_KIND_KEYS) >= 64:
            _KIND_KEYS.clear()
        hit = _KIND_KEYS[id(shape)] = (shape, _KeptHash((shape.is_moe_layer(i), shape.is_window_layer(i),
                                                          shape.is_linear_attention_layer(i))
                                                         for i in range(shape.num_layers)))
    return hit[1]


def stage_layer_kinds(shape: ModelShape, layout: Layout, stage: int) -> dict[int, int]:
    """{representative layer: count} per kind (dense/MoE, full/sliding-window attention) in the
    stage: only the kind matters."""
    return dict(_layer_kinds(layer_kind_keys(shape), layout.pipeline(shape.num_layers), stage, shape.mtp_layers))


def stage_signatures(shape: ModelShape, layout: Layout) -> tuple[tuple, ...]:
    """Per stage: (its layer kinds as in stage_layer_kinds, first stage, last stage). Stages with
    the same signature hold the same weights and do the same work per micro-batch."""
    return _signatures(layer_kind_keys(shape), layout.pipeline(shape.num_layers), shape.mtp_layers)


@lru_cache(maxsize=1024)
def signature_slots(signatures: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the first stage of each distinct signature, in stage order; each stage's signature as its
    number in that order) of stage_signatures' tuple: stages of one signature do the same work, so
    the step time computes it at the first of them and the others refer to it (kept per signatures:
    the search asks for the same ones at ~10,000 grids and micro batches)."""
    number: dict[tuple, int] = {}
    slots = tuple(number.setdefault(sig, len(number)) for sig in signatures)
    return tuple(slots.index(i) for i in range(len(number))), slots


@lru_cache(maxsize=1024)
def _signatures(layer_keys: tuple, split: PipelineSplit, mtp: int = 0) -> tuple[tuple, ...]:
    return _KeptHash((_layer_kinds(layer_keys, split, k, mtp), k == 0, k == split.pp - 1) for k in range(split.pp))


@lru_cache(maxsize=4096)
def _layer_kinds(layer_keys: tuple, split: PipelineSplit, stage: int, mtp: int = 0) -> tuple[tuple[int, int], ...]:
    counts = Counter(layer_keys[i] for i in split.stage_layer_ids(stage))
    if stage == split.pp - 1 and mtp:  # MTP modules: a decoder layer of the last layer's kind each, on the last stage
        counts[layer_keys[-1]] += mtp
    # the model's first layer of each kind stands for all of them (stages with equal counts compare equal)
    return tuple((layer_keys.index(kind), counts[kind]) for kind in sorted(set(layer_keys)) if counts[kind])


def stage_edges(shape: ModelShape, layout: Layout, stage: int) -> tuple[list, list]:
    """The stage's embedding and head weights (layers are counted by stage_params) as (before the layers,
    after them), each piece with whether it is megatron-core's shared embedding
    (LanguageModule.setup_embeddings_and_output_layer: the embedding and its copy on the last stage when
    the output layer or MTP shares it across pipeline stages)."""
    vocab = padded_vocab(shape.vocab_size, layout.tp)
    shared = bool(shape.tie_embeddings or shape.mtp_layers) and layout.pp > 1
    before = [(embedding_weights(shape, vocab), shared)] if stage == 0 else []
    after = []
    if stage == layout.pp - 1:
        after.append((head_weights(shape, vocab), False))
        if shared:  # its own copy: output layer / MTP
            after.append((embedding_weights(shape, vocab), True))
    return before, after


def mtp_weights(shape: ModelShape) -> list:
    """What one MTP module holds besides its decoder layer (counted as a layer of the last
    stage): the projection of [embedding, hidden] to hidden and three norms (stage_params counts
    them shape.mtp_layers times, as it counts layers of one kind)."""
    from ..models.params import Weight

    h = shape.hidden_size
    return [Weight("mtp.layers.eh_proj", 2 * h * h, "tp")] + [Weight(f"mtp.layers.{n}", h, "rep")
                                                               for n in ("enorm", "hnorm", "final_layernorm")]


def stage_params(shape: ModelShape, layout: Layout, stage: int, hf: str | None = None) -> StageParams:
    """``hf``: the layers as transformers' modules (params.hf_layer_weights, its ``experts``: target hf,
    spec_stage_params); None: megatron-core's. The same parameters either way; the modules, their
    tensors and the largest module (what DeepSpeed ZeRO-3 gathers at once) differ."""
    before, after = stage_edges(shape, layout, stage)
    pieces = [(weights, 1, shared) for weights, shared in before]  # in the order the model registers them
    pieces += [(layer_weights(shape, layer) if hf is None else hf_layer_weights(shape, layer, hf), count, False)
               for layer, count in stage_layer_kinds(shape, layout, stage).items()]
    pieces += [(weights, 1, shared) for weights, shared in after]
    if stage == layout.pp - 1 and shape.mtp_layers:  # each MTP module's projection and norms
        pieces.append((mtp_weights(shape), shape.mtp_layers, False))
    dense = expert = modules = 0.0
    largest, tensors = 0, []
    for weights, count, _ in pieces:
        p = _rank_params(weights, layout)
        dense, expert, largest = dense + count * p.dense, expert + count * p.expert, max(largest, p.largest)
        modules += count * p.modules
        tensors.append((p.tensors[0], count))
    shared = tuple(k for k, piece in enumerate(pieces) if piece[2])
    return StageParams(dense, expert, largest, modules, tuple(tensors), shared, stage == 0)


def hf_modules(spec: TrainingSpec) -> str | None:
    """How the spec's model is held in modules: transformers' (target hf: the HF Trainer trains
    transformers' model; spec.estimate.hf_experts) or megatron-core's (None)."""
    return spec.estimate.hf_experts if spec.target == "hf" else None


def spec_stage_params(spec: TrainingSpec, shape: ModelShape, layout: Layout, stage: int) -> StageParams:
    return stage_params(shape, layout, stage, hf_modules(spec))


def stage_states(p: StageParams, layout: Layout, zero: Zero, precision: str,
                 copy: str = "kept") -> tuple[float, float, float, float, float]:
    """(params, grads, optimizer, offloaded, step_only) bytes of one GPU of the stage."""
    kw = dict(stage=zero.stage, precision=precision, offload_optimizer=zero.offload_optimizer != "none",
              offload_param=zero.offload_param != "none", copy=copy)
    dense_shard, expert_shard = layout.dp_cp, layout.edp  # the GPUs holding the same weights
    d = model_state_bytes(p.dense, dense_shard, **kw)
    e = model_state_bytes(p.expert, expert_shard, **kw)
    params, grads, opt, off, step_only = (x + y for x, y in zip(d, e))
    if sharded(zero.stage, "params"):  # DeepSpeed's 4 x largest layer: gathered 16-bit params and grads
        params, grads = params + 2 * p.largest, grads + 2 * p.largest
        if zero.hpz_partition_size > 1:  # ZeRO++'s secondary partition: 1/hpz of the parameters in their dtype
            params += element_bytes(precision) * (p.dense + p.expert) / zero.hpz_partition_size
    return params, grads, opt, off, step_only


# ---------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class StageActivations:
    """Activation bytes per token of one micro-batch's sequence shard on one GPU of a stage."""

    stored: float  # left in the stage's layers for the backward pass (x micro-batches in flight)
    rebuilt: float  # full and op recompute: the largest layer rebuilt at once during backward
    edge: float  # last stage, once: 16-bit logits and the fp32 softmax of the vocab-parallel cross
    # entropy (TransformerEngine's writes its gradient into the logits: no fp32 copy), and each MTP
    # module's norms and projection inputs (activations.mtp_module_bytes)


def stage_activations(shape: ModelShape, layout: Layout, stage: int, *, seq: int, recompute: str, kernels: Kernels,
                      act_bytes: int, routed: float = 1.0, fp8: bool = False, bf16_layers: int = 0,
                      fp32_logits: bool = True) -> StageActivations:
    """``fp8``: the layers' linear layers run in FP8, but for ``bf16_layers`` at each end of the model;
    ``fp32_logits``: the loss keeps an fp32 softmax beside the logits (all but TransformerEngine's)."""
    kw = dict(tokens=1.0, seq=seq, layout=layout, kernels=kernels, act_bytes=act_bytes, routed=routed)
    kinds = stage_layer_kinds(shape, layout, stage)
    stored = sum(n * layer_activation_bytes(shape, i, recompute=recompute, fp8=fp8, **kw) for i, n in kinds.items())
    for j in bf16_layer_ids(shape, layout, stage, bf16_layers if fp8 else 0):
        stored += (layer_activation_bytes(shape, j, recompute=recompute, **kw)
                   - layer_activation_bytes(shape, j, recompute=recompute, fp8=True, **kw))
    rebuilt = 0.0
    if recompute in ("full", "op"):  # one layer is rebuilt at a time during backward
        rebuilt = max(layer_activation_bytes(shape, i, recompute="none", fp8=fp8, **kw) for i in kinds)
    edge = 0.0
    if stage == layout.pp - 1:  # the main logits and each MTP module's, all kept for backward
        per_logit = act_bytes + (4 if fp32_logits else 0)
        edge = (1 + shape.mtp_layers) * padded_vocab(shape.vocab_size, layout.tp) / layout.tp * per_logit
        edge += mtp_module_bytes(shape, layout, kernels, act_bytes)
    return StageActivations(stored, rebuilt, edge)


def bf16_layer_ids(shape: ModelShape, layout: Layout, stage: int, n: int) -> list[int]:
    """The layers of a stage that fp8.bf16_layers keeps out of FP8: the model's first and last n
    (megatron-core's is_first_last_bf16_layer counts global layer numbers)."""
    if not n:
        return []
    ends = set(range(n)) | set(range(shape.num_layers - n, shape.num_layers))
    return sorted(ends & set(layout.pipeline(shape.num_layers).stage_layer_ids(stage)))


def fp8_weight_bytes(spec: TrainingSpec, shape: ModelShape, layout: Layout, stage: int) -> float:
    """TransformerEngine's FP8 copies of the stage's linear weights, per GPU: the row-wise copy the
    forward GEMM reads and the transposed one the data-gradient GEMM reads on Hopper (TE's docs,
    "Performance considerations"), 1 byte each, cached across the micro-batches of a step (megatron
    passes is_first_microbatch) and not sharded by the distributed optimizer. With fp8.param the
    weights are FP8 themselves (megatron's fp8_param): the 2-byte weight becomes the 1-byte row-wise
    copy and only the transpose is added, so nothing over the 16-bit weight. Norm and router
    weights are counted as linear (a few h per layer against ~12 h^2)."""
    f = spec.fp8
    if not f.on or f.param:
        return 0.0
    kinds = dict(stage_layer_kinds(shape, layout, stage))
    for j in bf16_layer_ids(shape, layout, stage, f.bf16_layers):
        kinds[j] = kinds.get(j, 0) - 1  # a kind's count may go to its representative, it sums the same
    n = 0.0
    for layer, count in kinds.items():
        p = _rank_params(layer_weights(shape, layer), layout)
        n += count * (p.dense + p.expert)
    return 2.0 * n


def in_flight(layout: Layout, stage: int, grad_accum: int) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak (1F1B / interleaved), in
    units of the whole stage: the warm-up forwards plus the first steady-state one, each of one
    chunk (1/vpp of the stage), at most every chunk of every micro-batch. Where the stage's
    chunks hold different numbers of layers (the embedding's or the loss's accounted chunk),
    megatron's order is followed chunk by chunk (``interleaved_peak_layers``)."""
    p, v = layout.pp, layout.vpp
    warmup = warmup_forwards(p, v, stage, layout.ep_a2a_overlap)
    chunks = tuple(layout.split.layers(stage, c) for c in range(v)) if layout.split is not None and v > 1 else ()
    if len(set(chunks)) > 1:
        return interleaved_peak_layers(p, v, grad_accum, warmup, chunks) / sum(chunks)
    return min(grad_accum * v, warmup + 1) / v


@lru_cache(maxsize=4096)
def interleaved_peak_layers(pp: int, vpp: int, micro_batches: int, warmup: int, chunks: tuple[int, ...]) -> int:
    """Most layers' activations a stage holds at once in megatron-core's interleaved schedule,
    its chunks holding ``chunks`` layers: forwards in ``get_schedule_table`` order (groups of pp
    micro-batches, chunk by chunk), ``warmup`` of them first, then each forward k + warmup
    followed by the backward of virtual micro-batch k, which runs chunk vpp - 1 - c
    (forward_backward_pipelining_with_interleaving)."""
    import numpy as np  # here: `toolkit plan` without --auto does not need it

    groups = np.minimum(pp, micro_batches - np.arange(0, micro_batches, pp))  # micro-batches per group
    order = np.repeat(np.tile(np.arange(vpp), len(groups)), np.repeat(groups, vpp))
    size = np.asarray(chunks, dtype=np.int64)
    warmup = min(warmup, len(order))
    added = np.cumsum(size[order])  # layers held after forward j, before any backward
    removed = np.concatenate(([0], np.cumsum(size[vpp - 1 - order])))  # freed by the first k backwards
    # forward warmup + k runs after k backwards: held = added[warmup + k] - removed[k]
    steady = added[warmup:] - removed[:len(order) - warmup]
    start = int(added[warmup - 1]) if warmup else 0
    return max(start, int(steady.max())) if len(steady) else start


def activation_bytes(acts: StageActivations, tokens: float, micro_batches_in_flight: float) -> float:
    return tokens * (acts.stored * micro_batches_in_flight + acts.rebuilt + acts.edge)


def micro_batch_tokens(layout: Layout, batch: BatchPlan) -> float:
    """Tokens of one micro-batch on one GPU: its sequence shard under context parallelism."""
    return batch.micro * batch.seq_len / layout.cp


def stage_activation_bytes(shape: ModelShape, layout: Layout, batch: BatchPlan, stage: int, *,
                           recompute: str, kernels: Kernels, act_bytes: int, routed: float = 1.0,
                           fp8: bool = False, bf16_layers: int = 0, fp32_logits: bool = True) -> float:
    acts = stage_activations(shape, layout, stage, seq=batch.seq_len, recompute=recompute, kernels=kernels,
                             act_bytes=act_bytes, routed=routed, fp8=fp8, bf16_layers=bf16_layers,
                             fp32_logits=fp32_logits)
    return activation_bytes(acts, micro_batch_tokens(layout, batch), in_flight(layout, stage, batch.grad_accum))


# ---------------------------------------------------------------------------- the estimate
def bucket_bytes(spec: TrainingSpec, shape: ModelShape) -> float:
    """DeepSpeed communication buckets in flight (sizes as emitted in ds_config.json); none where
    BF16_Optimizer runs (its reduction's copy is counted in bf16_states)."""
    if bf16_optimizer(spec.target, spec.precision, spec.zero):
        return 0.0
    return element_bytes(spec.precision) * buckets_in_flight(spec.zero.stage, bucket_sizes(spec, shape))


def buffer_bytes(spec: TrainingSpec, shape: ModelShape) -> float:
    """CUDA context / NCCL / fragmentation allowance plus DeepSpeed's buckets."""
    return spec.estimate.buffer_gib * GiB + bucket_bytes(spec, shape)


def causal_mask_bytes(spec: TrainingSpec, layout: Layout) -> float:
    """megatron's local layer spec (no TransformerEngine) at cp = 1 is given an explicit causal
    mask, bool [s, s], which the runtime builds once and keeps (toolkit.runtime.engine.Stage;
    Megatron-LM's local layers get theirs from the data loader). TE's attention and the
    context-parallel attention (cp > 1) take none. 1 GiB at 32k tokens."""
    if spec_kernels(spec).transformer_engine or layout.cp > 1:
        return 0.0
    return float(spec.batch.seq_len) ** 2


def activation_settings(spec: TrainingSpec) -> dict:
    """The spec's inputs to a layer's activation terms besides recompute."""
    return dict(kernels=spec_kernels(spec), act_bytes=element_bytes(spec.precision),
                routed=routed_share(spec.moe), fp8=spec.fp8.on)


def stage_activation_settings(spec: TrainingSpec) -> dict:
    """activation_settings and what a stage's count adds: the layers FP8 leaves out, the loss's fp32
    softmax (TransformerEngine's cross entropy keeps none; target hf runs transformers' loss)."""
    return {**activation_settings(spec), "bf16_layers": spec.fp8.bf16_layers, "fp32_logits": loss_kind(spec) != "te"}


def trained_states(spec: TrainingSpec, shape: ModelShape, layout: Layout,
                   stage: int) -> tuple[float, float, float, float, float]:
    """stage_states of what the spec trains: every weight, or LoRA's adapters on a frozen base
    (toolkit.estimate.lora)."""
    from .lora import model_states, spec_adapter_params

    adapters = spec_adapter_params(spec, shape, layout, stage) if spec.finetune.method == "lora" else None
    return model_states(spec_stage_params(spec, shape, layout, stage), adapters, layout, spec.zero, spec.precision,
                        grad_copy(spec))


def estimate_memory(spec: TrainingSpec, shape: ModelShape, layout: Layout, batch: BatchPlan,
                    gpu_gib: float) -> MemoryEstimate:
    buffers = buffer_bytes(spec, shape) + causal_mask_bytes(spec, layout)
    stages = []
    for k in range(layout.pp):
        params, grads, opt, off, step_only = trained_states(spec, shape, layout, k)
        params += fp8_weight_bytes(spec, shape, layout, k)
        acts = stage_activation_bytes(shape, layout, batch, k, recompute=spec.recompute,
                                      **stage_activation_settings(spec))
        stages.append(StageMemory(k, params, grads, opt, acts, buffers, off, step_only))
    from ..models import total_params

    return MemoryEstimate(tuple(stages), gpu_gib, 16.0 * total_params(shape))
