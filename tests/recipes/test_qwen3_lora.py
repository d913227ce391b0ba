"""recipes/qwen3_30b_a3b_lora.py end to end, tiny flavour on 2 CPU ranks at ep2, from a
Hugging Face model folder (a tiny Qwen3-MoE with a ChatML tokenizer, made here) and a chat JSONL,
with the documented commands: `toolkit convert hf-to-megatron`, `toolkit data prepare`, the
recipe with --load/--data/--export-peft. The first loss is transformers' own over the assistant
tokens (the adapters start at zero), the loss falls with only the adapters training, and peft
loads the exported adapters onto the HF base (`PeftModel.from_pretrained`): its loss on the
same samples is the trained one, below the base's."""
import pytest
import torch

from toolkit.cli import main
from toolkit.runtime import chat_corpus as cc
from toolkit.runtime.recipe import TINY_BATCH

from tests.recipes.test_llama8b_sft import transformers_loss
from tests.recipes.test_recipes import train

STEPS, SEQ, SEED = 10, TINY_BATCH["seq_len"], 1234


def tiny_qwen3_moe_with_chat_tokenizer(folder):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from toolkit.models.families.qwen3 import QWEN3_MOE_TINY

    cfg = {k: v for k, v in QWEN3_MOE_TINY.items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).save_pretrained(folder)
    cc.make_tokenizer(folder, cc.CHATML)


@pytest.mark.multirank
def test_lora_recipe_from_an_hf_folder_to_a_peft_adapter(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toolkit.runtime import data
    from toolkit.runtime.chat_dataset import ChatDataset

    hf, chat = tmp_path / "hf", tmp_path / "chat.jsonl"
    tiny_qwen3_moe_with_chat_tokenizer(hf)
    cc.write_jsonl(chat, cc.conversations(200, seed=5, max_turns=2, max_words=6))
    assert main(["convert", "hf-to-megatron", str(hf), str(tmp_path / "mg"), "--format", "torch_dist"]) == 0
    assert main(["data", "prepare", str(chat), "--tokenizer", str(hf), "--out", str(tmp_path / "chat"),
                 "--seq-len", str(SEQ)]) == 0
    capsys.readouterr()
    run = train("qwen3_30b_a3b_lora.py", tmp_path / "run", "--set", "parallel.ep=2", "--load",
                str(tmp_path / "mg"), "--data", str(tmp_path / "chat"), "--export-peft", str(tmp_path / "adapter"),
                "--set", "optimizer.lr=0.01", "--set", "optimizer.min_lr=0.001", "--set", "optimizer.warmup_steps=1",
                steps=STEPS)
    ds = ChatDataset(tmp_path / "chat", SEQ, SEED, True, data.dataset_info(tmp_path / "chat").eod)
    first = ds.samples[:TINY_BATCH["global"]]
    want = transformers_loss(hf, first, tmp_path / "chat")
    losses = [m["loss"] for m in run]
    base = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    after = transformers_loss(tuned, first, tmp_path / "chat")
    print(f"qwen3_30b_a3b_lora tiny at ep2: first loss {losses[0]:.6f} (transformers {want:.6f}) -> "
          f"{losses[-1]:.4f} after {STEPS} steps; transformers + the exported peft adapter on the first batch "
          f"{after:.4f}")
    assert abs(losses[0] - want) < 1e-5
    assert sum(losses[-3:]) / 3 < losses[0] - 0.2
    assert after < want - 0.2
