"""Plan -> megatron-core settings: TransformerConfig keyword arguments, GPTModel keyword
arguments, and the equivalent Megatron-LM command-line flags (derived from the same dict).

JSON cannot hold torch objects, so three values are names: params_dtype/pipeline_dtype
("bfloat16") and activation_func ("silu"); ``toolkit.backends.megatron.load_transformer_config``
maps them back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..backends.megatron import NORMS, VOCAB_DIVISOR, model_fields, own_layer_features
from ..kernels import spec_kernels
from ..parallel.precision import PRECISION_DTYPES
from ..parallel.zero import sharded
from .monitor import megatron_monitor_args

if TYPE_CHECKING:  # annotations only: the emitters read a Plan, they never make one
    from ..parallel.layout import Layout
    from ..plan import Plan
    from ..spec import TrainingSpec


def transformer_config_kwargs(plan: Plan) -> dict[str, Any]:
    """TransformerConfig (or MLATransformerConfig) keyword arguments for a plan."""
    spec, lay, shape = plan.spec, plan.layout, plan.shape
    d = model_fields(shape)
    d.update(
        tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp > 1 else None,
        context_parallel_size=lay.cp, expert_model_parallel_size=lay.ep,
        expert_tensor_parallel_size=lay.etp if shape.moe is not None else None,
        sequence_parallel=lay.sequence_parallel, tp_comm_overlap=True if lay.tp_comm_overlap else None,
        overlap_moe_expert_parallel_comm=True if lay.ep_a2a_overlap else None,
        **lay.pipeline(shape.num_layers).megatron_fields(), **_cp_fields(lay),
        bf16=spec.precision == "bf16", fp16=spec.precision == "fp16",
        params_dtype=PRECISION_DTYPES[spec.precision],
        pipeline_dtype=PRECISION_DTYPES[spec.precision] if lay.pp > 1 else None,
    )
    if spec.recompute == "selective":
        d.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif spec.recompute == "full":
        d.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if shape.moe is not None:
        coeff = spec.moe.aux_loss_coeff if spec.moe.aux_loss_coeff is not None else shape.moe.aux_loss_coeff
        d.update(moe_aux_loss_coeff=coeff, moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
                 moe_token_dispatcher_type=spec.moe.token_dispatcher, moe_grouped_gemm=spec.moe.grouped_gemm,
                 moe_router_dtype=spec.moe.router_dtype)
        if shape.moe.expert_bias:
            d["moe_router_bias_update_rate"] = spec.moe.bias_update_rate
        if spec.moe.capacity_factor is not None:
            d.update(moe_expert_capacity_factor=spec.moe.capacity_factor, moe_token_drop_policy="probs",
                     moe_pad_expert_input_to_capacity=spec.moe.pad_to_capacity)
    if spec.cross_entropy_fusion != "none":  # megatron-core's fused loss (LanguageModule.compute_language_model_loss)
        d.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=spec.cross_entropy_fusion)
    if shape.mtp_layers:
        d.update(mtp_num_layers=shape.mtp_layers, mtp_loss_scaling_factor=spec.mtp.loss_scale)
    if shape.sliding_window and shape.sliding_window < plan.batch.seq_len:
        d["window_size"] = [shape.sliding_window - 1, 0]
        if shape.window_layers is not None:  # megatron's list form: 1 = sliding-window layer
            d["window_attn_skip_freq"] = [int(w) for w in shape.window_layers]
    d.update(kernel_fields(plan), **fp8_fields(spec))
    # None is a value for these two (MLATransformerConfig defaults q_lora_rank to 512: V2-Lite has none)
    return {k: v for k, v in d.items() if v is not None or k in ("virtual_pipeline_model_parallel_size", "q_lora_rank")}


def fp8_fields(spec: TrainingSpec) -> dict[str, Any]:
    """megatron-core's FP8 fields of the spec's ``fp8`` section (TransformerEngine's recipe; none when
    off). Megatron-LM reads fp8_param from --fp8-param-gather (arguments.py core_v0.16.1)."""
    f = spec.fp8
    if not f.on:
        return {}
    d: dict[str, Any] = {"fp8": f.format, "fp8_recipe": f.recipe}
    if f.recipe == "delayed":
        d["fp8_amax_history_len"] = f.amax_history_len
    if f.param:
        d["fp8_param"] = True
    if f.bf16_layers:
        d.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=f.bf16_layers,
                 num_layers_at_end_in_bf16=f.bf16_layers)
    return d


def _cp_fields(lay: Layout) -> dict[str, Any]:
    """megatron's cp_comm_type (and the a2a+p2p levels) when context parallelism is on."""
    if lay.cp == 1:
        return {}
    d: dict[str, Any] = {"cp_comm_type": lay.cp_comm}
    if lay.hierarchical_cp:
        d["hierarchical_context_parallel_sizes"] = lay.hierarchical_cp
    return d


