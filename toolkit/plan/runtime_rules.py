"""Limits of this toolkit's training runtime (DeepSpeed + megatron-core), as rules.

They hold when ``target: recipes`` (the default): what the recipes' runtime cannot run is
refused by the plan with its reason, so ``toolkit plan --auto`` never proposes it and a
recipe never fails at launch for it. With ``target: megatron-lm`` (Megatron-LM's own trainer
runs these layouts from the generated flags) or ``target: hf`` (the HF Trainer builds its own
model: toolkit.hf) they do not apply. What only a missing
GPU or library stops is checked at start (toolkit.runtime.trainer.unsupported), not here.
"""
from __future__ import annotations

from collections.abc import Iterator

from ..kernels import CPU, spec_kernels
from ..models.family import supports_mtp
from .rules import Context, Finding, error, rule

MEGATRON_LM = "; Megatron-LM runs it (target: megatron-lm)"


def _recipes(c: Context) -> bool:
    return c.spec.target == "recipes"


@rule(scope="runtime")
def runtime_zero3_experts(c: Context) -> Iterator[Finding]:
    if _recipes(c) and c.layout.ep > 1 and c.spec.zero.stage == 3:
        yield error(f"zero.stage=3 with ep={c.layout.ep}: DeepSpeed partitions under ZeRO-3 over the dense "
                    "data-parallel group only, not megatron's expert data-parallel group; use zero.stage 1 or 2")


@rule(scope="runtime")
def runtime_16bit_needs_zero(c: Context) -> Iterator[Finding]:
    """DeepSpeed accumulates gradients in fp32 (data_types.grad_accum_dtype) only with ZeRO."""
    p = c.spec.precision
    if _recipes(c) and p != "fp32" and c.spec.zero.stage == 0:
        yield error(f"precision={p} with zero.stage=0: without ZeRO DeepSpeed accumulates {p} gradients in {p} "
                    "(it supports fp32 accumulation with ZeRO only); use zero.stage >= 1")


@rule(scope="runtime")
def runtime_fp16_pipeline(c: Context) -> Iterator[Finding]:
    if _recipes(c) and c.layout.pp > 1 and c.spec.precision == "fp16":
        yield error(f"precision=fp16 with pp={c.layout.pp}: this runtime has no loss scale shared by the pipeline "
                    f"stages; use bf16{MEGATRON_LM}")


@rule(scope="runtime")
def runtime_fp32_zero0_norm(c: Context) -> Iterator[Finding]:
    """fp32 without ZeRO, DeepSpeed clips with deepspeed.runtime.utils.clip_grad_norm_."""
    lay, z = c.layout, c.spec.zero.stage
    if not (_recipes(c) and c.spec.precision == "fp32" and z == 0):
        return
    if lay.pp > 1:
        yield error(f"precision=fp32 with zero.stage=0 and pp={lay.pp}: DeepSpeed's gradient norm on that path "
                    "counts the replicated weights of the first stage only, so clipping would differ from pp=1; "
                    "use zero.stage >= 1")
    if lay.ep > 1:
        yield error(f"precision=fp32 with zero.stage=0 and ep={lay.ep}: DeepSpeed's gradient norm on that path "
                    "averages the norm over the data-parallel ranks instead of summing the experts of every "
                    "expert-parallel rank, so clipping would differ from ep=1; use zero.stage >= 1")


@rule(scope="runtime")
def runtime_bf16_expert_norm(c: Context) -> Iterator[Finding]:
    """DeepSpeed's bf16 ZeRO-1 optimizer (BF16_Optimizer) sums the experts' gradient norms over
    the tensor-parallel ranks (etp = tp) or over none of them (etp = 1): toolkit.runtime.mpu."""
    lay, z = c.layout, c.spec.zero
    if not (_recipes(c) and c.spec.precision == "bf16" and z.stage == 1 and z.offload_optimizer == "none"):
        return
    if lay.ep > 1 and lay.etp not in (1, lay.tp):
        yield error(f"etp={lay.etp} with tp={lay.tp}, ep={lay.ep}, bf16 and zero.stage=1: DeepSpeed's bf16 "
                    "optimizer sums the experts' gradient norms over the tensor-parallel ranks or over none, "
                    f"not over etp={lay.etp} other ranks, so each rank would clip with its own norm; use etp=1 "
                    f"or etp=tp, zero.stage=2 or zero.offload_optimizer=cpu{MEGATRON_LM}")


