"""Our model FLOPs per token against Megatron-LM's own count (the one its logs and NeMo's
"Model TFLOP/s/GPU" report): `python tools/megatron_lm_flops.py --megatron-lm PATH`, PATH a
Megatron-LM checkout (the megatron-core wheel has no megatron/training).

Megatron-LM's `num_floating_point_operations(args, batch_size)` is read from PATH's
megatron/training/training.py and run on the args Megatron-LM would get for each model (batch
1, one sequence); nothing of it is copied here. It prints, per model, both counts per token and
the terms ours counts that Megatron-LM's leaves out (the router GEMM, the Qwen2-MoE shared
expert gate, the bias adds, the gate half of a GLU other than SwiGLU) or the reverse (the
MLA and MTP norms, the keys outside a sliding window), whose balance must be zero;
tests/toolkit/estimate/test_time.py::test_flops_are_megatron_lms holds the printed values.
"""
from __future__ import annotations

import argparse
import ast
import sys
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.models import ModelShape, load_model  # noqa: E402
from toolkit.models.params import layer_weights  # noqa: E402
from toolkit.estimate.compute import attended_keys  # noqa: E402
from toolkit.estimate.time import _attention_dims, forward_flops_per_token  # noqa: E402

SEQ = 4096
CASES = [("llama3-70b", 0), ("llama3.1-405b", 0), ("qwen2.5-7b", 0), ("mixtral-8x7b", 0), ("qwen2-57b-a14b", 0),
         ("qwen3-30b-a3b", 0), ("deepseek-v2-lite", 0), ("deepseek-v3", 1), ("qwen3-next-80b-a3b", 0),
         ("qwen3-next-80b-a3b", 1),
         ("gpt-oss-120b", 0), ("gpt-oss-20b", 0)]
GDN = "gated_delta_net"  # megatron-core 0.16.1's name (later Megatron-LM: a deprecated alias it still reads)


def megatron_lm_args(shape: ModelShape, seq: int) -> Namespace:
    """The Megatron-LM args of this model (those its FLOPs count reads); tp 1, so the padded
    vocabulary is the vocabulary rounded up to 128 (--make-vocab-size-divisible-by). GPT-OSS's
    flags (examples/gptoss/02_train.sh) set --quick-geglu, not --swiglu, which is the only flag the
    count reads for the MLP's size, and --window-size / --window-attn-skip-freq, which it does not read."""
    m, a = shape.moe, shape.mla
    args = dict(seq_length=seq, hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
                group_query_attention=a is None and shape.num_query_groups != shape.num_attention_heads,
                kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size, swiglu=shape.activation == "swiglu",
                num_experts=m.num_experts if m else None, moe_layer_freq=[int(x) for x in m.layers] if m else 1,
                moe_router_topk=m.topk if m else 0, moe_ffn_hidden_size=m.ffn_hidden_size if m else None,
                moe_latent_size=None, moe_shared_expert_intermediate_size=(m.shared_ffn_hidden_size or None) if m else None,
                mtp_num_layers=shape.mtp_layers or None, multi_latent_attention=a is not None,
                attention_output_gate=shape.attention_output_gate, experimental_attention_variant=None,
                padded_vocab_size=-(-shape.vocab_size // 128) * 128)
    la = shape.linear_attention
    if la is not None:
        # Megatron-LM's count reads the pattern over the decoder and MTP layers (its length must be
        # num_layers + mtp_num_layers); each MTP layer is built as the last decoder layer's kind
        pattern = [int(x) for x in la.layers] + [int(la.layers[-1])] * shape.mtp_layers
        args.update(experimental_attention_variant=GDN, linear_attention_freq=pattern,
                    linear_key_head_dim=la.key_head_dim, linear_value_head_dim=la.value_head_dim,
                    linear_num_key_heads=la.key_heads, linear_num_value_heads=la.value_heads,
                    linear_conv_kernel_dim=la.conv_kernel)
    if a is not None:
        args.update(q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_nope_head_dim,
                    qk_pos_emb_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim)
    return Namespace(**args)


def load_count(checkout: Path):
    """Megatron-LM's num_floating_point_operations, for GPT models (no Mamba-style hybrid stack;
    gated delta net layers through experimental_attention_variant)."""
    source = (checkout / "megatron/training/training.py").read_text()
    fn = next(n for n in ast.parse(source).body
              if isinstance(n, ast.FunctionDef) and n.name == "num_floating_point_operations")
    scope = {"is_hybrid_model": lambda args: False, "is_linear_attention_variant": lambda v: v == GDN,
             "is_gated_delta_net_variant": lambda v: v == GDN}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(checkout / "megatron/training/training.py"), "exec"),
         scope)
    return scope["num_floating_point_operations"]


