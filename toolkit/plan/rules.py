"""Layout rules. Each rule looks at the spec and what was derived from it and returns
messages that show the arithmetic. All rules run; the plan lists every violation.

A size that does not come out (a division with a remainder, a size larger than the
world or the model) is a ``size_error``: the plan then estimates nothing from the derived
sizes, so an absurd ``pp`` is refused here before anything is sized by it.

Where a rule is enforced upstream it says so: megatron-core's TransformerConfig /
ModelParallelConfig / parallel_state, Megatron-LM's arguments.py, or DeepSpeed's engine.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from ..hardware import GPU
from ..kernels import spec_kernels
from ..models import ModelShape
from ..spec import TrainingSpec
from ..parallel.layout import BatchPlan, Layout


@dataclass(frozen=True)
class Context:
    spec: TrainingSpec
    shape: ModelShape
    layout: Layout
    batch: BatchPlan
    gpu: GPU


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning"
    message: str
    sizes: bool = False  # the derived sizes (dp, accumulation, layers per stage) do not come out
    rule: str = ""  # the id of the rule that found it (its function's name), set by make_plan
    scope: str = ""  # what the rule is about (SCOPES), set by make_plan


Rule = Callable[[Context], Iterator[Finding]]
RULES: list[Rule] = []
# What a rule is about. "layout" and "model": a parallel layout of a model, and what megatron-core can
# build of the model at all (both hold for a checkpoint as much as for a run: the converters check
# them); "training": the run (batch, ZeRO, precision, memory, kernels); "target": what the target's
# trainer can express (Megatron-LM's flags); "runtime": what this toolkit's runtime can run.
SCOPES = ("layout", "model", "training", "target", "runtime")


def rule(fn: Rule | None = None, *, scope: str = "layout"):
    """Register a rule (``@rule`` or ``@rule(scope=...)``); its id is its function's name."""
    assert scope in SCOPES, scope

    def register(f: Rule) -> Rule:
        f.scope = scope
        RULES.append(f)
        return f

    return register(fn) if fn is not None else register


def found(r: Rule, findings) -> list[Finding]:
    """A rule's findings with its id and scope."""
    return [replace(f, rule=r.__name__, scope=r.scope) for f in findings]


def error(msg: str) -> Finding:
    return Finding("error", msg)


def warning(msg: str) -> Finding:
    return Finding("warning", msg)


def size_error(msg: str) -> Finding:
    return Finding("error", msg, sizes=True)


PARALLEL_SIZES = ("tp", "pp", "cp", "ep", "etp")


def _world(c: Context) -> str:
    return f"world size {c.layout.world} ({c.spec.cluster.nodes} nodes x {c.spec.cluster.gpus_per_node} GPUs)"


@rule
def sizes_within_world(c: Context) -> Iterator[Finding]:
    """No parallel size can exceed the number of GPUs."""
    for name in PARALLEL_SIZES:
        size = getattr(c.layout, name)
        if size > c.layout.world:
            yield size_error(f"{name}={size} is larger than the {_world(c)}")


@rule
def world_divisible(c: Context) -> Iterator[Finding]:
    """parallel_state.initialize_model_parallel: world % (tp*pp*cp) == 0."""
    lay, w = c.layout, c.layout.world
    mp = lay.model_parallel
    if w % mp and max(lay.tp, lay.pp, lay.cp) <= w:  # a single size beyond the world: sizes_within_world
        yield size_error(f"{_world(c)} is not divisible by tp*pp*cp = {lay.tp}*{lay.pp}*{lay.cp} = {mp}")


@rule
def expert_grid(c: Context) -> Iterator[Finding]:
    """parallel_state: world % (etp*ep*pp) == 0 (the expert data-parallel grid of a MoE model)."""
    lay, w = c.layout, c.layout.world
    n = lay.etp * lay.ep * lay.pp
    if c.shape.moe is not None and w % n and max(lay.etp, lay.ep, lay.pp) <= w:
        yield size_error(f"world size {w} is not divisible by etp*ep*pp = {lay.etp}*{lay.ep}*{lay.pp} = {n} "
                         "(expert data-parallel grid)")


