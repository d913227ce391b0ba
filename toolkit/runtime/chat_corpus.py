"""A small chat corpus and a byte-level BPE tokenizer with a real chat template, built locally
(``tokenizers`` + ``transformers``, no network): what the chat-data tests, the SFT recipe's
tiny flavour and benchmarks/chat_prepare_bench.py tokenise with.

The templates are real models' (verbatim): ChatML as Hugging Face's documentation and many
ChatML models (OpenHermes-2.5, ...) ship it, and Meta-Llama-3-8B-Instruct's. CHATML_GENERATION
is ChatML with {% generation %} blocks around what the assistant generates (its reply and
<|im_end|>), as Hugging Face adds them to models' templates for transformers' assistant mask.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_GENERATION = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]
WORDS = ("the cat sat on a mat while dog ran after red ball and bird sang in tree near house what is two plus "
         "three four five answer yes no please tell me story about why sky blue").split()


def conversations(n: int, seed: int = 0, max_turns: int = 3, max_words: int = 12) -> list[dict]:
    """`n` random conversations of 1..max_turns user/assistant exchanges, some with a system
    message and every fourth as {"prompt", "completion"}: varied lengths for packing."""
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))

    out = []
    for i in range(n):
        if i % 4 == 3:
            out.append({"prompt": text(), "completion": text()})
            continue
        msgs = [{"role": "system", "content": text()}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, max_turns)):
            msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_tokenizer(out: Path, template: str = CHATML, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer trained on the corpus's words, with `template` as its chat
    template and <|im_end|> as EOS (ChatML's end of turn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 4 + [json.dumps(c) for c in conversations(50)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|begin_of_text|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(out)
    return out