def kernel_fields(plan: Plan) -> dict[str, Any]:
    """The layer implementation and fusions of toolkit.kernels (what the memory plan counts):
    TransformerEngine with flash attention, or megatron's local layers; megatron's fused
    SwiGLU on GPUs."""
    k = spec_kernels(plan.spec)
    d: dict[str, Any] = {"transformer_impl": "transformer_engine" if k.transformer_engine else "local",
                         "bias_activation_fusion": k.fused_swiglu and plan.shape.activation == "swiglu"}
    if k.attention == "flash":
        d["attention_backend"] = "flash"
    return d


def layer_spec(plan: Plan) -> dict[str, Any]:
    """The megatron-core layer spec GPTModel is built with, as a function name and its keyword
    arguments (besides the config): megatron's get_gpt_decoder_block_spec, dense or MoE layer
    by layer as the config says, on TransformerEngine's layers exactly where
    ``transformer_impl`` (megatron_config.json, --transformer-impl) says transformer_engine.
    toolkit.mcore.model.block_spec builds the same."""
    te = spec_kernels(plan.spec).transformer_engine
    d = {"function": "megatron.core.models.gpt.gpt_layer_specs.get_gpt_decoder_block_spec",
         "use_transformer_engine": te, "normalization": NORMS[plan.shape.norm]}
    own = own_layer_features(plan.shape)
    if own:  # then rewritten with the toolkit's modules for these features
        d["toolkit_layers"] = {"function": "toolkit.mcore.layers.model_spec", "features": own}
    return d


def gpt_model_kwargs(plan: Plan) -> dict[str, Any]:
    """GPTModel keyword arguments (besides config and layer spec)."""
    shape = plan.shape
    d: dict[str, Any] = dict(
        vocab_size=plan.padded_vocab, max_sequence_length=plan.batch.seq_len,
        position_embedding_type="rope", rotary_base=int(shape.rope_theta), rotary_percent=shape.rotary_fraction,
        share_embeddings_and_output_weights=shape.tie_embeddings,
    )
    r = shape.rope_scaling
    if r and r.get("rope_type", r.get("type")) == "llama3":
        d.update(rope_scaling=True, rope_scaling_factor=float(r["factor"]))
    if r and r.get("rope_type", r.get("type")) == "linear":
        d["seq_len_interpolation_factor"] = float(r["factor"])
    if "yarn_rotary_scaling_factor" in model_fields(shape):  # non-MLA yarn: GPTModel's YarnRotaryEmbedding
        d["position_embedding_type"] = "yarn"
    return d


# ---------------------------------------------------------------------------- Megatron-LM flags
# TransformerConfig field -> Megatron-LM flag where the names differ; others are --field-name.
_FLAG_NAMES = {
    "num_moe_experts": "--num-experts", "layernorm_epsilon": "--norm-epsilon",
    "virtual_pipeline_model_parallel_size": None,  # given as --num-virtual-stages-per-pipeline-rank
    "gated_linear_unit": None, "activation_func": None, "add_bias_linear": None,  # --swiglu, --disable-bias-linear
    "params_dtype": None, "pipeline_dtype": None, "bf16": "--bf16", "fp16": "--fp16",
    "fp8": "--fp8-format", "fp8_param": "--fp8-param-gather",
    "moe_router_dtype": "--moe-router-dtype", "num_query_groups": "--num-query-groups",
    "layernorm_zero_centered_gamma": "--apply-layernorm-1p", "softmax_scale": None, "window_attn_skip_freq": None,
    "moe_aux_loss_coeff": "--moe-aux-loss-coeff", "window_size": None, "multi_latent_attention": "--multi-latent-attention",
    "rope_type": None, "rotary_base": None, "hidden_dropout": "--hidden-dropout",
    "bias_activation_fusion": None,  # Megatron-LM fuses by default; --no-bias-swiglu-fusion turns it off
    # yarn settings Megatron-LM 0.16 has no flag for: MLATransformerConfig's defaults apply
    # (megatron_lm_problem refuses other values for target megatron-lm)
    "beta_fast": None, "beta_slow": None, "original_max_position_embeddings": None,
    "num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
    "num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
}