@rule
def heads_divisible(c: Context) -> Iterator[Finding]:
    """TransformerConfig: num_attention_heads % tp == 0; attention: num_query_groups % tp == 0."""
    s, tp = c.shape, c.layout.tp
    if tp > s.num_attention_heads:
        yield size_error(f"tp={tp} is larger than num_attention_heads={s.num_attention_heads}")
        return
    if s.num_attention_heads % tp:
        yield size_error(f"tp={tp} does not divide num_attention_heads={s.num_attention_heads}")
    if s.mla is None and s.num_query_groups % tp:
        yield size_error(f"tp={tp} does not divide num_query_groups={s.num_query_groups} (num_key_value_heads); "
                         "KV-head replication (tp > groups) is not supported by this toolkit")


@rule
def ffn_divisible(c: Context) -> Iterator[Finding]:
    """ColumnParallelLinear divides the output size by tp (megatron.core.utils.divide)."""
    s, lay = c.shape, c.layout
    if lay.tp > s.num_attention_heads:  # heads_divisible says so
        return
    if any(not s.is_moe_layer(i) for i in range(s.num_layers)) and s.ffn_hidden_size % lay.tp:
        yield size_error(f"tp={lay.tp} does not divide ffn_hidden_size={s.ffn_hidden_size}")
    if s.moe is not None:
        if s.moe.ffn_hidden_size % lay.etp:
            yield size_error(f"etp={lay.etp} does not divide moe_ffn_hidden_size={s.moe.ffn_hidden_size}")
        if s.moe.shared_ffn_hidden_size % lay.tp:
            yield size_error(f"tp={lay.tp} does not divide shared expert ffn size={s.moe.shared_ffn_hidden_size}")


@rule
def layers_divisible(c: Context) -> Iterator[Finding]:
    """megatron-core's layer placement (toolkit.parallel.pipeline): even, uneven first/last stage,
    or embedding/loss counted as layers; every chunk builds at least one layer."""
    n, pp = c.shape.num_layers, c.layout.pp
    if pp > n:
        yield size_error(f"pp={pp} is larger than num_layers={n} (a pipeline stage needs a layer)")
        return
    for problem in c.layout.split.problems():
        yield size_error(problem)


@rule
def vpp_needs_pp(c: Context) -> Iterator[Finding]:
    """ModelParallelConfig: virtual pipeline stages need pipeline parallelism."""
    if c.layout.vpp > 1 and c.layout.pp == 1:
        yield error(f"vpp={c.layout.vpp} needs pp > 1 (pp=1)")


@rule(scope="training")
def interleaved_microbatches(c: Context) -> Iterator[Finding]:
    """schedules.py (interleaved 1F1B): micro-batches come in groups of pp."""
    lay, m = c.layout, c.batch.grad_accum
    if lay.vpp > 1 and lay.pp > 1 and m % lay.pp and not lay.world % lay.model_parallel:
        yield size_error(f"interleaved schedule (vpp={lay.vpp}) needs the number of micro-batches "
                    f"(global/(micro*dp) = {m}) to be a multiple of pp={lay.pp}")


@rule
def experts(c: Context) -> Iterator[Finding]:
    """Megatron-LM arguments.py: num_experts % ep == 0; ep > 1 needs a MoE model."""
    s, lay = c.shape, c.layout
    if s.moe is None:
        if lay.ep > 1:
            yield error(f"ep={lay.ep} needs a MoE model; {s.architecture} has no experts")
        return
    if lay.ep > s.moe.num_experts:
        yield size_error(f"ep={lay.ep} is larger than num_experts={s.moe.num_experts}")
    elif s.moe.num_experts % lay.ep:
        yield size_error(f"ep={lay.ep} does not divide num_experts={s.moe.num_experts}")
    if lay.ep == 1 and lay.etp != lay.tp:
        yield error(f"etp={lay.etp} != tp={lay.tp} with ep=1: megatron-core marks expert weights for the expert "
                    "data-parallel reduction only when ep > 1 (layers.py: allreduce = not (is_expert and "
                    "expert_parallel)), so their gradients would be averaged over the dense data-parallel group, "
                    "whose ranks hold other etp shards; use etp = tp or ep > 1")
    if s.linear_bias and lay.etp != 1:
        yield error(f"etp={lay.etp}: megatron-core builds experts with biases (linear_bias) only at expert tensor "
                    "parallelism 1 (TransformerConfig: 'Bias in Moe is only supported when ETP==1'); use --etp 1 "
                    "(with ep > 1 when tp > 1)")


