"""Published training runs (references.yaml, data: what each source ran and published) as
``Published`` rows: a spec each, the throughput in tokens/s/GPU, the software's choices.

``tokens_per_gpu`` is tokens/s/GPU: from the published step time where there is one, else
converted from the published per-GPU FLOP/s with the FLOP count named in ``note``.
``comparable``: our estimate measures the same thing (bf16/fp16, or TransformerEngine FP8 given
as the spec's ``fp8``, on the registry GPU the run used); torchtitan's Float8 (torchao's, not
TransformerEngine's) and its 500 W HBM2e H100s are shown but not compared. ``megatron_bridge``: run by
Megatron-Bridge, which builds megatron-core's TransformerConfig in Python rather than through
Megatron-LM's command line: what those flags cannot express (rule megatron_lm_flags, e.g.
GPT-OSS's yarn rope) does not limit it, while the rest of target megatron-lm (Megatron's DDP and
distributed optimizer, the TransformerEngine layers) is what it runs. ``fit``: the
step-time constants (compute.CALIBRATION) are fitted on these rows only (each source's headline
rows: DGXC's 8B/70B/405B, Narayanan et al.'s Table 1, Korthikanti et al.'s selective-recompute
rows); the others are held out. Rows run on Megatron-LM between Feb 2021 and Mar 2023 without
sequence parallelism set estimate.pp_scatter_gather (that code's pipeline sends), and all of
them ran before Megatron-LM overlapped pipeline sends (overlap_p2p_comm, May 2023):
estimate.pp_overlap false; Narayanan et al.'s ran before its Float16 optimizer freed the fp32
copies of fp16 gradients between steps (July 2021): estimate.grad_copy_freed false. GPT models
(LayerNorm, GeLU 4h MLP, MHA) are given as LLaMA-shaped stand-ins with an MLP of 8h/3 (rounded
to a multiple of 8) and as many key-value heads as heads: the same GEMM FLOPs and parameters.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import yaml

from ..errors import SpecError, unknown_key_message
from ..models import ModelShape, load_model

DATA = Path(__file__).with_name("references.yaml")


@dataclass(frozen=True)
class Published:
    name: str
    spec: dict
    source: str
    tokens_per_gpu: float | None = None  # published tokens/s/GPU
    comparable: bool = False  # does our estimate measure the same run (precision, hardware)?
    note: str = ""
    shape: Callable[[], ModelShape] | None = None  # a model the registry does not name
    fit: bool = False  # the calibration is fitted on this row
    published_mfu: str = ""  # as the source states it (its own FLOP count)
    tflops_per_gpu: float | None = None  # published model FLOP/s per GPU, converted with our FLOP count
    software: Software | None = None  # what the source's software offered: a second, restricted search
    origin: str = ""  # the source the row comes from: rows of one origin share hardware, software and authors
    megatron_bridge: bool = False  # run by Megatron-Bridge: Megatron-LM's flag limits do not apply (module doc)


@dataclass(frozen=True)
class Software:
    """The choices the software a reference ran offered (or its job fixed), as search axes (zero:
    ZeRO stages, no offload); the published layout is also ranked among these."""

    name: str
    axes: dict[str, tuple]
    why: str


def _spec(model: str, nodes: int, parallel: dict, *, seq: int, gbs: int, micro: int = 1, zero: int = 1,
          recompute: str = "none", gpu: str = "h100-80gb", precision: str = "bf16", attention: str = "auto",
          target: str = "megatron-lm", megatron_2021_22: bool = False, mtp: int | None = None,
          grads: str | None = None, grad_copy_kept: bool = False, moe: dict | None = None,
          compile: bool = False, fp8: dict | None = None, cross_entropy_fusion: str = "none",
          fsdp: bool = False, deepspeed_pipe: bool = False, deepspeed: dict | None = None,
          hf_experts: str | None = None, param_gather_at_start: bool = False) -> dict:
    """A reference's spec; ``megatron_2021_22``: run on Megatron-LM of 2021-2022, whose pipeline
    sends split over tp (estimate.pp_scatter_gather) and are waited for (estimate.pp_overlap
    false: overlap_p2p_comm came in May 2023); ``grad_copy_kept``: on Megatron-LM before July 2021,
    whose fp32 copies of 16-bit gradients stayed between steps (estimate.grad_copy_freed false);
    ``fsdp``: sharded by PyTorch FSDP (zero.engine fsdp: ``zero`` 3 = FULL_SHARD, 2 = SHARD_GRAD_OP);
    ``deepspeed_pipe``: pipelined by DeepSpeed's PipelineEngine (Megatron-DeepSpeed), which does the same:
    each tp rank sends 1/tp of an activation and the receivers all-gather it (its ``pipe_partitioned`` and
    ``grad_partitioned``, on by default: deepspeed/runtime/config.py, pipe/engine.py PartitionedTensor), and
    ``p2p.send`` is a blocking ``dist.send``; ``deepspeed``: the spec's DeepSpeed config keys (a run's bucket
    sizes where they are not the generated config's); ``hf_experts``: how the run's transformers held a MoE
    layer's experts (estimate.hf_experts: ``modules`` for transformers 4.x's Linear per expert weight);
    ``param_gather_at_start``: run on megatron-core 0.8 or earlier, whose distributed optimizer dispatched every
    stage's first parameter all-gather in zero_grad, at the step's start (estimate.param_gather_at_start)."""
    waited = {"pp_scatter_gather": True, "pp_overlap": False}
    estimate = {**(waited if megatron_2021_22 or deepspeed_pipe else {}),
                **({"grad_copy_freed": False} if grad_copy_kept else {}),
                **({"hf_experts": hf_experts} if hf_experts else {}),
                **({"param_gather_at_start": True} if param_gather_at_start else {})}
    return {"model": model, "target": target, "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": gpu},
            "parallel": parallel, "zero": {"stage": zero, **({"engine": "fsdp"} if fsdp else {})},
            "recompute": recompute, "precision": precision,
            "compile": compile, "cross_entropy_fusion": cross_entropy_fusion, **({"fp8": fp8} if fp8 else {}),
            **({"optimizer": {"grad_reduce_dtype": grads}} if grads else {}),
            "attention": {"backend": attention}, "batch": {"micro": micro, "global": gbs, "seq_len": seq},
            **({"estimate": estimate} if estimate else {}),
            **({"mtp": {"layers": mtp}} if mtp is not None else {}), **({"moe": moe} if moe else {}),
            **({"deepspeed": deepspeed} if deepspeed else {})}


def stand_in(architecture: str, hidden: int, layers: int, heads: int, vocab: int = 51200,
             seq: int = 2048) -> ModelShape:
    """A GPT-3-style model (vocab 51,200, seq 2,048 unless given) as a LLaMA-shaped stand-in."""
    ffn = round(8 * hidden / 3 / 8) * 8
    return ModelShape(architecture, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                      num_attention_heads=heads, num_query_groups=heads, head_dim=hidden // heads,
                      ffn_hidden_size=ffn, max_position_embeddings=seq, rope_theta=10000.0, norm_eps=1e-5)


def changed(model: str, changes: dict) -> ModelShape:
    """A registry model with the fields a source changed (DGXC's Llama-3.1-405B: 16 query groups)."""
    return replace(load_model(model), **changes)


SPEC_KEYS = ("model", "nodes", "parallel", "seq", "gbs", "micro", "zero", "recompute", "gpu", "precision",
             "attention", "target", "megatron_2021_22", "mtp", "grads", "grad_copy_kept", "moe", "compile", "fp8",
             "cross_entropy_fusion", "fsdp", "deepspeed_pipe", "deepspeed", "hf_experts", "param_gather_at_start")
ROW_KEYS = ("name", "origin", *SPEC_KEYS, "stand_in", "model_changes", "source", "throughput", "comparable", "note",
            "fit", "published_mfu", "software", "megatron_bridge")
THROUGHPUT_KEYS = ("tokens_per_s", "tokens_per_s_per_gpu", "step_s", "model_tflops_per_gpu",
                   "hardware_tflops_per_gpu", "megatron_tflops_per_gpu")


def _check_keys(d: dict, valid: tuple[str, ...], where: str) -> None:
    for key in d:
        if key not in valid:
            raise SpecError(f"{DATA.name}: {unknown_key_message(key, valid, where)}")


def _tokens_per_gpu(given: dict, spec: dict, shape: ModelShape | None) -> tuple[float | None, float | None]:
    """(tokens/s/GPU, model FLOP/s per GPU) from the throughput as the source gives it."""
    gpus = spec["cluster"]["nodes"] * spec["cluster"]["gpus_per_node"]
    seq, gbs = spec["batch"]["seq_len"], spec["batch"]["global"]
    (kind, value), = given.items()
    if kind == "tokens_per_s":
        return value / gpus, None
    if kind == "tokens_per_s_per_gpu":
        return value, None
    if kind == "step_s":
        return gbs * seq / value / gpus, None
    if kind == "model_tflops_per_gpu":
        return None, value * 1e12
    l, h, v = shape.num_layers, shape.hidden_size, shape.vocab_size
    if kind == "megatron_tflops_per_gpu":  # Megatron-LM's num_floating_point_operations (2024) of a GPT model
        return value * 1e12 / megatron_flops_per_token(l, h, v, seq), None
    # Narayanan et al.: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step, the recomputed forward included
    return value * 1e12 / (96 * l * h**2 * (1 + seq / (6 * h) + v / (16 * l * h))), None


def megatron_flops_per_token(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Megatron-LM's FLOPs per token of a GPT model (MHA, an MLP of 8 h^2 parameters: GeLU 4h or
    SwiGLU 8h/3), training.py num_floating_point_operations as of July 2024: forward and backward,
    attention counted non-causal, 12 l h^2 ((1 + 1 + s/h) + 4 + V/2lh)."""
    return 12 * layers * hidden**2 * (2 + seq / hidden + 4 + vocab / (2 * layers * hidden))


def _software(d: dict) -> Software:
    _check_keys(d, ("name", "axes", "why"), "software")
    return Software(d["name"], {k: tuple(v) for k, v in d["axes"].items()}, d["why"])


def _row(d: dict, software: dict[str, Software]) -> Published:
    _check_keys(d, ROW_KEYS, "runs")
    if "origin" not in d:
        raise SpecError(f"{DATA.name}: run {d.get('name')!r} names no origin (the source its figures come from)")
    spec = _spec(**{k: d[k] for k in SPEC_KEYS if k in d})
    shape = None
    if "stand_in" in d:
        shape = partial(stand_in, **d["stand_in"])
    elif "model_changes" in d:
        shape = partial(changed, d["model"], d["model_changes"])
    given = d.get("throughput")
    if given is not None:
        _check_keys(given, THROUGHPUT_KEYS, "throughput")
        if len(given) != 1:
            raise SpecError(f"{DATA.name}: run {d['name']!r}: throughput gives {len(given)} figures, not one")
    tokens, tflops = _tokens_per_gpu(given, spec, shape and shape()) if given else (None, None)
    if d.get("software") is not None and d["software"] not in software:
        raise SpecError(f"{DATA.name}: run {d['name']!r}: {unknown_key_message(d['software'], software, 'software')}")
    return Published(d["name"], spec, d["source"], tokens, d.get("comparable", False), d.get("note", ""), shape,
                     d.get("fit", False), d.get("published_mfu", ""), tflops, software.get(d.get("software")),
                     d["origin"], d.get("megatron_bridge", False))


def load_published(path: Path = DATA) -> tuple[Published, ...]:
    """The rows of the data file, in order; an unknown key fails naming the closest valid one."""
    data = yaml.safe_load(path.read_text())
    _check_keys(data, ("software", "runs"), "")
    software = {name: _software(d) for name, d in data["software"].items()}
    return tuple(_row(d, software) for d in data["runs"])


PUBLISHED = load_published()
