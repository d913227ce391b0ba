"""The runtime's layout-independent initialisation (toolkit.runtime.init) draws each weight with the
method megatron-core itself gives that weight's layer: the embedding's, the depth-scaled one of the
output projections, or the plain one. Checked against megatron-core's own construction, per family:
each tiny model is built by megatron with the three methods replaced by fills of distinct constants,
so every weight megatron initialises says which method its layer was given; init.init_method must
name the same one. (A gated delta net's out_proj was drawn with the plain method until 2026-11-28.)
"""
from __future__ import annotations

import pytest
import torch

FILLS = {"embedding_init_method": 0.125, "init_method": 0.375, "output_layer_init_method": 0.625}
# each kind of layer megatron builds for the families: dense GQA (Llama), gated delta nets + gated attention +
# MoE with a gated shared expert + MTP (Qwen3-Next), sinks and biases (GPT-OSS), the toolkit's own layers
# in megatron's spec (Gemma 3), multi-latent attention with routed and shared experts (DeepSeek-V3)
FAMILIES = ["llama-tiny", "qwen3-next-tiny", "gpt-oss-tiny", "gemma3-tiny", "deepseek-v3-tiny"]


def fill(value: float):
    return lambda t: torch.nn.init.constant_(t, value)


@pytest.fixture(scope="module")
def one_rank():
    from toolkit.mcore import distributed
    from toolkit.parallel.layout import Layout

    distributed.init_parallel(Layout())
    yield
    distributed.release_model_parallel()


def tiny_plan(model: str):
    from toolkit.plan import make_plan
    from toolkit.spec import TrainingSpec

    extra = {"moe": {"token_dispatcher": "allgather"}} if model not in ("llama-tiny", "gemma3-tiny") else {}  # CPU
    if model == "qwen3-next-tiny":
        extra["mtp"] = {"layers": 1}
    return make_plan(TrainingSpec.from_dict({
        "model": model, "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"}, "zero": {"stage": 1},
        "precision": "fp32", "recompute": "none", "attention": {"backend": "unfused"},
        "batch": {"micro": 1, "global": 1, "seq_len": 16}, "train": {"steps": 1}, **extra})).require_valid()


@pytest.mark.parametrize("model", FAMILIES)
def test_each_weight_gets_megatrons_init_method(one_rank, model):
    from toolkit.mcore.model import build_model_chunks
    from toolkit.runtime import init

    methods = {k: fill(v) for k, v in FILLS.items()}
    [chunk] = build_model_chunks(tiny_plan(model), use_cpu_initialization=True, perform_initialization=True,
                                 **methods)
    parts = init._part_inits(chunk)  # drawn part by part with megatron's own per-part methods
    by_value = {v: methods[k] for k, v in FILLS.items()}
    checked = {k: 0 for k in FILLS}
    for name, param in chunk.named_parameters():
        values = param.detach().unique()
        if name in parts or values.numel() != 1 or float(values) not in by_value:
            continue  # norms (ones / zeros), biases, delta-net parts: not drawn by these methods
        given = by_value[float(values)]
        assert init.init_method(chunk.config, name) is given, (
            f"{model}: {name}: megatron-core gives it {FILLS_NAME[float(values)]}, the runtime "
            f"{next(k for k, m in methods.items() if m is init.init_method(chunk.config, name))}")
        checked[FILLS_NAME[float(values)]] += 1
    assert checked["init_method"] and checked["output_layer_init_method"], checked
    print(model, checked)


FILLS_NAME = {v: k for k, v in FILLS.items()}
