"""The Megatron-LM ``args`` Namespace of a checkpoint <-> (ModelShape, Layout): in one place.

Megatron-LM rebuilds a model from these fields (``load_args_from_checkpoint``,
``core_transformer_config_from_args``); names are Megatron-LM's argument names. Two
extra fields carry what Megatron has no name for: ``hf_architecture`` and ``hf_config``
(the original config.json, so export restores it exactly). Checkpoints written by
Megatron-LM itself lack them; the architecture is then inferred from the flags.
"""
from __future__ import annotations

from argparse import Namespace
from dataclasses import replace
from typing import Any

from toolkit.backends.megatron import MEGATRON_LLAMA3_ROPE, VOCAB_DIVISOR, model_fields, padded_vocab
from toolkit.models import ModelShape, MoEShape, family_of, hf_config_dict, shape_from_hf
from toolkit.models.family import architecture_from_megatron
from toolkit.parallel.layout import Layout

from .dtypes import DType, bfloat16, dtype_of, float16
from .errors import ConversionSetupError, LayoutMismatchError

# TransformerConfig field -> Megatron-LM argument, where the names differ.
ARG_NAMES = {"layernorm_epsilon": "norm_epsilon", "num_moe_experts": "num_experts", "gated_linear_unit": "swiglu",
             "layernorm_zero_centered_gamma": "apply_layernorm_1p"}
DROPPED = ("activation_func", "hidden_dropout", "attention_dropout")  # implied by swiglu / not architecture


def megatron_args(shape: ModelShape, layout: Layout, *, dtype: DType | Any, fmt: str,
                  grouped_gemm: bool = False) -> Namespace:
    """Everything Megatron-LM needs to rebuild this model at this layout. ``params_dtype``
    is a DType, which a checkpoint's pickle stores as the torch.dtype of that name."""
    dtype = dtype_of(dtype)
    d: dict[str, Any] = {ARG_NAMES.get(k, k): v for k, v in model_fields(shape).items() if k not in DROPPED}
    d.update(
        group_query_attention=shape.num_query_groups != shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings, seq_length=shape.max_position_embeddings,
        position_embedding_type="rope", rotary_base=int(shape.rope_theta), rotary_percent=shape.rotary_fraction,
        rotary_interleaved=False, use_rotary_position_embeddings=True, add_position_embedding=False,
        untie_embeddings_and_output_weights=not shape.tie_embeddings, apply_layernorm_1p=shape.zero_centered_norm,
        vocab_size=shape.vocab_size, make_vocab_size_divisible_by=VOCAB_DIVISOR,
        padded_vocab_size=padded_vocab(shape.vocab_size, layout.tp, VOCAB_DIVISOR),
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=(shape.num_layers // (layout.pp * layout.vpp)
                                               if layout.vpp > 1 and not layout.uneven else None),
        **split_args(layout),
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
        params_dtype=dtype, bf16=dtype == bfloat16, fp16=dtype == float16,
        ckpt_format=fmt, use_rope_scaling=False, hf_architecture=shape.architecture,
        hf_config=hf_config_dict(shape),
    )
    r = shape.rope_scaling
    if r and r.get("rope_type", r.get("type")) == "llama3":
        d.update(use_rope_scaling=True, rope_scaling_factor=float(r["factor"]))
    d["swiglu"] = shape.activation == "swiglu"  # Megatron-LM's --swiglu is the silu GLU only (Gemma's is tanh-GELU)
    if shape.mtp_layers:
        d["mtp_num_layers"] = shape.mtp_layers
    if shape.moe is not None:
        d.update(moe_grouped_gemm=grouped_gemm, moe_aux_loss_coeff=shape.moe.aux_loss_coeff,
                 moe_router_load_balancing_type="aux_loss" if shape.moe.aux_loss_coeff > 0 else "none",
                 moe_expert_capacity_factor=None, moe_token_dispatcher_type="alltoall")
    return Namespace(**d)


# Megatron-LM's argument names of megatron's uneven pipeline split (Layout field -> arg)
SPLIT_ARGS = {"first_stage_layers": "decoder_first_pipeline_num_layers",
              "last_stage_layers": "decoder_last_pipeline_num_layers",
              "embedding_in_split": "account_for_embedding_in_pipeline_split",
              "loss_in_split": "account_for_loss_in_pipeline_split"}


def split_args(layout: Layout) -> dict[str, Any]:
    """The split as Megatron-LM records it (--decoder-first-pipeline-num-layers, ...; with
    an uneven split vpp is --num-virtual-stages-per-pipeline-rank, as Megatron-LM requires)."""
    d: dict[str, Any] = {arg: getattr(layout, field) for field, arg in SPLIT_ARGS.items()}
    d["num_virtual_stages_per_pipeline_rank"] = layout.vpp if layout.vpp > 1 and layout.uneven else None
    return d


def layout_from_args(args: Namespace) -> Layout:
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    tp = args.tensor_model_parallel_size
    etp = getattr(args, "expert_tensor_parallel_size", None) if getattr(args, "num_experts", None) else None
    split = {field: getattr(args, arg, None) for field, arg in SPLIT_ARGS.items()}
    split = {k: (bool(v) if k.endswith("_in_split") else v) for k, v in split.items()}
    return Layout(tp=tp, pp=args.pipeline_model_parallel_size, vpp=vpp, ep=ep,
                  etp=None if etp in (None, tp) else etp, **split)