@rule(scope="runtime")
def runtime_mtp(c: Context) -> Iterator[Finding]:
    """Multi-token prediction trains as megatron-core's GPTModel does (its MTP block on the last
    stage, its loss added in backward), except where this runtime and megatron disagree."""
    n = c.shape.mtp_layers
    if not (_recipes(c) and n):
        return
    if not supports_mtp(c.shape):
        yield error(f"mtp.layers={n} on {c.shape.architecture}: its family has no multi-token prediction modules "
                    "(the weights the converters export them under); use mtp.layers=0")
    if c.layout.cp > 1:
        yield error(f"mtp.layers={n} with cp={c.layout.cp}: megatron-core normalises the MTP loss by each cp "
                    "rank's own token count, while this runtime's main loss is the mean over the micro-batch's "
                    "tokens on all cp ranks, so the MTP gradient would not be the cp=1 one; use cp=1 or "
                    f"mtp.layers=0{MEGATRON_LM}")
    if c.layout.vpp > 1:
        yield error(f"mtp.layers={n} with vpp={c.layout.vpp}: this runtime has not trained MTP modules on an "
                    f"interleaved pipeline (megatron puts them in the last model chunk); use vpp=1 or "
                    f"mtp.layers=0{MEGATRON_LM}")


@rule(scope="runtime")
def runtime_schedule(c: Context) -> Iterator[Finding]:
    o, steps = c.spec.optimizer, c.spec.train.steps
    schedule = {"recipes": "megatron-core's learning-rate schedule",  # (the HF Trainer's never decays if constant)
                "hf": f"the HF Trainer's {o.decay} schedule, toolkit.hf.arguments.lr_schedule,"}.get(c.spec.target)
    if schedule and o.warmup_steps >= steps and (_recipes(c) or o.decay != "constant"):
        yield error(f"optimizer.warmup_steps={o.warmup_steps} must be below train.steps={steps} "
                    f"({schedule} decays over the steps after warm-up)")


@rule(scope="runtime")
def runtime_kernels(c: Context) -> Iterator[Finding]:
    """What the kernels toolkit.kernels builds need (the memory estimate counts them)."""
    if not _recipes(c):
        return
    k, s = spec_kernels(c.spec), c.spec
    if s.cluster.gpu == CPU and s.attention.backend == "flash":
        yield error("attention.backend=flash on cluster.gpu=cpu: flash attention is TransformerEngine's, on CUDA; "
                    "use attention.backend=unfused")
    if c.shape.moe is not None and s.moe.grouped_gemm and not k.transformer_engine:
        yield error("moe.grouped_gemm=true with the local layer spec (attention.backend=unfused or no GPU): "
                    "megatron's legacy GroupedMLP needs the grouped_gemm package; grouped experts come with "
                    "TransformerEngine's spec (attention.backend=flash on a GPU)")
    if s.cluster.gpu == CPU and c.shape.moe is not None and s.moe.token_dispatcher == "alltoall":
        yield error("moe.token_dispatcher=alltoall on cluster.gpu=cpu: megatron's alltoall dispatcher creates "
                    "CUDA streams; use allgather")


@rule(scope="runtime")
def runtime_cp_sinks(c: Context) -> Iterator[Finding]:
    """The runtime's context-parallel attention on megatron's local spec
    (toolkit.mcore.context_parallel) computes a vanilla softmax only; it refuses a learnable
    one (GPT-OSS's attention sinks) where the model is built."""
    if (_recipes(c) and c.layout.cp > 1 and c.shape.attention_sinks
            and not spec_kernels(c.spec).transformer_engine):
        yield error(f"cp={c.layout.cp} with attention sinks ({c.shape.architecture}: megatron's softmax_type "
                    "'learnable'): the runtime's context-parallel attention on megatron's local layer spec has the "
                    "vanilla softmax only; use cp=1, or TransformerEngine's attention (attention.backend=flash on "
                    "a GPU)")


