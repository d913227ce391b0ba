"""Logits parity: megatron-core's own GPTModel loaded from a Megatron checkpoint against
transformers' model loaded from an HF folder, on the same tokens, both in fp32.

The Megatron side runs under torchrun with gloo at the checkpoint's own layout
(``converters.parity_worker``); pipeline stages hand their hidden states on with
send/recv (megatron's schedules need CUDA), virtual chunks in megatron's order.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from toolkit.errors import ToolkitError

BATCH, SEQ_LEN = 2, 64


class VerificationError(ToolkitError):
    """Logits differ by more than the tolerance, or the Megatron run failed."""


def sample_tokens(vocab: int, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0) -> torch.Tensor:
    """The same [batch, seq_len] token ids on every rank and in the HF process."""
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits [batch, seq, vocab] in fp32. The config is built as the toolkit reads
    it (a model_type another family's config class reads, e.g. Kimi-K2's, as that type)."""
    from transformers import AutoModelForCausalLM

    from toolkit.models import read_hf_config
    from toolkit.models.registry import hf_config_object

    config = hf_config_object(read_hf_config(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), config=config, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise VerificationError(f"logits have shapes {list(a.shape)} (megatron) and {list(b.shape)} (HF)")
    return float((a.float() - b.float()).abs().max())


def megatron_logits(jobs: list[dict[str, Any]], nproc: int, timeout: float = 900) -> list[torch.Tensor]:
    """Run ``converters.parity_worker`` once (one torchrun) for several checkpoints whose
    layouts need ``nproc`` ranks. Each job: {"megatron_dir", optional "hf_config"};
    returns megatron's logits [batch, seq, vocab] (vocabulary padding removed) per job."""
    with tempfile.TemporaryDirectory(prefix="verify-") as tmp:
        jobs = [{"out": f"{tmp}/logits{i}.pt", **job} for i, job in enumerate(jobs)]
        spec = Path(tmp) / "jobs.json"
        spec.write_text(json.dumps(jobs))
        # --standalone: the launcher's store binds a port the kernel picks (no port chosen here and
        # taken by another process before torchrun binds it)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "converters.parity_worker", str(spec)]
        # CPU ranks over gloo on every machine: the check is about the weights, and one GPU
        # cannot hold several NCCL ranks
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if r.returncode != 0:
            raise VerificationError("megatron-core run failed: " + _last_error(r.stdout + r.stderr))
        return [torch.load(job["out"], weights_only=True) for job in jobs]


def _last_error(text: str) -> str:
    """The exception line of the first failing rank (with the next line when it ends in ':')."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln).strip() for ln in text.splitlines()]
    at = [i for i, ln in enumerate(lines) if re.match(r"^[\w.]*(Error|Exception)\b", ln)
          and "ChildFailedError" not in ln]
    if not at:
        return lines[-1] if lines else "no output"
    i = at[0]
    return lines[i] + (" " + lines[i + 1] if lines[i].endswith(":") and i + 1 < len(lines) else "")


# The numbers that decide whether two models compute the same function on the same tokens
# (a difference here would crash the comparison, e.g. token ids beyond the smaller vocabulary).
MODEL_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim",
                "ffn_hidden_size", "tie_embeddings", "qkv_bias", "qk_norm")
MOE_FIELDS = ("num_experts", "topk", "ffn_hidden_size", "layers", "shared_ffn_hidden_size")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class ModelMismatchError(VerificationError):
    """The HF folder and the checkpoint hold different models (named fields differ)."""


def model_differences(hf, ckpt) -> list[str]:
    """'field HF vs checkpoint' for every model number that differs."""
    out = [f"{f} {getattr(hf, f)} vs {getattr(ckpt, f)}" for f in MODEL_FIELDS if getattr(hf, f) != getattr(ckpt, f)]
    if (hf.moe is None) != (ckpt.moe is None):
        out.append(f"experts {hf.moe.num_experts if hf.moe else 0} vs {ckpt.moe.num_experts if ckpt.moe else 0}")
    elif hf.moe is not None:
        out += [f"moe.{f} {getattr(hf.moe, f)} vs {getattr(ckpt.moe, f)}" for f in MOE_FIELDS
                if getattr(hf.moe, f) != getattr(ckpt.moe, f)]
    if (hf.mla is None) != (ckpt.mla is None):
        out.append(f"multi-latent attention {'yes' if hf.mla else 'no'} vs {'yes' if ckpt.mla else 'no'}")
    elif hf.mla is not None:
        out += [f"mla.{f} {getattr(hf.mla, f)} vs {getattr(ckpt.mla, f)}" for f in MLA_FIELDS
                if getattr(hf.mla, f) != getattr(ckpt.mla, f)]
    return out


def _open(megatron_dir, hf_dir: Path, hf_config: str | Path | None):
    """The checkpoint, described by ``hf_config`` when given, else by itself (args, hf/ side
    folder), else by HF_DIR's config.json; and the config path the worker must be given."""
    from toolkit.models import read_hf_config

    from .errors import ConversionSetupError
    from .formats.megatron import open_megatron

    if hf_config is not None:
        return open_megatron(megatron_dir, read_hf_config(hf_config)), str(hf_config)
    try:
        return open_megatron(megatron_dir), None
    except ConversionSetupError:
        if not (hf_dir / "config.json").is_file():
            raise
        return open_megatron(megatron_dir, read_hf_config(hf_dir)), str(hf_dir)


def verify(hf_dir: str | Path, megatron_dir: str | Path, *, tolerance: float = 1e-4,
           hf_config: str | Path | None = None, timeout: float = 900,
           progress: Callable[[str], None] | None = None) -> float:
    """Max |logit difference|; raises ModelMismatchError (one line naming the fields) when the
    two folders hold different models, VerificationError when above ``tolerance``.
    ``progress(what)`` is called as each of the two runs (each several seconds) starts."""
    report = progress or (lambda what: None)
    from toolkit.models import read_hf_config, shape_from_hf

    from .errors import CheckpointError

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"HF model folder '{hf_dir}' has no config.json")
    ck, cfg_path = _open(megatron_dir, hf_dir, hf_config)
    ck.source.close()  # only the model and layout are needed here; the megatron run reads the files
    diff = model_differences(shape_from_hf(read_hf_config(hf_dir)), ck.shape)
    if diff:
        raise ModelMismatchError(f"'{hf_dir}' and '{megatron_dir}' hold different models: {'; '.join(diff)} "
                                 "(HF vs checkpoint)")
    report(f"megatron-core's GPTModel at {ck.layout.describe()} on {ck.layout.world} CPU rank(s)")
    got = megatron_logits([{"megatron_dir": str(megatron_dir), "hf_config": cfg_path}], ck.layout.world, timeout)[0]
    report(f"transformers' {ck.shape.architecture}")
    want = hf_logits(hf_dir, sample_tokens(ck.shape.vocab_size))
    diff_max = max_diff(got, want)
    if not diff_max <= tolerance:
        raise VerificationError(f"max |logit diff| = {diff_max:.3g} exceeds the tolerance {tolerance:g}")
    return diff_max