@rule
def sequence_parallel(c: Context) -> Iterator[Finding]:
    """TransformerConfig: SP needs tp > 1; MoE with tp > 1 needs SP."""
    p, lay = c.spec.parallel, c.layout
    if p.sequence_parallel and lay.tp == 1:
        yield error("sequence_parallel=true needs tp > 1 (tp=1); Megatron-LM would silently turn it off")
    if c.shape.moe is not None and lay.tp > 1 and not lay.sequence_parallel:
        yield error(f"MoE with tp={lay.tp} needs sequence_parallel=true")


@rule
def mtp_within_sequence(c: Context) -> Iterator[Finding]:
    """megatron-core's MTP block rolls the labels one position further per module (roll_tensor,
    shifts=-1): module k learns the token k + 1 ahead, so at seq_len S only S - 1 modules have a label."""
    n, s = c.shape.mtp_layers, c.batch.seq_len
    if n >= s:
        yield size_error(f"mtp.layers={n} at seq_len={s}: MTP module k predicts the token k+1 ahead (megatron "
                         f"rolls the labels once per module), so at most seq_len-1 = {s - 1} modules have a label")


@rule
def context_parallel(c: Context) -> Iterator[Finding]:
    lay, s = c.layout, c.batch.seq_len
    cp = lay.cp
    if cp > 1 and s % (2 * cp):
        yield size_error(f"seq_len={s} is not divisible by 2*cp = {2 * cp}")
    if cp > 1 and spec_kernels(c.spec).attention != "flash" and c.spec.target == "megatron-lm":
        yield error("cp > 1 needs attention.backend=flash with Megatron-LM (TransformerEngine's attention splits "
                    "the sequence; the toolkit's runtime has its own for the local spec)")
    yield from _cp_comm(c)


def _cp_comm(c: Context) -> Iterator[Finding]:
    """megatron's cp_comm_type rules: a2a splits heads over cp (a2a+p2p over cp_a2a) ranks."""
    lay, s = c.layout, c.shape
    if lay.cp_a2a is not None and lay.cp_comm != "a2a+p2p":
        yield error(f"cp_a2a={lay.cp_a2a} is for cp_comm=a2a+p2p only (cp_comm={lay.cp_comm})")
    if lay.cp == 1:
        return
    a2a = {"a2a": lay.cp, "a2a+p2p": lay.cp_a2a}.get(lay.cp_comm)
    if lay.cp_comm == "a2a+p2p" and (a2a is None or a2a < 2 or lay.cp % a2a or a2a == lay.cp):
        yield error(f"cp_comm=a2a+p2p needs parallel.cp_a2a: a divisor of cp={lay.cp} between 2 and cp/2 "
                    f"(the all-to-all level; the ring spans cp / cp_a2a), got {a2a}")
    elif a2a:
        heads, groups = s.num_attention_heads // lay.tp, s.num_query_groups // lay.tp
        if heads % a2a or groups % a2a:
            yield error(f"cp_comm={lay.cp_comm} splits heads over {a2a} ranks: heads per tp rank "
                        f"{s.num_attention_heads}/tp={heads} and query groups per tp rank {s.num_query_groups}/tp="
                        f"{groups} must both be divisible by {a2a}")


@rule(scope="training")
def tp_comm_overlap(c: Context) -> Iterator[Finding]:
    """TE's userbuffer overlap: TransformerEngine's layers on CUDA, and a trainer that creates the
    userbuffers (Megatron-LM's initialize_ub under --tp-comm-overlap)."""
    if not c.spec.parallel.tp_comm_overlap:
        return
    if not spec_kernels(c.spec).transformer_engine:
        yield error("parallel.tp_comm_overlap needs TransformerEngine's layers (attention.backend flash on a GPU)")
    if c.spec.target != "megatron-lm":
        yield error(f"parallel.tp_comm_overlap with target {c.spec.target}: only Megatron-LM creates "
                    "TransformerEngine's userbuffers (initialize_ub); use target megatron-lm")


