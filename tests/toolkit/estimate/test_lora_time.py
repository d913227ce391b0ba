"""LoRA in the step time (finetune.method lora): the frozen base's backward computes its data gradients
only, the adapters' both. Held against torch's FLOP counter on peft's LoRA over transformers' own Llama
(the HF Trainer's model, target hf: peft's A per q, k, v and gate, up), full fine-tuning against LoRA:
what LoRA leaves out is the base's weight gradients (the linear layers' and the output layer's forward
FLOPs) less three times the adapters' forward. The attention core and the loss are the same in both
runs, so the difference holds whatever the counter makes of them."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from toolkit.estimate.time import step_flops
from toolkit.models import shape_from_hf
from toolkit.parallel.layout import BatchPlan
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

MICRO, SEQ, RANK = 2, 64, 8
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 256,
      "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
      "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # the same modules, megatron's names


def _counted(lora: bool) -> float:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in HF.items() if k != "architectures"},
                                         attn_implementation="sdpa"))
    if lora:
        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=16, lora_dropout=0.0, target_modules=HF_TARGETS))
        model.enable_input_require_grads()  # layer 0's data gradients too, as under gradient checkpointing
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) < 0.1 * sum(
            p.numel() for p in model.parameters())
    ids = torch.randint(0, HF["vocab_size"], (MICRO, SEQ))
    with FlopCounterMode(display=False) as fc:
        model(input_ids=ids, labels=ids).loss.backward()
    return fc.get_total_flops()


@pytest.fixture(scope="module")
def counted() -> tuple[float, float]:
    return _counted(False), _counted(True)


def test_lora_flops_are_torchs(counted):
    full, lora = counted
    shape = shape_from_hf(HF)
    batch = BatchPlan(micro=MICRO, global_=MICRO, grad_accum=1, seq_len=SEQ)
    _, est_full = step_flops(shape, batch, "none")
    _, est_lora = step_flops(shape, batch, "none", (RANK, TARGETS, False))
    assert full - lora == est_full - est_lora > 0
    # the recipes' runtime shares one A across q, k, v (gate, up): fewer adapter FLOPs, so more left out
    assert step_flops(shape, batch, "none", (RANK, TARGETS, True))[1] < est_lora


def test_lora_plan_reduces_and_steps_the_adapters_only():
    """The data-parallel reduction, the optimizer step and the backward GEMMs of a LoRA plan are the
    adapters' (and the base's data gradients): Llama-3-8B, target hf, ZeRO-2 on 4 nodes."""
    base = {"model": "llama3-8b", "target": "hf", "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu": "h100-80gb"},
            "zero": {"stage": 2}, "recompute": "full", "batch": {"micro": 1, "global": 64, "seq_len": 4096}}
    full = make_plan(TrainingSpec.from_dict(base))
    lora = make_plan(TrainingSpec.from_dict({**base, "finetune": {"method": "lora"}}))
    assert full.valid and lora.valid, (full.errors, lora.errors)
    f, lo = full.time.seconds, lora.time.seconds
    assert lo["optimizer"] < 0.01 * f["optimizer"] and lo["dp"] <= f["dp"]
    # GEMMs: forward and backward (data gradients) once each instead of three times, plus the adapters',
    # whose rank-8 shapes run far below the large GEMMs' efficiency (compute.gemm_seconds' tile terms)
    assert f["gemm"] * 2 / 3 < lo["gemm"] < f["gemm"] * 0.75
    assert lora.time.step_time_s < full.time.step_time_s
