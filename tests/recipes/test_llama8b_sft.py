"""recipes/llama8b_sft.py end to end, tiny flavour on 2 CPU ranks, from a Hugging Face model
folder (a tiny Llama and a tokenizer with Meta-Llama-3's chat template, made here) and a chat
JSONL, with the documented commands: `toolkit convert hf-to-megatron`, `toolkit data prepare`,
the recipe with --load/--data/--export-hf. The first loss is transformers' loss of the model
over the assistant tokens of the first global batch's conversations (packed, per token), the
loss falls, and the export is a Hugging Face folder transformers loads, with the chat template."""
import json

import pytest
import torch

from toolkit.cli import main
from toolkit.runtime import chat_corpus as cc
from toolkit.runtime.recipe import TINY_BATCH
from toolkit.runtime.tiny_hf import save_tiny_hf

from tests.recipes.test_recipes import train

STEPS, SEQ, SEED = 12, TINY_BATCH["seq_len"], 1234


def transformers_loss(hf, samples: list[list[int]], prefix) -> float:
    """transformers' loss per assistant token over the samples' conversations (a model or a folder)."""
    from transformers import AutoModelForCausalLM

    from toolkit.hf.chat_loss import assistant_loss

    model = hf if isinstance(hf, torch.nn.Module) else AutoModelForCausalLM.from_pretrained(str(hf),
                                                                                         dtype=torch.float32)
    return assistant_loss(model, prefix, (c for s in samples for c in s))[0]


@pytest.mark.multirank
def test_sft_recipe_from_an_hf_folder(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.runtime import data
    from toolkit.runtime.chat_dataset import ChatDataset

    hf, chat = tmp_path / "hf", tmp_path / "chat.jsonl"
    save_tiny_hf("llama-tiny", hf, template="llama3")  # transformers' init, seed 0
    cc.write_jsonl(chat, cc.conversations(200, seed=5, max_turns=2, max_words=6))
    assert main(["convert", "hf-to-megatron", str(hf), str(tmp_path / "mg"), "--format", "torch_dist"]) == 0
    assert main(["data", "prepare", str(chat), "--tokenizer", str(hf), "--out", str(tmp_path / "chat"),
                 "--seq-len", str(SEQ)]) == 0
    capsys.readouterr()
    run = train("llama8b_sft.py", tmp_path / "run", "--load", str(tmp_path / "mg"), "--data", str(tmp_path / "chat"),
                steps=STEPS, export=tmp_path / "out-hf")
    ds = ChatDataset(tmp_path / "chat", SEQ, SEED, True, data.dataset_info(tmp_path / "chat").eod)
    first_batch = ds.samples[:TINY_BATCH["global"]]
    want = transformers_loss(hf, first_batch, tmp_path / "chat")
    losses = [m["loss"] for m in run]
    print(f"llama8b_sft tiny: {len(ds)} packed sequences ({ds.fill:.0%} filled); first loss {losses[0]:.6f} "
          f"(transformers {want:.6f}) -> {losses[-1]:.4f} after {STEPS} steps")
    assert abs(losses[0] - want) < 1e-5
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0
    spec = (tmp_path / "run" / "spec.yaml").read_text()
    assert "packing: true" in spec
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out-hf"), dtype=torch.float32)
    assert exported.config.num_hidden_layers == 4
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out-hf")).chat_template == cc.LLAMA3
    assert json.loads((tmp_path / "chat.json").read_text())["kind"] == "chat"