@rule(scope="training")
def grad_reduce_dtype(c: Context) -> Iterator[Finding]:
    """optimizer.grad_reduce_dtype is Megatron-LM's choice for bf16 (--grad-reduce-in-bf16 or its
    default fp32 buffer); DeepSpeed's ZeRO fixes its own."""
    g = c.spec.optimizer.grad_reduce_dtype
    if g is None:
        return
    if c.spec.target != "megatron-lm":
        yield error(f"optimizer.grad_reduce_dtype={g} with target {c.spec.target}: only Megatron-LM's flags choose "
                    "it (DeepSpeed reduces in the 16-bit dtype into an fp32 partition); leave it null")
    elif c.spec.precision != "bf16":
        yield error(f"optimizer.grad_reduce_dtype={g} with precision {c.spec.precision}: it applies to bf16 "
                    "training only")


@rule(scope="training")
def moe_a2a_overlap(c: Context) -> Iterator[Finding]:
    """megatron's overlap_moe_expert_parallel_comm (its combined 1F1B schedules): enforced by
    megatron-core 0.16's TransformerConfig.__post_init__ where the overlap applies (ep > 1, vpp
    > 1 when pp > 1; elsewhere the setting is left out of the generated settings and the
    all-to-alls are counted exposed); only Megatron-LM's schedules run it (the runtime trains
    with DeepSpeed's pipeline engine)."""
    if not c.spec.moe.a2a_overlap:
        return
    if c.shape.moe is None:
        yield error(f"moe.a2a_overlap: {c.shape.architecture} has no expert layers")
        return
    if c.spec.target != "megatron-lm":
        yield error(f"moe.a2a_overlap with target {c.spec.target}: only Megatron-LM's pipeline schedules overlap "
                    "the expert-parallel all-to-alls (overlap_moe_expert_parallel_comm); use target megatron-lm")
    if not c.layout.ep_a2a_overlap:
        return
    if c.spec.recompute == "full":
        yield error("moe.a2a_overlap with recompute full: megatron-core forbids full recomputation with "
                    "overlap_moe_expert_parallel_comm (use selective or none)")
    if c.spec.precision not in ("bf16", "fp16"):
        yield error(f"moe.a2a_overlap with precision {c.spec.precision}: megatron-core overlaps the all-to-alls "
                    "of bf16 or fp16 models only")
    if c.spec.moe.token_dispatcher != "alltoall":
        yield error(f"moe.a2a_overlap with moe.token_dispatcher {c.spec.moe.token_dispatcher}: megatron-core "
                    "overlaps the alltoall (or flex) dispatcher only")
    if c.shape.mtp_layers > 1:
        yield error(f"moe.a2a_overlap with {c.shape.mtp_layers} MTP layers: megatron-core supports at most 1")
    elif c.shape.mtp_layers == 1 and c.layout.pp == 1:
        yield error("moe.a2a_overlap with an MTP layer needs pp > 1 (megatron-core's TransformerConfig)")


def hf_model_parallel(layout: Layout) -> str:
    """What the HF Trainer cannot run in ``layout`` ("" if nothing): it trains transformers' modules
    data-parallel (DeepSpeed ZeRO over every rank), with no Megatron model parallelism."""
    sizes = {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "ep": layout.ep}
    if layout.etp != layout.tp:  # (a dense model's etp follows tp)
        sizes["etp"] = layout.etp
    bad = [f"parallel.{k}={v}" for k, v in sizes.items() if v > 1]
    if not bad:
        return ""
    return (f"the HF Trainer has no Megatron model parallelism: {', '.join(bad)} must be 1 (it trains data-parallel "
            f"with DeepSpeed ZeRO over all {layout.world} ranks; use zero.stage 3 to shard the model)")


@rule(scope="target")
def hf_data_parallel(c: Context) -> Iterator[Finding]:
    """target hf is the HF Trainer (toolkit.hf): data parallel only, so neither a spec nor
    ``toolkit plan --auto`` gives it a layout with tp, pp, cp, ep or etp above 1."""
    if c.spec.target == "hf":
        why = hf_model_parallel(c.layout)
        if why:
            yield error(f"target hf: {why}; or use target recipes or megatron-lm")