def _flag(field: str, value: Any) -> list[str]:
    name = _FLAG_NAMES.get(field, "--" + field.replace("_", "-"))
    if name is None or value is None:
        return []
    if isinstance(value, bool):
        return [name] if value else []
    if isinstance(value, list):
        listed = field in ("moe_layer_freq", "linear_attention_freq")  # Megatron-LM evaluates these as a Python list
        return [name, "[" + ",".join(str(v) for v in value) + "]"] if listed else [name, *map(str, value)]
    return [name, str(value)]


def megatron_lm_args(plan: Plan) -> list[str]:
    """Megatron-LM pretrain_gpt.py flags equivalent to the generated settings."""
    spec, lay, shape, b = plan.spec, plan.layout, plan.shape, plan.batch
    tc = transformer_config_kwargs(plan)
    args: list[str] = []
    for k, v in tc.items():
        args += _flag(k, v)
    args += ["--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
             "--rotary-base", str(int(shape.rope_theta)), "--seq-length", str(b.seq_len),
             "--max-position-embeddings", str(shape.max_position_embeddings),
             "--micro-batch-size", str(b.micro), "--global-batch-size", str(b.global_),
             "--make-vocab-size-divisible-by", str(VOCAB_DIVISOR), "--vocab-size", str(shape.vocab_size)]
    if shape.num_query_groups != shape.num_attention_heads:
        args.append("--group-query-attention")
    if not shape.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    gm = gpt_model_kwargs(plan)
    if gm.get("rope_scaling"):
        args += ["--use-rope-scaling", "--rope-scaling-factor", str(gm["rope_scaling_factor"])]
    if lay.vpp > 1:  # the form Megatron-LM accepts with uneven first/last stages too
        args += ["--num-virtual-stages-per-pipeline-rank", str(lay.vpp)]
    if "window_size" in tc:
        args += ["--window-size", ",".join(str(v) for v in tc["window_size"])]  # Megatron-LM's tuple_type
    if not tc["bias_activation_fusion"]:
        args.append("--no-bias-swiglu-fusion")
    o = spec.optimizer
    args += ["--optimizer", "adam", "--lr", str(o.lr), "--min-lr", str(o.min_lr), "--lr-decay-style", o.decay,
             "--lr-warmup-iters", str(o.warmup_steps), "--weight-decay", str(o.weight_decay),
             "--adam-beta1", str(o.betas[0]), "--adam-beta2", str(o.betas[1]), "--adam-eps", str(o.eps),
             "--clip-grad", str(o.clip_grad), "--train-iters", str(spec.train.steps), "--seed", str(spec.train.seed),
             "--log-interval", str(spec.train.log_interval), "--save-interval", str(spec.train.save_interval),
             "--save", spec.train.save_dir]
    args.append("--overlap-grad-reduce")  # gradient reduction per bucket during backward (the plan's time assumes it)
    if sharded(spec.zero.stage, "optimizer"):  # ZeRO-1: its distributed optimizer; gathers during the next forward
        args += ["--use-distributed-optimizer", "--overlap-param-gather"]
    if o.grad_reduce_dtype == "bf16":  # else Megatron-LM's bf16 default: an fp32 gradient buffer (the plan counts it)
        args.append("--grad-reduce-in-bf16")
    if spec.train.data_path:
        args += ["--data-path", spec.train.data_path]
    if spec.train.tokenizer:
        args += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", spec.train.tokenizer]
    return args + megatron_monitor_args(spec)
