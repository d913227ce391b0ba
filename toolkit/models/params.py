"""Parameter tables and counts, from a ModelShape alone.

Each weight is listed once with how Megatron shards it:
  "tp"     column- or row-parallel over tensor parallel ranks
  "vocab"  vocab-parallel over tp (embedding, output layer); padded in Megatron
  "rep"    replicated on every tp rank (norms, router, MLA down-projections)
  "expert" one routed expert's weight: experts split over ep, each over etp
Counts use the HF (unpadded) vocabulary, so they equal the published numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

from .shape import ModelShape


@dataclass(frozen=True)
class Weight:
    module: str  # Megatron module path without the layer prefix, e.g. "mlp.linear_fc1"
    numel: int
    split: str  # tp | vocab | rep | expert
    count: int = 1  # how many such tensors (routed experts)
    parts: tuple[int, ...] = ()  # the module's tensors (weight, bias, ...) when it holds more than one

    @property
    def total(self) -> int:
        return self.numel * self.count


def _bias(s: ModelShape, n: int) -> int:
    """A linear layer's bias (megatron's add_bias_linear: every linear layer has one)."""
    return n if s.linear_bias else 0


def attention_weights(s: ModelShape, layer: int = 0) -> list[Weight]:
    h = s.hidden_size
    if s.mla is not None:
        return _mla_weights(s)
    if s.is_linear_attention_layer(layer):
        return _gated_delta_net_weights(s)
    q, kv = s.num_attention_heads * s.head_dim, s.num_query_groups * s.head_dim
    qkv = q * (2 if s.attention_output_gate else 1) + 2 * kv  # the output gate is projected with q
    ws = [
        Weight("input_layernorm", h, "rep"),
        Weight("self_attention.linear_qkv", h * qkv + (qkv if s.qkv_bias or s.linear_bias else 0), "tp"),
        Weight("self_attention.linear_proj", q * h + _bias(s, h), "tp"),
    ]
    if s.attention_sinks:  # one learned logit per head (megatron's softmax_offset, split with the heads)
        ws.append(Weight("self_attention.core_attention.softmax_offset", s.num_attention_heads, "tp"))
    if s.qk_norm:
        ws += [Weight("self_attention.q_layernorm", s.head_dim, "rep"),
               Weight("self_attention.k_layernorm", s.head_dim, "rep")]
    if s.post_norms:
        ws.append(Weight("self_attention.linear_proj.post_layernorm", h, "rep"))
    return ws


def _gated_delta_net_weights(s: ModelShape) -> list[Weight]:
    """megatron-core's GatedDeltaNet (ssm/gated_delta_net.py): in_proj (q, k, v, z, b, a rows),
    the depthwise conv1d over q, k, v (no bias), A_log and dt_bias per value head, the gated
    RMSNorm over a value head's channels (shared by the heads, replicated) and out_proj; all
    but the norm split over tp by heads."""
    la, h = s.linear_attention, s.hidden_size
    return [Weight("input_layernorm", h, "rep"),
            Weight("self_attention.in_proj", h * la.in_proj_dim + _bias(s, la.in_proj_dim), "tp"),
            Weight("self_attention.conv1d", la.conv_dim * la.conv_kernel, "tp"),
            Weight("self_attention.A_log", la.value_heads, "tp"),
            Weight("self_attention.dt_bias", la.value_heads, "tp"),
            Weight("self_attention.out_norm", la.value_head_dim, "rep"),
            Weight("self_attention.out_proj", la.v_dim * h + _bias(s, h), "tp")]


def _mla_weights(s: ModelShape) -> list[Weight]:
    m, h, a = s.mla, s.hidden_size, s.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    ws = [Weight("input_layernorm", h, "rep")]
    if m.q_lora_rank:
        ws += [Weight("self_attention.linear_q_down_proj", h * m.q_lora_rank, "rep"),
               Weight("self_attention.q_layernorm", m.q_lora_rank, "rep"),
               Weight("self_attention.linear_q_up_proj", m.q_lora_rank * a * qk, "tp")]
    else:
        ws.append(Weight("self_attention.linear_q_proj", h * a * qk, "tp"))
    ws += [Weight("self_attention.linear_kv_down_proj", h * (m.kv_lora_rank + m.qk_rope_head_dim), "rep"),
           Weight("self_attention.kv_layernorm", m.kv_lora_rank, "rep"),
           Weight("self_attention.linear_kv_up_proj",
                  m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim), "tp"),
           Weight("self_attention.linear_proj", a * m.v_head_dim * h, "tp")]
    return ws


def _fc1(s: ModelShape) -> int:
    """fc1's width in units of the ffn size: a gated MLP's holds gate and up."""
    return 2 if s.gated_mlp else 1


def mlp_weights(s: ModelShape, layer: int) -> list[Weight]:
    h = s.hidden_size
    ws = [Weight("pre_mlp_layernorm", h, "rep")]
    if not s.is_moe_layer(layer):
        f = s.ffn_hidden_size
        ws += [Weight("mlp.linear_fc1", _fc1(s) * f * (h + _bias(s, 1)), "tp"),
               Weight("mlp.linear_fc2", f * h + _bias(s, h), "tp")]
        return ws + ([Weight("mlp.linear_fc2.post_layernorm", h, "rep")] if s.post_norms else [])
    m, f = s.moe, s.moe.ffn_hidden_size
    ws += [Weight("mlp.router", m.num_experts * h + _bias(s, m.num_experts), "rep"),
           Weight("mlp.experts.linear_fc1", _fc1(s) * f * (h + _bias(s, 1)), "expert", m.num_experts),
           Weight("mlp.experts.linear_fc2", f * h + _bias(s, h), "expert", m.num_experts)]
    if m.shared_ffn_hidden_size:
        f = m.shared_ffn_hidden_size
        ws += [Weight("mlp.shared_experts.linear_fc1", _fc1(s) * f * (h + _bias(s, 1)), "tp"),
               Weight("mlp.shared_experts.linear_fc2", f * h + _bias(s, h), "tp")]
        if m.shared_expert_gate:
            ws.append(Weight("mlp.shared_experts.gate_weight", h, "rep"))
    return ws


def layer_weights(s: ModelShape, layer: int) -> list[Weight]:
    return attention_weights(s, layer) + mlp_weights(s, layer)


# ---------------------------------------------------------------------------- transformers' modules
def _linear(name: str, rows: int, cols: int, bias: bool, split: str = "tp", count: int = 1) -> Weight:
    """An nn.Linear: its weight and, with a bias, its bias (two tensors of one module)."""
    return Weight(name, rows * cols + (rows if bias else 0), split, count, (rows * cols, rows) if bias else ())


def hf_layer_weights(s: ModelShape, layer: int, experts: str = "fused") -> list[Weight]:
    """One decoder layer as transformers' model holds it, in the order its forward runs them: a
    Weight per module holding parameters, its tensors in ``parts``. What DeepSpeed ZeRO-3 sees
    under the HF Trainer: it gathers a module's parameters at once, whole tensors, and runs its
    hooks per module. Megatron-core's fused linear_qkv is q_proj, k_proj and v_proj here, a gated
    linear_fc1 gate_proj and up_proj, a delta net's in_proj in_proj_qkvz and in_proj_ba (its A_log
    and dt_bias held by the attention module itself, as are attention sinks). Routed experts:
    ``fused`` = one module per layer holding every expert's gate_up_proj and down_proj (and their
    biases), as transformers 5 builds every MoE family; ``modules`` = a Linear module per expert
    weight, as transformers 4.x did (Mixtral's w1, w3, w2). Every other weight is one module
    as in layer_weights. The order is transformers' forward's (tests/toolkit/models/test_hf_modules.py
    records it in transformers' own models): a module's own parameters (sinks, a delta net's A_log and
    dt_bias) as it is entered, before its children; the qk norms and shared experts where the family's
    ``hf_forward`` puts them."""
    from .family import family_of

    return _hf_order(_hf_modules(s, layer, experts), family_of(s.architecture).hf_forward)


def _hf_order(ws: list[Weight], forward: dict[str, str]) -> list[Weight]:
    names = [w.module for w in ws]
    first = [w for w in ws if w.module in ("self_attention.core_attention.softmax_offset", "linear_attn")]
    norms = [w for w in ws if w.module in ("self_attention.q_layernorm", "self_attention.k_layernorm")
             and "self_attn.q_proj" in names]  # not MLA's q_layernorm, between its down and up projections
    shared = [w for w in ws if w.module.startswith("mlp.shared_experts.") and "gate_weight" not in w.module]
    out = [w for w in ws if w not in first + norms + shared]
    out[1:1] = first  # after input_layernorm
    if norms and forward.get("qk_norm") == "each":  # q_proj, q_norm, k_proj, k_norm, v_proj
        for proj, norm in zip(("self_attn.q_proj", "self_attn.k_proj"), norms):
            at = [w.module for w in out].index(proj) + 1
            out[at:at] = [norm]
    elif norms:
        at = [w.module for w in out].index("self_attn.v_proj") + 1
        out[at:at] = norms
    if shared:
        modules = [w.module for w in out]
        if forward.get("shared_experts") == "first":
            at = modules.index("mlp.router")
        else:
            at = modules.index("mlp.shared_experts.gate_weight") if "mlp.shared_experts.gate_weight" in modules \
                else len(out)
        out[at:at] = shared
    return out


def _hf_modules(s: ModelShape, layer: int, experts: str) -> list[Weight]:
    h, bias = s.hidden_size, s.linear_bias
    out, megatron = [], layer_weights(s, layer)
    for w in megatron:
        name = w.module
        if name == "self_attention.linear_qkv":
            q, kv = s.num_attention_heads * s.head_dim, s.num_query_groups * s.head_dim
            qkv_bias = s.qkv_bias or bias
            out += [_linear("self_attn.q_proj", q * (2 if s.attention_output_gate else 1), h, qkv_bias),
                    _linear("self_attn.k_proj", kv, h, qkv_bias), _linear("self_attn.v_proj", kv, h, qkv_bias)]
        elif name == "self_attention.in_proj":
            la = s.linear_attention
            out += [_linear("linear_attn.in_proj_qkvz", la.in_proj_dim - 2 * la.value_heads, h, bias),
                    _linear("linear_attn.in_proj_ba", 2 * la.value_heads, h, bias)]
        elif name == "self_attention.A_log":  # A_log and dt_bias: parameters of the delta net module itself
            out.append(Weight("linear_attn", 2 * w.numel, "tp", parts=(w.numel, w.numel)))
        elif name == "self_attention.dt_bias":
            continue
        elif name.endswith("linear_fc1") and s.gated_mlp and w.split != "expert":
            f = (s.moe.shared_ffn_hidden_size if "shared_experts" in name else s.ffn_hidden_size)
            prefix = name[:-len("linear_fc1")]
            out += [_linear(prefix + "gate_proj", f, h, bias), _linear(prefix + "up_proj", f, h, bias)]
        elif name == "mlp.experts.linear_fc1":
            fc2 = next(x for x in megatron if x.module == "mlp.experts.linear_fc2")
            f, rows = s.moe.ffn_hidden_size, w.numel // (h + (1 if bias else 0))
            if experts == "fused":  # gate_up_proj (and its bias), down_proj (and its bias): every expert's
                tensors = ((rows * h, rows * bias), (f * h, h * bias))
                parts = tuple(w.count * n for pair in tensors for n in pair if n)
                out.append(Weight("mlp.experts", w.total + fc2.total, "expert", 1, parts))
            else:
                out += ([_linear("mlp.experts.gate_proj", f, h, bias, "expert", w.count),
                         _linear("mlp.experts.up_proj", f, h, bias, "expert", w.count)] if s.gated_mlp else
                        [_linear("mlp.experts.up_proj", f, h, bias, "expert", w.count)])
                out.append(_linear("mlp.experts.down_proj", h, f, bias, "expert", w.count))
        elif name == "mlp.experts.linear_fc2":
            continue
        elif name in ("self_attention.linear_proj", "mlp.linear_fc2", "mlp.shared_experts.linear_fc2",
                      "self_attention.out_proj", "mlp.router") and bias:
            rows = h if name != "mlp.router" else s.moe.num_experts
            out.append(_linear(name, rows, w.numel // rows - 1, True))
        elif name.endswith("linear_fc1") and bias:  # an ungated MLP's fc1
            out.append(_linear(name, w.numel // (h + 1), h, True))
        else:
            out.append(w)
    return out


def embedding_weights(s: ModelShape, vocab: int | None = None) -> list[Weight]:
    return [Weight("embedding.word_embeddings", (vocab or s.vocab_size) * s.hidden_size, "vocab")]


def head_weights(s: ModelShape, vocab: int | None = None) -> list[Weight]:
    """Final norm and (untied) output layer, on the last pipeline stage."""
    ws = [Weight("decoder.final_layernorm", s.hidden_size, "rep")]
    if not s.tie_embeddings:
        ws.append(Weight("output_layer", (vocab or s.vocab_size) * s.hidden_size, "vocab"))
    return ws


def total_params(s: ModelShape) -> int:
    """All parameters, tied embeddings counted once (the published number)."""
    n = sum(w.total for w in embedding_weights(s) + head_weights(s))
    return n + sum(w.total for i in range(s.num_layers) for w in layer_weights(s, i))


def active_params(s: ModelShape) -> int:
    """Parameters a token passes through (routed experts: top-k of them)."""
    n = total_params(s)
    if s.moe is None:
        return n
    per_expert = sum(w.numel for w in mlp_weights(s, s.moe.layers.index(True)) if w.split == "expert")
    return n - s.moe.num_moe_layers * (s.moe.num_experts - s.moe.topk) * per_expert


def largest_module_params(s: ModelShape, vocab: int | None = None) -> int:
    """Largest single module (the unit DeepSpeed ZeRO-3 gathers at once)."""
    ws = embedding_weights(s, vocab) + head_weights(s, vocab)
    ws += [w for i in range(s.num_layers) for w in layer_weights(s, i)]
    return max(w.numel for w in ws)


def lora_weights(s: ModelShape, layer: int, rank: int, targets: tuple[str, ...], shared_a: bool = True) -> list[Weight]:
    """The LoRA adapters of one decoder layer (toolkit.runtime.lora), two halves per target as
    the runtime splits them: a column-parallel layer's A [rank, in] replicated and B [out, rank]
    split over tp; a row-parallel layer's A split over tp and B replicated. Targets the layer
    does not have (linear_qkv under multi-latent attention or in a gated delta net layer, whose
    in_proj and out_proj are its own; the MLP's of a MoE layer) get none. ``shared_a`` False: peft
    on the HF modules (toolkit.hf.lora), where q, k, v (gate, up; in_proj_qkvz, in_proj_ba) each
    have their own A."""
    h = s.hidden_size
    v = s.mla.v_head_dim if s.mla is not None else s.head_dim
    q, kv = s.num_attention_heads * s.head_dim, s.num_query_groups * s.head_dim
    dense, la = not s.is_moe_layer(layer), s.linear_attention
    linear = s.is_linear_attention_layer(layer)
    shapes = {"linear_qkv": (h, q * (2 if s.attention_output_gate else 1) + 2 * kv, "column")
              if s.mla is None and not linear else None,
              "linear_proj": (s.num_attention_heads * v, h, "row") if not linear else None,
              "in_proj": (h, la.in_proj_dim, "column") if linear else None,
              "out_proj": (la.v_dim, h, "row") if linear else None,
              "linear_fc1": (h, _fc1(s) * s.ffn_hidden_size, "column") if dense else None,
              "linear_fc2": (s.ffn_hidden_size, h, "row") if dense else None}
    ws = []
    for name in targets:
        if shapes.get(name) is None:
            continue
        n_in, n_out, kind = shapes[name]
        a, b = ("rep", "tp") if kind == "column" else ("tp", "rep")
        parts = 1 if shared_a else {"linear_qkv": 3, "linear_fc1": _fc1(s), "in_proj": 2}.get(name, 1)
        ws += [Weight(f"{name}.lora_A", parts * rank * n_in, a), Weight(f"{name}.lora_B", rank * n_out, b)]
    return ws
