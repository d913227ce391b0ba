"""The activation estimate against what autograd really keeps in megatron-core's layers.

The runtime's own model build (toolkit.mcore.model, the CPU kernels of toolkit.kernels) is
run forward once with ``torch.autograd.graph.saved_tensors_hooks``; the bytes of the distinct
storages saved for backward (parameters excluded), difference of a 2-layer and a 1-layer model,
are one layer's activations. toolkit.estimate.activations must give the same number. On GPUs the
fused RMSNorm and SwiGLU kernels keep less (see toolkit.kernels); that part is not measured
here (no GPU).
"""
import json

import pytest
import torch

from toolkit.kernels import Kernels, kernels
from toolkit.models import shape_from_hf
from toolkit.plan import make_plan
from toolkit.estimate.activations import layer_activation_bytes
from toolkit.spec import TrainingSpec


SEQ, MICRO = 128, 2


def _config(tmp_path, layers: int, groups: int, dropout: float = 0.0) -> str:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": layers, "num_attention_heads": 8,
           "num_key_value_heads": groups, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_dropout": dropout}
    folder = tmp_path / f"m{layers}_{groups}_{dropout}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _plan(model: str, precision: str, recompute: str, **sections):
    """One rank on CPU, unfused attention; ``sections``: more spec sections (moe, mtp)."""
    return make_plan(TrainingSpec.from_dict({
        "model": model, "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"}, "zero": {"stage": 1},
        "precision": precision, "recompute": recompute, "attention": {"backend": "unfused"},
        "batch": {"micro": MICRO, "global": MICRO, "seq_len": SEQ}, "train": {"steps": 2}, **sections}))


def _saved_bytes(plan) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps after one forward."""
    from toolkit.mcore import cpu_compat
    from toolkit.runtime.model import build_model_chunks

    model = build_model_chunks(plan)[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    tokens = torch.randint(0, 128, (MICRO, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, torch.arange(SEQ).expand(MICRO, SEQ), cpu_compat.causal_mask(SEQ), labels=tokens)
    del out
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("groups", [2, 8])  # GQA (k, v expanded) and MHA (v keeps the fused qkv output)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])  # attention dropout keeps its mask and the dropped probabilities
def test_estimate_is_what_autograd_keeps(tmp_path, megatron_one_rank, precision, groups, recompute, dropout):
    one, two = (_plan(_config(tmp_path, n, groups, dropout), precision, recompute) for n in (1, 2))
    measured = (_saved_bytes(two) - _saved_bytes(one)) / (MICRO * SEQ)
    k = kernels("cpu", "unfused")
    estimate = layer_activation_bytes(two.shape, 0, tokens=1, seq=SEQ, layout=two.layout, recompute=recompute,
                                      kernels=k, act_bytes=4 if precision == "fp32" else 2)
    w, d = (4 if precision == "fp32" else 2), two.shape.head_dim
    rope = 0 if recompute == "full" else 4 * d * w / MICRO  # cos, sin for q and k per position (not estimated)
    print(f"{precision} groups={groups} recompute={recompute} dropout={dropout}: "
          f"measured {measured:.1f} B/token/layer, "
          f"estimate {estimate:.1f} + rope {rope:.1f}")
    assert estimate + rope == pytest.approx(measured, rel=1e-3)


def test_gpu_kernels_keep_less():
    """On CUDA the same model keeps the fused kernels' inputs only (not measured here)."""
    shape = shape_from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
                           "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                           "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512,
                           "rms_norm_eps": 1e-5, "rope_theta": 10000.0})
    from tests.toolkit.estimate.test_memory import _layout

    kw = dict(tokens=1, seq=SEQ, layout=_layout(), recompute="none", act_bytes=2)
    cpu = layer_activation_bytes(shape, 0, kernels=kernels("cpu", "unfused"), **kw)
    gpu = layer_activation_bytes(shape, 0, kernels=kernels("h100-80gb", "unfused"), **kw)
    h, f = 256, 512
    assert cpu - gpu == 2 * (8 * h - 2 * h) + 2 * 2 * f  # two norms' fp32 copies; SwiGLU 5 vs 3 tensors
    from dataclasses import replace

    dropped = replace(shape, attention_dropout=0.1)  # CUDA's fused dropout keeps a bool mask, CPU's the bf16 noise
    gap = (layer_activation_bytes(dropped, 0, kernels=kernels("cpu", "unfused"), **kw)
           - layer_activation_bytes(dropped, 0, kernels=kernels("h100-80gb", "unfused"), **kw))
    assert gap - (cpu - gpu) == (2 - 1) * 8 * SEQ
    assert kernels("h100-80gb", "flash") == Kernels(True, "flash", True, True, True)