@rule(scope="target")
def hf_packing(c: Context) -> Iterator[Finding]:
    """The HF Trainer trains on the dataset and collator its script hands it; the toolkit's packed
    chat data (toolkit.runtime.chat_dataset, a block-diagonal mask) is the runtime's."""
    if c.spec.data.packing and c.spec.target == "hf":
        yield error("data.packing with target hf: the Trainer trains on the dataset and data collator the script "
                    "gives it, not the toolkit's packed chat data; pack in the script (e.g. transformers' "
                    "DataCollatorWithFlattening) and set data.packing=false, or use target recipes")


@rule(scope="target")
def hf_selective_recompute(c: Context) -> Iterator[Finding]:
    """The HF Trainer checkpoints whole decoder layers (TrainingArguments.gradient_checkpointing,
    which toolkit.hf sets for recompute full) or nothing; megatron's selective recompute (the
    attention core) would be estimated but not run: the estimate's memory would be too low."""
    if c.spec.target == "hf" and c.spec.recompute == "selective":
        yield error("recompute=selective with target hf: the HF Trainer's gradient checkpointing recomputes whole "
                    "layers (recompute full) or nothing (recompute none); megatron's selective recompute of the "
                    "attention core is target recipes' or megatron-lm's")


@rule(scope="target")
def op_recompute(c: Context) -> Iterator[Finding]:
    """``recompute: op`` is torchtitan's per-op checkpointing, a planning input for runs made with it:
    megatron-core recomputes whole layers or named modules, the HF Trainer whole layers."""
    if c.spec.recompute == "op":
        yield error(f"recompute=op with target {c.spec.target}: torchtitan's per-op checkpointing, a planning input "
                    "for runs made with it; megatron-core (targets recipes and megatron-lm) recomputes whole layers "
                    "or the attention core, the HF Trainer whole layers, so none runs it; use recompute selective "
                    "(not with target hf), full or none")


@rule(scope="training")
def op_recompute_model(c: Context) -> Iterator[Finding]:
    """What the estimate of ``recompute: op`` covers: dense attention layers (the policy's matmul count is
    of wq wk wv wo w1 w3 w2: compute.op_recompute_gemms) at tp = cp = 1 (with tp the policy also keeps
    the reduce-scatters' outputs and recomputes the all-gathers, which the estimate does not count)."""
    if c.spec.recompute != "op":
        return
    s = c.shape
    kinds = [name for name, has in (("MoE", s.moe is not None), ("MLA", s.mla is not None),
                                    ("linear attention", s.linear_attention is not None),
                                    ("an attention output gate", s.attention_output_gate),
                                    ("a non-gated MLP", not s.gated_mlp)) if has]
    if kinds:
        yield error(f"recompute=op with {s.architecture}'s layers ({', '.join(kinds)}): the estimate of torchtitan's "
                    "per-op checkpointing is of dense attention layers with a gated MLP (wq wk wv wo w1 w3 w2) only")
    if c.layout.tp > 1 or c.layout.cp > 1:
        yield error(f"recompute=op with tp={c.layout.tp}, cp={c.layout.cp}: the estimate of torchtitan's per-op "
                    "checkpointing is for tp = cp = 1 (with tensor parallelism its policy also keeps the "
                    "reduce-scatters' outputs and recomputes the all-gathers, which it does not count)")


@rule(scope="training")
def cross_entropy_fusion(c: Context) -> Iterator[Finding]:
    """Where megatron-core's fused losses run: not in the HF Trainer (transformers computes its own);
    native casts the logits' gradient to bf16 (megatron/core/fusions/fused_cross_entropy.py,
    calculate_gradients), so bf16 only; te is TransformerEngine's kernel."""
    f = c.spec.cross_entropy_fusion
    if f == "none":
        return
    if c.spec.target == "hf":
        yield error(f"cross_entropy_fusion={f} with target hf: the HF Trainer runs transformers' own loss, not "
                    "megatron-core's; use none, or target recipes or megatron-lm")
    if f == "native" and c.spec.precision != "bf16":
        yield error(f"cross_entropy_fusion=native with precision {c.spec.precision}: megatron-core's fused cross "
                    "entropy casts the logits' gradient to bf16 (fused_cross_entropy.calculate_gradients); use "
                    "none, or precision bf16")
    if f == "te" and not spec_kernels(c.spec).transformer_engine:
        yield error(f"cross_entropy_fusion=te needs TransformerEngine (attention.backend flash or auto on a GPU; "
                    f"here {c.spec.attention.backend} on {c.spec.cluster.gpu} builds megatron's local layers)")