def _bias_adds(shape: ModelShape, moe: bool) -> float:
    """Bias adds per token of one layer with add_bias_linear, besides q/k/v's: the output
    projection's, fc1's and fc2's of each expert a token is routed to (or of the dense MLP), and
    the router's (GPT-OSS's router has one)."""
    h, m = shape.hidden_size, shape.moe
    f = m.ffn_hidden_size if moe else shape.ffn_hidden_size
    fc = (2 if shape.gated_mlp else 1) * f + h
    return h + (m.topk * fc + m.num_experts if moe else fc)


def differences(shape: ModelShape) -> dict[str, float]:
    """Training FLOPs per token (3 x forward) ours counts and Megatron-LM's does not (+) or the
    reverse (-)."""
    h, m, a = shape.hidden_size, shape.moe, shape.mla
    layers = [shape.is_moe_layer(i) for i in range(shape.num_layers)] + [shape.is_moe_layer(shape.num_layers - 1)] * shape.mtp_layers
    moe_layers = sum(layers)
    bias = sum(w.numel - w.numel // (h + 1) * h for w in layer_weights(shape, 0) if w.module.endswith("linear_qkv")
               ) if shape.qkv_bias else 0
    gate_half = shape.gated_mlp and shape.activation != "swiglu"  # fc1's gate half: counted for --swiglu only
    mlp = sum(m.ffn_hidden_size * m.topk + (m.shared_ffn_hidden_size or 0) if moe else shape.ffn_hidden_size
              for moe in layers) if m else shape.ffn_hidden_size * len(layers)
    dqk, dv = _attention_dims(shape)
    outside = sum(2 * shape.num_attention_heads * (dqk + dv) * (SEQ / 2 - attended_keys(SEQ, shape.sliding_window))
                  for i in range(shape.num_layers) if shape.is_window_layer(i))
    return {"router": 6 * h * m.num_experts * moe_layers if m else 0.0,
            "other linear biases": 6 * sum(_bias_adds(shape, moe) for moe in layers) if shape.linear_bias else 0.0,
            "GLU gate half": 6 * h * mlp if gate_half else 0.0,
            "keys outside the window": -3 * outside,
            "shared expert gate": 6 * h * moe_layers if m and m.shared_expert_gate else 0.0,
            "qkv bias": 6 * bias * len(layers),
            "MLA norms": -6 * ((a.q_lora_rank or 0) + a.kv_lora_rank) * len(layers) if a else 0.0,
            "MTP norms": -6 * 3 * h * shape.mtp_layers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True, help="a Megatron-LM checkout")
    checkout = parser.parse_args().megatron_lm
    if not (checkout / "megatron/training/training.py").is_file():
        print(f"error: {checkout} is not a Megatron-LM checkout (no megatron/training/training.py)", file=sys.stderr)
        return 2
    count = load_count(checkout)
    for name, mtp in CASES:
        shape = replace(load_model(name), mtp_layers=mtp)
        ours = 3 * forward_flops_per_token(shape, SEQ)[0]
        theirs = count(megatron_lm_args(shape, SEQ), 1) / SEQ
        diff = differences(shape)
        rest = ours - sum(diff.values()) - theirs
        terms = ", ".join(f"{k} {v / 1e6:+.2f}" for k, v in diff.items() if v)
        print(f"{name:17s} mtp {mtp}: ours {ours:,.0f}  Megatron-LM {theirs:,.0f} FLOP/token  "
              f"(ours/theirs {ours / theirs:.5f}; MFLOP: {terms or 'none'}; unexplained {rest:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