MOE_CONFIGS = {  # hidden 256 so that per-token terms dominate; router aux loss off (one MoE layer)
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": 384,
                "num_attention_heads": 8, "num_key_value_heads": 2, "num_local_experts": 4,
                "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "intermediate_size": 512,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.0,
                  "use_sliding_window": False},
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "intermediate_size": 512,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 64,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
                    "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                    "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_method": "greedy",
                    "norm_topk_prob": False, "aux_loss_alpha": 0.0},
    # sinks, biases, clamped GLU; a window of 32 < SEQ on every layer ("sliding") or on none ("full")
    "gpt_oss sliding": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "intermediate_size": 128,
                        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 4,
                        "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0, "sliding_window": 32,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}},
}
MOE_CONFIGS["gpt_oss full"] = dict(MOE_CONFIGS["gpt_oss sliding"])


def _moe_config(tmp_path, name: str, layers: int) -> str:
    cfg = {"vocab_size": 128, "hidden_size": 256, "num_hidden_layers": layers, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, **MOE_CONFIGS[name]}
    if name.startswith("gpt_oss"):
        cfg["layer_types"] = [name.split()[1] + "_attention"] * layers
    folder = tmp_path / f"{name.replace(' ', '_')}{layers}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


# dropless; megatron's drop-and-pad ("token drop" in NeMo's recipes) at capacity 1, 2 and 0.5:
# every expert computes exactly ceil(c x 256 x 2 / 4) slots, c x the dropless count; a shared
# expert with a sigmoid gate (Qwen2-MoE) and one without, beside multi-latent attention (DeepSeek-V2)
@pytest.mark.parametrize("model,moe", [("mixtral", {}), ("mixtral", {"capacity_factor": 1.0, "pad_to_capacity": True}),
                                       ("mixtral", {"capacity_factor": 2.0, "pad_to_capacity": True}),
                                       ("mixtral", {"capacity_factor": 0.5, "pad_to_capacity": True}),
                                       ("qwen2_moe", {}), ("deepseek_v2", {}), ("gpt_oss sliding", {}),
                                       ("gpt_oss full", {})])
def test_moe_estimate_is_what_autograd_keeps(tmp_path, megatron_one_rank, model, moe):
    """A MoE layer (4 experts, top-2) through the runtime's megatron-core build (allgather
    dispatcher, as on CPU): the routed slots the capacity settings leave or pad to, each the
    expert's input and its SwiGLU; shared experts. Left out of the estimate: the dispatcher's
    index and probability bookkeeping, tens of bytes per token (< 0.5% here)."""
    from toolkit.estimate.memory import activation_settings

    one, two = (_plan(_moe_config(tmp_path, model, n), "fp32", "none", moe={"token_dispatcher": "allgather", **moe})
                for n in (1, 2))
    assert two.valid, two.errors
    assert all(two.shape.is_moe_layer(i) for i in range(2))
    measured = (_saved_bytes(two) - _saved_bytes(one)) / (MICRO * SEQ)
    estimate = layer_activation_bytes(two.shape, 0, tokens=1, seq=SEQ, layout=two.layout, recompute="none",
                                      **activation_settings(two.spec))
    rotary = two.shape.mla.qk_rope_head_dim if two.shape.mla else two.shape.head_dim
    rope = 4 * rotary * 4 / MICRO
    rope += SEQ / MICRO if model == "gpt_oss sliding" else 0  # the window's [s, s] bool mask (not estimated)
    print(f"{model} {moe}: measured {measured:.1f} B/token/layer, estimate {estimate:.1f} + rope {rope:.1f}")
    assert estimate + rope == pytest.approx(measured, rel=5e-3)
    # and it trains: a backward pass reaches every expert
    from toolkit.mcore import cpu_compat
    from toolkit.runtime.model import build_model_chunks

    gpt = build_model_chunks(two)[0]
    tokens = torch.randint(0, 128, (MICRO, SEQ))
    gpt(tokens, torch.arange(SEQ).expand(MICRO, SEQ), cpu_compat.causal_mask(SEQ), labels=tokens).sum().backward()
    experts = [p for n, p in gpt.named_parameters() if ".experts." in n]
    assert experts and all(p.main_grad.abs().sum() > 0 if hasattr(p, "main_grad") else p.grad.abs().sum() > 0
                           for p in experts)