@rule(scope="target")
def fsdp_runs(c: Context) -> Iterator[Finding]:
    """``zero.engine: fsdp`` is a planning input for runs made with PyTorch FSDP: no target here runs it."""
    if c.spec.zero.engine == "fsdp":
        yield error(f"zero.engine=fsdp with target {c.spec.target}: a planning input for runs made with PyTorch FSDP "
                    "(torchtitan, llm-foundry); this toolkit generates DeepSpeed's config (targets recipes and hf) and "
                    "Megatron-LM's distributed optimizer (megatron-lm), so none runs it; use zero.engine deepspeed")


@rule(scope="training")
def fsdp_settings(c: Context) -> Iterator[Finding]:
    """What FSDP has: FULL_SHARD (stage 3), SHARD_GRAD_OP (2), NO_SHARD (0); the estimate's offload and
    ZeRO++ terms are DeepSpeed's."""
    z = c.spec.zero
    if z.engine != "fsdp":
        return
    if z.stage == 1:
        yield error("zero.engine=fsdp with zero.stage=1: FSDP shards parameters, gradients and optimizer states "
                    "(FULL_SHARD: stage 3), gradients and optimizer states (SHARD_GRAD_OP: 2) or nothing (NO_SHARD: 0)")
    if z.offload_optimizer != "none" or z.offload_param != "none":
        yield error("zero.engine=fsdp with offload: the estimate's offload is DeepSpeed's (FSDP's CPUOffload is not "
                    "modelled)")
    if z.hpz_partition_size > 1:
        yield error(f"zero.engine=fsdp with zero.hpz_partition_size={z.hpz_partition_size}: ZeRO++'s hierarchical "
                    "partitioning is DeepSpeed's (FSDP's HSDP is not modelled)")


@rule(scope="training")
def moe_capacity(c: Context) -> Iterator[Finding]:
    """megatron-core 0.16's TransformerConfig.__post_init__: padding to capacity needs a capacity."""
    m = c.spec.moe
    if m.pad_to_capacity and m.capacity_factor is None:
        yield error("moe.pad_to_capacity needs moe.capacity_factor (megatron-core's TransformerConfig: "
                    "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity)")
    if m.pad_to_capacity or m.capacity_factor is not None:
        if c.shape.moe is None:
            yield error(f"moe.capacity_factor / moe.pad_to_capacity: {c.shape.architecture} has no expert layers")
        elif c.spec.target == "hf":
            yield error("moe.capacity_factor / moe.pad_to_capacity with target hf: Hugging Face's MoE models route "
                        "every token (no capacity); use target recipes or megatron-lm")


@rule(scope="training")
def batch_invariant(c: Context) -> Iterator[Finding]:
    """DeepSpeed: train_batch_size == micro * grad_accum * dp."""
    b, dp = c.spec.batch, c.layout.dp
    if c.layout.world % c.layout.model_parallel:  # dp itself does not come out: world_divisible
        return
    if b.global_ % (b.micro * dp):
        yield size_error(f"global batch {b.global_} is not divisible by micro*dp = {b.micro}*{dp} = {b.micro * dp} "
                    "(DeepSpeed needs global = micro * grad_accum * dp)")


@rule(scope="training")
def zero_with_pipeline(c: Context) -> Iterator[Finding]:
    """DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only."""
    z, pp = c.spec.zero.stage, c.layout.pp
    if pp > 1 and z >= 2:
        what = "gradients" if z == 2 else "gradients and parameters"
        yield error(f"zero.stage={z} with pp={pp}: DeepSpeed's pipeline engine supports ZeRO 0 or 1 only "
                    f"(ZeRO-{z} would partition the {what} that every pipeline micro-batch uses); use zero.stage=1")


