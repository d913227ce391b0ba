"""LoRA on Qwen3-Next (toolkit.runtime.lora): adapters on every layer, the gated delta nets' in_proj
and out_proj as well as the gated attention's linear_qkv / linear_proj, exported with HF's names
and checked against peft and transformers, in one process at tp1:

a random tiny Qwen3NextForCausalLM (transformers saved it) converted to torch_dist, loaded into
the runtime's LoRA model as `--load` does, its adapters set to random non-zero values and saved as
the runtime saves a checkpoint's ``model/``; then the toolkit's peft export loaded with
``peft.PeftModel.from_pretrained(transformers' model, DIR)`` gives megatron-core's logits of the
reloaded checkpoint within 1e-5 (fp32), and the merged export (--export-hf) equals peft's
``merge_and_unload()``. Largest differences print with `pytest -s`."""
from __future__ import annotations

import pytest
import torch

TOL = 1e-5
SEQ = 16
RANK, ALPHA = 4, 8.0


def lora_plan(shape):
    from toolkit.plan import make_plan
    from toolkit.spec import TrainingSpec

    spec = TrainingSpec.from_dict({
        "model": shape.architecture, "attention": {"backend": "unfused"}, "precision": "fp32", "recompute": "none",
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"}, "zero": {"stage": 0},
        "batch": {"micro": 1, "global": 1, "seq_len": SEQ}, "moe": {"token_dispatcher": "allgather"},
        "finetune": {"method": "lora", "lora": {"rank": RANK, "alpha": ALPHA}}})
    return make_plan(spec, shape=shape).require_valid()


def lora_model(plan, weights):
    """The runtime's model of this rank with the weights of a torch_dist folder (toolkit.runtime)."""
    from toolkit.runtime import checkpoint, state
    from toolkit.runtime.model import build_model_chunks

    chunks = build_model_chunks(plan, zero=False)
    cat = state.catalog(plan, chunks)
    checkpoint.load_weights(plan, cat, weights)
    return chunks, cat


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(tmp, HF folder, tokens, megatron-core's logits of the saved checkpoint, wrapped layer names)."""
    import converters
    from converters.parity import sample_tokens
    from toolkit.mcore import cpu_compat, distributed
    from toolkit.runtime import checkpoint
    from toolkit.runtime.checkpoint_folder import weights_only
    from toolkit.runtime.export import write_hf_side, write_merged, write_peft_adapter
    from toolkit.runtime.lora import LoRALinear, is_adapter

    from tests.support.convert_models import NEXT, VOCAB, make_hf

    tmp = tmp_path_factory.mktemp("lora_next")
    hf = make_hf("qwen3_next", tmp / "hf", NEXT)
    base = converters.hf_to_megatron(hf, tmp / "mg", fmt="torch_dist")
    from converters.formats.megatron import open_megatron

    plan = lora_plan(open_megatron(base).shape)
    distributed.init_parallel(plan.layout)
    try:
        chunks, cat = lora_model(plan, weights_only(base))  # as --load of a converted model reads it
        wrapped = sorted(n for n, m in chunks[0].named_modules() if isinstance(m, LoRALinear))
        trainable = sum(p.numel() for p in chunks[0].parameters() if p.requires_grad)
        tokens = sample_tokens(VOCAB)
        b, s = tokens.shape
        forward = (lambda m: m.eval()(tokens, torch.arange(s).expand(b, s), cpu_compat.causal_mask(s))[..., :VOCAB])
        with torch.no_grad():
            base_logits = forward(chunks[0])  # B = 0: the base
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in chunks[0].named_parameters():
                if is_adapter(name):
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
        model_dir = tmp / "run" / "model"
        checkpoint._save_part(model_dir, {**cat.objects, **checkpoint._buffers(cat)}, cat.entries,
                              lambda e: {"": checkpoint._whole_weight(e)})  # the runtime's model/ of a checkpoint
        write_hf_side(model_dir, plan.shape, None)
        chunks, _ = lora_model(plan, model_dir)  # megatron-core's model as the checkpoint holds it
        with torch.no_grad():
            logits = forward(chunks[0])
        write_peft_adapter(plan, model_dir, tmp / "peft", False)
        write_merged(plan, model_dir, tmp / "merged", False)
    finally:
        distributed.destroy()
    return tmp, hf, tokens, logits, wrapped, base_logits, (plan, trainable)


def test_every_layer_has_adapters(run):
    """Layers 0-2 gated delta nets (in_proj, out_proj), layer 3 gated attention (linear_qkv,
    linear_proj); the MLPs are experts (none); the memory estimate counts exactly the adapters
    the model trains (toolkit.estimate.lora). The checkpoint stores in_proj's B one key per part,
    as megatron stores the weight."""
    from converters.formats import dcp
    from toolkit.estimate.lora import adapter_params

    wrapped = run[4]
    want = sorted([f"decoder.layers.{i}.self_attention.{m}" for i in range(3) for m in ("in_proj", "out_proj")]
                  + [f"decoder.layers.3.self_attention.{m}" for m in ("linear_qkv", "linear_proj")])
    assert wrapped == want
    plan, trainable = run[6]
    assert adapter_params(plan.shape, plan.layout, 0, plan.spec.finetune.lora).dense == trainable  # the plan's count
    keys = {k for k in dcp.tensors(run[0] / "run" / "model") if ".lora_" in k and "layers.0." in k}
    parts = ("query", "key", "value", "z", "beta", "alpha")
    assert keys == {f"decoder.layers.0.self_attention.{k}" for k in (
        "in_proj.lora_A.weight", *(f"in_proj.lora_B.weight.{p}" for p in parts),
        "out_proj.lora_A.weight", "out_proj.lora_B.weight")}, keys


def test_peft_loads_the_exported_adapters(run):
    """HF base (as transformers saved it) + the exported adapter through peft's own loader, against
    megatron-core's logits of the saved checkpoint."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp, hf, tokens, ref, _, ref_base, _ = run
    saved = load_file(tmp / "peft" / "adapter_model.safetensors")
    names = {k.split(".lora_")[0].split("model.layers.")[1] for k in saved}
    assert names == {f"{i}.linear_attn.{m}" for i in range(3) for m in ("in_proj_qkvz", "in_proj_ba", "out_proj")} | \
        {f"3.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp / "peft"))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    diff, moved = float((logits - ref).abs().max()), float((ref_base - ref).abs().max())
    print(f"LoRA qwen3-next-tiny tp1: HF base + peft adapter vs megatron-core's logits: max |diff| {diff:.1e} "
          f"(logit scale {float(ref.abs().max()):.2f}; the adapters move megatron's logits by {moved:.1e})")
    assert diff < TOL and moved > 100 * TOL

    merged = model.merge_and_unload().state_dict()
    ours = AutoModelForCausalLM.from_pretrained(tmp / "merged", dtype=torch.float32).state_dict()
    assert merged.keys() == ours.keys()
    worst = max(float((merged[k] - ours[k]).abs().max()) for k in merged)
    original = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    changed = sorted(k.split("layers.")[1] for k in ours if not torch.equal(ours[k], original[k]))
    print(f"LoRA qwen3-next-tiny tp1: --export-hf (merged) vs peft's merge_and_unload(): max |diff| {worst:.1e}; "
          f"{len(changed)} weights merged")
    assert worst < 1e-6
    assert changed == sorted(f"{n}.weight" for n in names)  # the adapted weights, and only they
