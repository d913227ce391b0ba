"""Data-preparation throughput of chat data: `toolkit data prepare` on a JSONL of conversations
(chat template, assistant mask, two indexed datasets written) beside a plain `tokenizer(...)`
loop over the same file (each line's message contents joined and tokenised, nothing written),
in tokens per second of one process.

    PYTHONPATH=. python benchmarks/chat_prepare_bench.py [--conversations 4000] [--repeat 3]

Two templates of the locally built tokenizer (toolkit.runtime.chat_corpus): ChatML, whose mask
is derived by rendering prefixes (1 + 2 per assistant turn renderings of the template), and
ChatML with {% generation %} blocks (transformers' own mask: one rendering). Each figure is the
best of --repeat runs (the machine is shared); tokens are those the prepared dataset holds
(template tokens included) and, for the plain loop, those it produced.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def plain_loop(src: Path, tok) -> int:
    tokens = 0
    with src.open() as f:
        for line in f:
            r = json.loads(line)
            msgs = r.get("messages") or [{"content": r["prompt"]}, {"content": r["completion"]}]
            tokens += len(tok(" ".join(m["content"] for m in msgs), add_special_tokens=False)["input_ids"])
    return tokens


def best(fn, repeat: int) -> tuple[float, int]:
    """(seconds, tokens) of the fastest of `repeat` calls."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        n = fn()
        runs.append((time.perf_counter() - start, n))
    return min(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from toolkit.runtime import chat_corpus as cc
    from toolkit.runtime import data

    tmp = Path(tempfile.mkdtemp(prefix="chat_bench-"))
    src = cc.write_jsonl(tmp / "chat.jsonl", cc.conversations(args.conversations, seed=1))
    print(f"{args.conversations:,} conversations ({src.stat().st_size / 2**20:.1f} MiB), best of {args.repeat}")
    for k, (name, template) in enumerate((("ChatML, mask derived from prefixes", cc.CHATML),
                                          ("ChatML with {% generation %}, transformers' mask", cc.CHATML_GENERATION))):
        folder = cc.make_tokenizer(tmp / f"tok{k}", template)
        tok = AutoTokenizer.from_pretrained(str(folder))
        secs, tokens = best(lambda: data.prepare(src, folder, tmp / "out", overwrite=True).tokens, args.repeat)
        plain_s, plain_tokens = best(lambda: plain_loop(src, tok), args.repeat)
        print(f"{name}:\n  toolkit data prepare   {tokens / secs:>12,.0f} tokens/s ({tokens:,} tokens, {secs:.2f} s)\n"
              f"  plain tokenizer() loop {plain_tokens / plain_s:>12,.0f} tokens/s ({plain_tokens:,} tokens, "
              f"{plain_s:.2f} s)   ratio {(tokens / secs) / (plain_tokens / plain_s):.2f}")


if __name__ == "__main__":
    main()
