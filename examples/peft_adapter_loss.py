"""The loss of a Hugging Face base model with and without a LoRA adapter, on prepared chat data:
transformers' model, peft's loader (`PeftModel.from_pretrained`), the loss per assistant token
as the runtime counts it (toolkit.hf.chat_loss). What a run's `--export-peft DIR` is checked with.

    python examples/peft_adapter_loss.py HF_DIR ADAPTER_DIR DATA_PREFIX [--conversations N]

Prints one line: the base's loss, then with the adapter, on the first N conversations of the
data (default 64), in fp32.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from toolkit import quiet
from toolkit.errors import ToolkitError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the Hugging Face model folder the adapter was trained on")
    ap.add_argument("adapter", help="peft adapter folder (adapter_config.json + adapter_model.safetensors)")
    ap.add_argument("data", help="chat data prefix from `toolkit data prepare`")
    ap.add_argument("--conversations", type=int, default=64, help="how many conversations, from the first")
    a = ap.parse_args()
    for folder, file in ((a.base, "config.json"), (a.adapter, "adapter_config.json")):
        if not Path(folder, file).is_file():  # (peft would look for it on the hub)
            print(f"error: no {file} in '{folder}'", file=sys.stderr)
            return 3
    quiet.quiet_imports()
    quiet.quiet_deepspeed_detection()
    quiet.quiet_transformers_progress()
    quiet.quiet_peft()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toolkit.hf.chat_loss import assistant_loss

    try:
        base = AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float32)
        before, tokens = assistant_loss(base, a.data, range(a.conversations))
        tuned = PeftModel.from_pretrained(base, a.adapter)
        after, _ = assistant_loss(tuned, a.data, range(a.conversations))
    except (ToolkitError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"loss per assistant token, first {a.conversations} conversations of {a.data} ({tokens} tokens): "
          f"base {before:.4f}, with the adapter {after:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