def test_mtp_module_is_what_autograd_keeps(tmp_path, megatron_one_rank):
    """A DeepSeek-V3-shaped model with and without one multi-token prediction module (megatron-
    core's MTP block on the runtime's build): the difference is the module's decoder layer, its
    norms and projection inputs and its logits, as the last stage's estimate counts them."""
    from toolkit.models import named_models
    from toolkit.estimate.memory import activation_settings, stage_activations

    cfg = {**named_models()["deepseek-v3-tiny"]["config"], "num_hidden_layers": 2, "hidden_size": 256,
           "vocab_size": 128, "kv_lora_rank": 64, "q_lora_rank": 64, "moe_intermediate_size": 128,
           "intermediate_size": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def plan(mtp):
        return _plan(str(tmp_path), "fp32", "none", moe={"token_dispatcher": "allgather"}, mtp={"layers": mtp})

    def estimate(p):
        a = stage_activations(p.shape, p.layout, 0, seq=SEQ, recompute="none", **activation_settings(p.spec))
        return a.stored + a.edge

    without, with_mtp = plan(0), plan(1)
    assert with_mtp.valid and with_mtp.shape.mtp_layers == 1, with_mtp.errors
    measured = (_saved_bytes(with_mtp) - _saved_bytes(without)) / (MICRO * SEQ)
    estimated = estimate(with_mtp) - estimate(without)
    print(f"MTP module: measured {measured:.1f} B/token, estimate {estimated:.1f}")
    assert estimated == pytest.approx(measured, rel=5e-3)


def _gemma_config(tmp_path, layers: int) -> str:
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "sliding_window": 32,
           "query_pre_attn_scalar": 32}
    folder = tmp_path / f"gemma{layers}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_post_norms_keep_what_the_estimate_adds(tmp_path, megatron_one_rank, precision):
    """Gemma 3's norms after attention and after the MLP (toolkit.mcore.layers' post-normed linear
    layers, (1 + w) RMSNorm on CPU): what autograd saves inside each of them, per token, is the
    norm term the estimate adds for it (plus the layer's (1 + w) vector, h fp32 numbers per norm,
    not per token)."""
    from dataclasses import replace

    from toolkit.estimate.activations import _norm
    from toolkit.mcore import cpu_compat
    from toolkit.runtime.model import build_model_chunks

    plan = _plan(_gemma_config(tmp_path, 1), precision, "none")
    model = build_model_chunks(plan)[0]
    posts = {name: m for name, m in model.named_modules() if name.endswith("post_layernorm")}
    assert len(posts) == 2
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, seen = [None], {}
    for name, m in posts.items():
        m.register_forward_pre_hook(lambda mod, a, name=name: inside.__setitem__(0, name))
        m.register_forward_hook(lambda mod, a, o: inside.__setitem__(0, None))

    def pack(t):
        st = t.untyped_storage()
        if inside[0] and st.data_ptr() not in params:
            seen.setdefault(inside[0], {})[st.data_ptr()] = st.nbytes()
        return t

    tokens = torch.randint(0, 128, (MICRO, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, torch.arange(SEQ).expand(MICRO, SEQ), cpu_compat.causal_mask(SEQ), labels=tokens)
    h, w = 256, 4 if precision == "fp32" else 2
    for name in posts:
        per_token = (sum(seen[name].values()) - 4 * h) / (MICRO * SEQ)
        assert per_token == _norm(h, w, kernels("cpu", "unfused")), name
    one = layer_activation_bytes(plan.shape, 0, tokens=1, seq=SEQ, layout=plan.layout, recompute="none",
                                 kernels=kernels("cpu", "unfused"), act_bytes=w)
    without = layer_activation_bytes(replace(plan.shape, post_norms=False), 0, tokens=1, seq=SEQ, layout=plan.layout,
                                     recompute="none", kernels=kernels("cpu", "unfused"), act_bytes=w)
    assert one - without == 2 * _norm(h, w, kernels("cpu", "unfused"))