@rule(scope="training")
def offload(c: Context) -> Iterator[Finding]:
    """DeepSpeed: offload needs ZeRO (param offload: stage 3), its own optimizer, an NVMe path."""
    z, opt = c.spec.zero, c.spec.optimizer
    if z.offload_optimizer != "none" and z.stage == 0:
        yield error(f"offload_optimizer={z.offload_optimizer} needs zero.stage >= 1")
    if z.offload_param != "none" and z.stage != 3:
        yield error(f"offload_param={z.offload_param} needs zero.stage=3 (zero.stage={z.stage})")
    if z.offload_optimizer != "none" and opt.impl != "deepspeed":
        yield error(f"offload_optimizer={z.offload_optimizer} needs DeepSpeed's optimizer "
                    f"(optimizer.impl=deepspeed, got {opt.impl}): a torch optimizer cannot step on host memory")
    if "nvme" in (z.offload_optimizer, z.offload_param) and not z.nvme_path:
        yield error("offload to nvme needs zero.nvme_path")


@rule(scope="training")
def precision_overrides(c: Context) -> Iterator[Finding]:
    """DeepSpeedConfig asserts fp16 and bf16 are not both enabled."""
    ds = c.spec.deepspeed
    enabled = {k for k in ("fp16", "bf16") if isinstance(ds.get(k), dict) and ds[k].get("enabled")}
    enabled |= {c.spec.precision} & {"fp16", "bf16"}
    if len(enabled) > 1:
        yield error(f"fp16 and bf16 are both enabled (precision={c.spec.precision}, deepspeed overrides "
                    f"{sorted(k for k in ('fp16', 'bf16') if k in ds)}); DeepSpeed allows one")


@rule(scope="training")
def deepspeed_override_keys(c: Context) -> Iterator[Finding]:
    """DeepSpeed ignores unknown top-level keys silently; we do not."""
    if not c.spec.deepspeed:
        return
    from ..backends.deepspeed import unknown_deepspeed_keys

    for msg in unknown_deepspeed_keys(c.spec.deepspeed):
        yield error(f"deepspeed overrides: {msg}")


@rule(scope="training")
def deepspeed_zero_overrides(c: Context) -> Iterator[Finding]:
    """What DeepSpeed would refuse at launch, after the queue, in the spec's zero_optimization overrides: a
    bucket size the estimate reads (backends.deepspeed.bucket_sizes) that is neither a number nor "auto", and
    a name whose stage3_ alias the generated ZeRO-3 section sets; and a bucket or prefetch size below 1, whose
    per-parameter paths the estimate does not model."""
    if not c.spec.deepspeed:
        return
    from ..backends.deepspeed import zero_override_problems

    for msg in zero_override_problems(c.spec.deepspeed, c.spec.zero.stage):
        yield error(msg)


@rule(scope="model")
def megatron_features(c: Context) -> Iterator[Finding]:
    """What the model's features (ModelShape) ask of megatron-core that the toolkit's settings do
    not build (backends.megatron: its norms, activations, biases and rope fraction)."""
    from ..backends.megatron import feature_problems

    for problem in feature_problems(c.shape):
        yield error(f"{c.shape.architecture}: {problem}")


@rule(scope="model")
def megatron_rope(c: Context) -> Iterator[Finding]:
    """megatron-core's llama3 rope scaling fixes low/high frequency factors and the original length."""
    from ..backends.megatron import rope_problem

    problem = rope_problem(c.shape)
    if problem:
        yield error(problem)


@rule(scope="training")
def mla_tensor_parallel_local_spec(c: Context) -> Iterator[Finding]:
    """megatron-core 0.16's local MLA spec at tp > 1: its column-parallel linear_kv_down_proj is
    gathered over tp and the rope part of the key (k_pos_emb) is then used by every tp rank's
    heads, but the gather's backward only splits: the rope rows' gradient keeps the rank's own
    heads' contribution (measured on CPU: 60-90% off at tp=2). TransformerEngine's spec (a
    duplicated linear and a sequence-parallel gather, whose backward sums) does not have it."""
    if c.shape.mla is not None and c.layout.tp > 1 and not spec_kernels(c.spec).transformer_engine:
        yield error(f"tp={c.layout.tp} with multi-latent attention on megatron-core's local layer spec "
                    "(attention.backend unfused, or cpu): its linear_kv_down_proj gradient misses the other tp "
                    "ranks' share of the rope key (gather_from_tensor_model_parallel_region's backward only "
                    "splits); use tp=1 (ep/pp/dp scale it) or TransformerEngine's spec (attention.backend=flash "
                    "on a GPU)")