def shape_from_args(args: Namespace | None, hf_config: dict[str, Any] | None = None) -> ModelShape:
    """The model described by a checkpoint's args, or by ``hf_config`` when given (then the
    args, if any, must agree with it)."""
    cfg = hf_config or (getattr(args, "hf_config", None) if args is not None else None)
    if cfg:
        shape = shape_from_hf(cfg)
        if args is not None:
            _check_agrees(shape, args)
            shape = replace(shape, mtp_layers=int(getattr(args, "mtp_num_layers", None) or 0))
        return shape
    if args is None:
        raise ConversionSetupError("the checkpoint has no args and no hf/config.json beside it; pass --hf-config "
                                   "PATH (an HF config.json or a model folder) to describe the model")
    return _shape_from_flags(args)


_CHECKED = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size")


def _check_agrees(shape: ModelShape, args: Namespace) -> None:
    expected = {ARG_NAMES.get(k, k): v for k, v in model_fields(shape).items()}
    for key in _CHECKED:
        got = getattr(args, key, None)
        if got is not None and got != expected[key]:
            raise LayoutMismatchError(f"the HF config says {key}={expected[key]} but the checkpoint args say {got}")


def megatron_features(args: Namespace) -> dict[str, bool]:
    """The architectural switches of a Megatron-LM checkpoint's args, which a family's
    ``megatron_signature`` names (toolkit.models.family.architecture_from_megatron)."""
    return {"mla": bool(getattr(args, "multi_latent_attention", False)),
            "moe": bool(getattr(args, "num_experts", None)),
            "shared_expert": bool(getattr(args, "moe_shared_expert_intermediate_size", None)),
            "qk_norm": bool(getattr(args, "qk_layernorm", False)),
            "qkv_bias": bool(getattr(args, "add_qkv_bias", False)),
            "partial_rope": float(getattr(args, "rotary_percent", 1.0)) < 1.0}


def _infer_architecture(args: Namespace) -> str:
    features = megatron_features(args)
    # the families a signature names are SwiGLU models with plain norms: a checkpoint with other
    # MLPs or (1 + w) norms (Gemma 3, which Megatron-LM's flags cannot describe) is none of them
    plain = getattr(args, "swiglu", True) and not getattr(args, "apply_layernorm_1p", False)
    arch = architecture_from_megatron(features) if plain else None
    if arch is None:
        on = ", ".join(k for k, v in features.items() if v) or "none"
        raise ConversionSetupError(f"the checkpoint's args (switches on: {on}) name no architecture without its HF "
                                   "config; pass --hf-config PATH (an HF config.json or a model folder)")
    return arch


def _rope(args: Namespace) -> dict[str, Any] | None:
    if not getattr(args, "use_rope_scaling", False):
        return None
    return {"rope_type": "llama3", "factor": float(args.rope_scaling_factor), **MEGATRON_LLAMA3_ROPE}


def _shape_from_flags(args: Namespace) -> ModelShape:
    """A Megatron-LM checkpoint without our hf_config: rebuild the shape from its flags."""
    arch = getattr(args, "hf_architecture", None) or _infer_architecture(args)
    family_of(arch)  # unsupported architectures fail here, naming the supported ones
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    vocab = getattr(args, "vocab_size", None) or args.padded_vocab_size
    shape = ModelShape(
        architecture=arch, vocab_size=vocab, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=heads, num_query_groups=groups,
        head_dim=getattr(args, "kv_channels", None) or args.hidden_size // heads,
        ffn_hidden_size=args.ffn_hidden_size, max_position_embeddings=args.max_position_embeddings,
        rope_theta=float(getattr(args, "rotary_base", 10000)), norm_eps=float(args.norm_epsilon),
        rope_scaling=_rope(args), tie_embeddings=not args.untie_embeddings_and_output_weights,
        qkv_bias=bool(getattr(args, "add_qkv_bias", False)), qk_norm=bool(getattr(args, "qk_layernorm", False)),
        moe=_moe_from_flags(args))
    return replace(shape, hf_config=hf_config_dict(shape))


def _moe_from_flags(args: Namespace) -> MoEShape | None:
    n = getattr(args, "num_experts", None)
    if not n:
        return None
    freq = getattr(args, "moe_layer_freq", 1)
    layers = tuple(bool(x) for x in freq) if isinstance(freq, (list, tuple)) else \
        tuple(i % freq == 0 for i in range(args.num_layers))
    return MoEShape(
        num_experts=n, topk=args.moe_router_topk, ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        layers=layers, shared_ffn_hidden_size=getattr(args, "moe_shared_expert_intermediate_size", None) or 0,
        shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
        score_function=getattr(args, "moe_router_score_function", "softmax"),
        pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
        topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
        num_groups=getattr(args, "moe_router_num_groups", None),
        group_topk=getattr(args, "moe_router_group_topk", None),
        expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
        aux_loss_coeff=float(getattr(args, "moe_aux_loss_coeff", 0.0) or 0.0))