@rule(scope="runtime")
def runtime_ring_attention_dropout(c: Context) -> Iterator[Finding]:
    """The runtime's context-parallel ring (megatron's local spec: toolkit.mcore.cp_ring) has
    no attention dropout; ContextParallelAttention refuses it where the model is built."""
    lay, p = c.layout, c.shape.attention_dropout
    if (_recipes(c) and lay.cp > 1 and "p2p" in lay.cp_comm and p > 0
            and not spec_kernels(c.spec).transformer_engine):
        yield error(f"attention_dropout={p} with cp={lay.cp} cp_comm={lay.cp_comm} on megatron's local layer spec: "
                    "the runtime's ring attention has no dropout; use parallel.cp_comm all_gather or a2a, "
                    "or TransformerEngine's attention (attention.backend=flash on a GPU)")


@rule(scope="runtime")
def runtime_packing(c: Context) -> Iterator[Finding]:
    """Packed chat data (toolkit.runtime.packing): a block-diagonal mask with megatron's local
    attention, THD packed sequences with TransformerEngine's."""
    if not (_recipes(c) and c.spec.data.packing):
        return
    if c.layout.cp > 1:
        yield error(f"data.packing with cp={c.layout.cp}: this runtime splits a packed sequence over cp ranks "
                    "without its conversation boundaries; use cp=1 or data.packing=false")
    if c.shape.mtp_layers:
        yield error(f"data.packing with mtp.layers={c.shape.mtp_layers}: megatron's MTP block shifts labels across "
                    "the whole sequence, so it would predict one conversation from another; use mtp.layers=0 or "
                    "data.packing=false")
    if spec_kernels(c.spec).transformer_engine and c.spec.batch.micro != 1:
        yield error(f"data.packing with batch.micro={c.spec.batch.micro} and TransformerEngine's attention: "
                    "megatron's THD packed sequences take one packed sequence per micro-batch; use batch.micro=1")


@rule(scope="runtime")
def runtime_lora(c: Context) -> Iterator[Finding]:
    """finetune.method lora: the recipes' runtime builds the adapters on megatron-core's local
    layers (toolkit.runtime.lora), the HF Trainer through peft (toolkit.hf.lora); Megatron-LM's
    flags have no LoRA."""
    s = c.spec
    if s.finetune.method != "lora":
        return
    if s.target == "megatron-lm":
        yield error("finetune.method=lora with target=megatron-lm: Megatron-LM has no LoRA flags; use target "
                    "recipes (this toolkit's runtime) or hf (the HF Trainer with peft)")
        return
    if s.zero.stage == 3:
        yield error("finetune.method=lora with zero.stage=3: the adapters are added after ZeRO-3 partitions the "
                    "model and have not been run partitioned; use zero.stage 1 or 2 (the frozen base keeps no "
                    "gradients or optimizer states to shard)")
    from ..estimate.lora import adapter_params

    empty = [k for k in range(c.layout.pp) if not adapter_params(c.shape, c.layout, k, s.finetune.lora).dense]
    if empty:
        yield error(f"finetune.lora.targets {list(s.finetune.lora.targets)} give pipeline stage(s) "
                    f"{', '.join(map(str, empty))} no adapter (multi-latent attention has no linear_qkv; a gated "
                    "delta net layer's are in_proj and out_proj; a MoE layer's MLP is experts, which get none): "
                    "DeepSpeed would have nothing to train there")
    if _recipes(c) and spec_kernels(s).transformer_engine:
        yield error("finetune.method=lora with TransformerEngine's layers (attention.backend flash, or auto on a "
                    "GPU): the adapters wrap megatron-core's local ColumnParallelLinear / RowParallelLinear; use "
                    "attention.backend=unfused")


COMPILE_RUNTIMES = {
    "recipes": "this toolkit's runtime builds megatron-core's layers and never calls torch.compile (its "
               "kernels are TransformerEngine's / megatron's fused ones, which the estimate times)",
    "megatron-lm": "the generated Megatron-LM flags do not compile the model (its fused kernels are what the "
                   "estimate times)",
    "hf": "toolkit.hf does not set TrainingArguments.torch_compile, so the Trainer runs transformers' modules "
          "eagerly (compile: false estimates that)",
}


@rule(scope="target")
def compile_runs(c: Context) -> Iterator[Finding]:
    """``compile: true`` is a planning input no target here runs: each target says why."""
    if c.spec.compile:
        yield error(f"compile=true with target {c.spec.target}: {COMPILE_RUNTIMES[c.spec.target]}")