@rule(scope="model")
def mla_norm_eps(c: Context) -> Iterator[Finding]:
    """transformers builds DeepSeek's q/kv latent norms with eps 1e-6 whatever the config says;
    megatron-core uses one epsilon for every norm, so only 1e-6 converts exactly."""
    eps = c.shape.norm_eps
    if c.shape.mla is not None and eps != 1e-6:
        yield warning(f"rms_norm_eps={eps}: megatron-core gives the q/kv latent norms this epsilon and "
                      "transformers 1e-6, so the trained model will not export to Hugging Face exactly "
                      "(the converters refuse it)")


@rule(scope="training")
def mla_context_parallel_te(c: Context) -> Iterator[Finding]:
    """TransformerEngine before 2.5 has no attention backend for cp > 1 when the q/k and v head
    sizes differ, as MLA's do: get_attention_backend drops FusedAttention for it, FlashAttention
    for MLA, and the unfused attention has no cp (dot_product_attention/utils.py at v2.4; support:
    commit faee0e8, 2025-06-11). megatron-core's MoE README: requires TransformerEngine >= 2.5.0."""
    m = c.shape.mla
    if m is not None and c.layout.cp > 1 and spec_kernels(c.spec).transformer_engine:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        yield warning(f"cp={c.layout.cp} with multi-latent attention (q/k head size {qk}, v {m.v_head_dim}) "
                      "needs TransformerEngine >= 2.5: earlier versions have no attention backend for context "
                      "parallelism when the two differ")


@rule(scope="target")
def megatron_lm_flags(c: Context) -> Iterator[Finding]:
    """What the generated Megatron-LM flags cannot say (target megatron-lm: they are the run)."""
    from ..backends.megatron import megatron_lm_problem

    problem = megatron_lm_problem(c.shape) if c.spec.target == "megatron-lm" else None
    if problem:
        yield error(problem)


@rule(scope="target")
def megatron_lm_zero(c: Context) -> Iterator[Finding]:
    """Target megatron-lm: the generated flags run Megatron's distributed optimizer (ZeRO-1) or
    plain data parallelism; DeepSpeed's ZeRO-2/3 and offload are not what Megatron-LM runs."""
    z = c.spec.zero
    if c.spec.target != "megatron-lm":
        return
    if z.stage >= 2:
        yield error(f"zero.stage={z.stage} with target megatron-lm: the generated Megatron-LM flags run its "
                    "distributed optimizer (ZeRO-1); use zero.stage 0 or 1")
    if "cpu" in (z.offload_optimizer, z.offload_param) or "nvme" in (z.offload_optimizer, z.offload_param):
        yield error("zero offload with target megatron-lm: the generated Megatron-LM flags do not offload; "
                    "use zero.offload_optimizer/offload_param none")


@rule(scope="training")
def tp_within_node(c: Context) -> Iterator[Finding]:
    tp, g = c.layout.tp, c.spec.cluster.gpus_per_node
    if tp > g:
        yield warning(f"tp={tp} is larger than a node ({g} GPUs): tensor-parallel traffic crosses InfiniBand")


@rule(scope="training")
def sequence_length(c: Context) -> Iterator[Finding]:
    s, n = c.batch.seq_len, c.shape.max_position_embeddings
    if s > n:
        yield warning(f"seq_len={s} exceeds the model's max_position_embeddings={n}")


@rule(scope="training")
def deepspeed_warmup(c: Context) -> Iterator[Finding]:
    """DeepSpeed's WarmupDecayLR cannot start at full lr: it warms up for at least 2 steps."""
    o = c.spec.optimizer
    if o.impl == "deepspeed" and o.decay == "linear" and o.warmup_steps < 2 and o.min_lr < o.lr:
        yield warning(f"optimizer.warmup_steps={o.warmup_steps}: DeepSpeed's WarmupDecayLR in ds_config.json warms "
                      "up for 2 steps (lr 0, lr/2); the toolkit runtime applies the exact schedule")
