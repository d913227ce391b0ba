"""recompute op (torchtitan's per-op checkpointing) against torch's own selective checkpointing.

torchtitan's policy (torchtitan 9dec370, torchtitan/parallelisms/parallelize_llama.py
``_apply_ac_to_transformer_block``, ``selective_ac_option = 'op'``), replayed here with
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` on transformers' own
LlamaDecoderLayer: the outputs of ``aten.mm`` and of scaled-dot-product attention are saved, except
every second ``mm`` of a block's forward (a fresh counter per block call), and everything else is
recomputed. On CPU, SDPA dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, which
stands in the save list for the CUDA flash kernel torchtitan names.

- FLOPs: torch's FlopCounterMode over forward + backward, checkpointed minus not, is exactly what
  compute.op_recompute_gemms says is run again (wk, wo, w3), and the planner's hardware FLOPs
  (time.step_flops) add exactly that per layer;
- memory: the layer input plus the outputs the policy saves (read from torch's own
  SelectiveCheckpointContext.op_output) are activations.layer_activation_bytes(recompute="op").
"""
from collections import defaultdict

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from toolkit.estimate import compute as C
from toolkit.estimate.activations import layer_activation_bytes
from toolkit.estimate.time import step_flops
from toolkit.kernels import Kernels
from toolkit.models import shape_from_hf
from toolkit.parallel.layout import BatchPlan, Layout
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

MICRO, SEQ = 2, 64
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 256,
      "intermediate_size": 768, "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2,
      "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
aten = torch.ops.aten
SAVE = {aten.mm.default, aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default}


def _torchtitan_policy(saved: list):
    """torchtitan's _custom_policy; ``saved`` collects the tensors the forward keeps."""
    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            meta[f"{mode}_mm_count"] += 1
        keep = func in SAVE and not (func == aten.mm.default and meta[f"{mode}_mm_count"] % 2 == 0)
        if keep and not ctx.is_recompute:
            out = ctx.op_output
            saved.extend(x for x in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(x, torch.Tensor))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.fixture(scope="module")
def measured():
    """(FLOPs not checkpointed, FLOPs under the policy, bytes the policy saves) of one layer, fp32."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**{k: v for k, v in HF.items() if k != "architectures"}, attn_implementation="sdpa")
    torch.manual_seed(0)
    layer, rope = LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)
    x = torch.randn(MICRO, SEQ, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(SEQ)[None].expand(MICRO, SEQ)
    pe = rope(x, pos)
    saved: list[torch.Tensor] = []

    def run(policy) -> float:
        def f(x):
            return layer(x, attention_mask=None, position_embeddings=pe, position_ids=pos)

        with FlopCounterMode(display=False) as fc:
            if policy:
                y = checkpoint(f, x, use_reentrant=False,
                               context_fn=lambda: create_selective_checkpoint_contexts(_torchtitan_policy(saved)))
            else:
                y = f(x)
            (y[0] if isinstance(y, tuple) else y).sum().backward()
        return fc.get_total_flops()

    plain = run(False)
    assert not saved
    op = run(True)
    assert saved, "the policy kept nothing: torch's selective checkpointing did not run it"
    return plain, op, sum(t.numel() * t.element_size() for t in saved) + x.numel() * x.element_size()


def test_the_recomputed_flops_are_torchs(measured):
    plain, op, _ = measured
    shape = shape_from_hf(HF)
    dm, t = C.model_dims(shape), MICRO * SEQ
    gemms = C.op_recompute_gemms(dm, t, 1)
    assert op - plain == sum(g.flops for g in gemms) > 0
    # wk, wo and w3: the up projection alone is more than half of them at this width
    assert [g.n * g.k for g in gemms] == [256 * 64, 256 * 256, 768 * 256]
    batch = BatchPlan(micro=MICRO, global_=MICRO, grad_accum=1, seq_len=SEQ)
    _, none_hw = step_flops(shape, batch, "none")
    _, op_hw = step_flops(shape, batch, "op")
    assert op_hw - none_hw == pytest.approx(op - plain, rel=1e-12)


def test_the_kept_bytes_are_torchs(measured):
    *_, kept = measured
    shape = shape_from_hf(HF)
    eager = Kernels(transformer_engine=False, attention="flash", fused_swiglu=False, fused_norm=False,
                    fused_dropout=False)
    est = layer_activation_bytes(shape, 0, tokens=MICRO * SEQ, seq=SEQ, layout=Layout(), recompute="op",
                                 kernels=eager, act_bytes=4)
    assert est == kept
    # the unfused kernels keep more without it: the policy is what makes the difference
    assert layer_activation_bytes(shape, 0, tokens=MICRO * SEQ, seq=SEQ, layout=Layout(), recompute="none",
                                  kernels=eager, act_bytes=4) > 2 * kept


def test_op_recompute_is_a_planning_input():
    """Every target refuses recompute op (rule op_recompute), and the estimate covers dense layers at
    tp = cp = 1 only (rule op_recompute_model); the published torchtitan rows plan it without the former."""
    base = {"model": "llama3.1-8b", "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb"},
            "recompute": "op", "zero": {"stage": 1}, "batch": {"micro": 1, "global": 8, "seq_len": 2048}}
    for target in ("recipes", "megatron-lm", "hf"):
        plan = make_plan(TrainingSpec.from_dict({**base, "target": target}))
        # (ZeRO-1 for Megatron-LM's sake: the 8B model does not fit at it on 8 GPUs with the recipes' runtime)
        assert [f.rule for f in plan.findings if f.level == "error" and f.rule != "memory"] == ["op_recompute"], target
        assert "torchtitan's per-op checkpointing" in plan.errors[0]
    tp2 = make_plan(TrainingSpec.from_dict({**base, "parallel": {"tp": 2}}))
    assert {f.rule for f in tp2.findings if f.level == "error"} - {"memory"} == {"op_recompute", "op_recompute_model"}
    moe = make_plan(TrainingSpec.from_dict({**base, "model": "mixtral-8x7b"}))
    msg = [f.message for f in moe.findings if f.rule == "op_recompute_model"]
    assert msg and "MoE" in msg[0]
    # the search never proposes it
    from toolkit.search.search import RECOMPUTE
    assert "op" not in RECOMPUTE
