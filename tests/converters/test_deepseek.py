"""DeepSeek-V3 (q LoRA, sigmoid + expert bias, group-limited routing, an MTP module) and
DeepSeek-V2 in V2-Lite's form (no q LoRA, softmax routing) and Kimi-K2's settings of V3 (no
groups, yarn with beta_fast = beta_slow = 1), 3 layers, yarn rope:
bit-exact round trips (both formats, tp / uneven pp / ep / etp, reshards between even and
uneven splits); parity with megatron-core's GPTModel (MLA local spec, MTP block) against
transformers at tp=2, pp=2 split 2+1, ep=2 and torch_dist loaded at another split;
checkpoints megatron wrote itself; FP8 block-scaled weights dequantised exactly as
transformers dequantises them; what megatron-core cannot reproduce is refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import converters
from converters.errors import CheckpointError, UnsupportedModelError
from converters.parity import hf_logits, max_diff, sample_tokens

from tests.support.convert_checks import (
    TOL,
    check,
    converted_jobs,
    exported_logits,
    launch,
    same_torch_dist_as_megatron,
    writer_jobs,
)
from tests.support.convert_models import VOCAB
from tests.support.deepseek_models import hf_config, make_hf, quantize_fp8
from tests.converters.test_roundtrip import assert_identical

NAMES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
UNEVEN = {"first_stage_layers": 2}  # pp=2: 2 + 1 layers


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return root, {"deepseek_v3": make_hf("deepseek_v3", root / "v3", mtp=True), "deepseek_v2": make_hf("deepseek_v2",
                                                                                                       root / "v2"),
                  "kimi_k2": make_hf("kimi_k2", root / "kimi")}


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("name", NAMES)
def test_round_trip(ds, tmp_path, name, fmt):
    _, hf = ds
    for tp, pp, ep, split in [(2, 1, 1, {}), (1, 2, 2, UNEVEN), (2, 2, 2, {"first_stage_layers": 1})]:
        out = tmp_path / f"t{tp}p{pp}e{ep}"
        mg = converters.hf_to_megatron(hf[name], out, tp=tp, pp=pp, ep=ep, fmt=fmt, **split)
        assert_identical(hf[name], converters.megatron_to_hf(mg, tmp_path / f"hf-{out.name}"))


def test_legacy_names_and_args(ds, tmp_path):
    """megatron-core's names, MTP on the last stage with its own embedding copy, the expert
    bias kept fp32 under --dtype bf16, and the split and MTP recorded as Megatron-LM does."""
    _, hf = ds
    mg = converters.hf_to_megatron(hf["deepseek_v3"], tmp_path / "mg", tp=1, pp=2, dtype="bf16", **UNEVEN)
    first = torch.load(mg / "release/mp_rank_00_000/model_optim_rng.pt", weights_only=False)
    last = torch.load(mg / "release/mp_rank_00_001/model_optim_rng.pt", weights_only=False)
    src = load_file(hf["deepseek_v3"] / "model.safetensors")
    assert {k.split(".")[2] for k in first["model"] if k.startswith("decoder.layers.")} == {"0", "1"}
    assert last["model"]["decoder.layers.0.mlp.router.expert_bias"].dtype == torch.float32
    assert torch.equal(last["model"]["decoder.layers.0.mlp.router.expert_bias"],
                       src["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert torch.equal(last["model"]["mtp.layers.0.eh_proj.weight"], src["model.layers.3.eh_proj.weight"].bfloat16())
    assert torch.equal(last["model"]["embedding.word_embeddings.weight"][:VOCAB],
                       src["model.embed_tokens.weight"].bfloat16())
    args = first["args"]
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers, args.mtp_num_layers,
            args.multi_latent_attention, args.qk_layernorm, args.kv_channels) == (2, None, 1, True, True, 16)
    assert converters.layout_from_args(args).first_stage_layers == 2


def test_reshard_between_even_and_uneven_splits(ds, tmp_path):
    _, hf = ds
    for name in NAMES:
        a = converters.hf_to_megatron(hf[name], tmp_path / f"{name}-a", tp=2, pp=2, ep=2, etp=1, **UNEVEN)
        b = converters.megatron_to_megatron(a, tmp_path / f"{name}-b", tp=1, pp=2, fmt="torch_dist",
                                            first_stage_layers=1)
        c = converters.megatron_to_megatron(b, tmp_path / f"{name}-c", tp=2, pp=1, ep=2, fmt="torch", grouped_gemm=True)
        assert_identical(hf[name], converters.megatron_to_hf(c, tmp_path / f"{name}-hf"))


def _variant(ds, name: str, **config) -> torch.Tensor:
    root, hf = ds
    d = root / f"{name}-{'-'.join(config)}"
    if not d.exists():
        shutil.copytree(hf[name], d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **config}))
    return hf_logits(d, sample_tokens(VOCAB))


def test_settings_the_parity_relies_on_are_observable(ds, tmp_path):
    """Yarn rope, V3's group-limited routing and its expert bias each change these logits by
    over 10x the tolerance, so the parity below checks that each is carried over."""
    root, hf = ds
    ref = {n: hf_logits(hf[n], sample_tokens(VOCAB)) for n in NAMES}
    plain_rope = {"rope_type": "default", "rope_theta": 10000.0}
    assert max_diff(ref["deepseek_v3"], _variant(ds, "deepseek_v3", rope_parameters=plain_rope)) > 10 * TOL
    assert max_diff(ref["deepseek_v2"], _variant(ds, "deepseek_v2", rope_parameters=plain_rope)) > 10 * TOL
    assert max_diff(ref["deepseek_v3"], _variant(ds, "deepseek_v3", n_group=1, topk_group=1)) > 10 * TOL
    zero_bias = root / "v3-zero-bias"
    shutil.copytree(hf["deepseek_v3"], zero_bias)
    t = load_file(zero_bias / "model.safetensors")
    t.update({k: torch.zeros_like(v) for k, v in t.items() if k.endswith("e_score_correction_bias")})
    save_file(t, zero_bias / "model.safetensors", metadata={"format": "pt"})
    assert max_diff(ref["deepseek_v3"], hf_logits(zero_bias, sample_tokens(VOCAB))) > 10 * TOL


WRITTEN = [{"tp": 2, "pp": 1}, {"tp": 1, "pp": 2, **UNEVEN}]  # layouts megatron saves its own models at


@pytest.fixture(scope="module")
def two_ranks(ds, tmp_path_factory):
    """One launch: tp=2 (sequence parallel), pp=2 split 2+1, ep=2 (etp=1 under tp=2 ep=2 is 4
    ranks so not here); torch_dist written at tp=1 and loaded by megatron at pp=2 split 1+2;
    and megatron-core's own MLA models (V3 with its MTP block, V2-Lite form) saved at WRITTEN."""
    _, hf = ds
    root = tmp_path_factory.mktemp("deepseek-two")
    jobs, labels = converted_jobs({n: hf[n] for n in NAMES}, root, [
        ("torch tp=2", dict(tp=2, pp=1)),
        ("torch pp=2 (2+1)", dict(tp=1, pp=2, **UNEVEN)),
        ("torch ep=2", dict(tp=1, pp=1, ep=2)),
        ("torch_dist tp=1, loaded pp=2 (1+2)", dict(tp=1, pp=1, fmt="torch_dist",
                                                    load={"pp": 2, "first_stage_layers": 1})),
    ])
    (root / "written").mkdir()
    writes = writer_jobs(root / "written", list(NAMES), WRITTEN, configs={name: hf_config(name) for name in NAMES},
                         mtp={"deepseek_v3": 1})
    logits = launch(root, jobs, writes, nproc=2)
    refs = {n: hf_logits(hf[n], sample_tokens(VOCAB)) for n in NAMES}
    return [(label, max_diff(got, refs[name])) for (name, label), got in zip(labels, logits)], writes


@pytest.mark.multirank
def test_parity_two_ranks(two_ranks):
    check(two_ranks[0])


@pytest.mark.multirank
def test_checkpoints_written_by_megatron(two_ranks, tmp_path):
    """megatron-core's own MLA GPTModels at tp=2 and at pp=2 split 2+1, saved by megatron
    (torch_dist and legacy, no args), export with --hf-config to models with megatron's
    logits; our torch_dist writer stores what megatron stored, chunk for chunk."""
    _, jobs = two_ranks
    assert [j["layout"] for j in jobs] == WRITTEN * len(NAMES)
    check(exported_logits(jobs))
    for job in jobs:
        same_torch_dist_as_megatron(job, tmp_path)


# ----------------------------------------------------------------------------- FP8
@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2"])  # Kimi-K2's checkpoint: the same FP8 blocks
def test_fp8_dequantised_as_transformers_does(ds, tmp_path, name):
    """The FP8 block-scaled checkpoint (128x128 blocks, as DeepSeek-V3's) converted and
    exported holds, for every quantised weight, the bf16 values transformers itself gives
    when it loads that checkpoint dequantising (FineGrainedFP8Config(dequantize=True))."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    _, hf = ds
    fp8 = quantize_fp8(hf[name], tmp_path / "fp8")
    quantised = [k[:-len("_scale_inv")] for k in load_file(fp8 / "model.safetensors") if k.endswith("_scale_inv")]
    mg = converters.hf_to_megatron(fp8, tmp_path / "mg", tp=2, pp=1, ep=2)
    out = converters.megatron_to_hf(mg, tmp_path / "hf")
    ours = load_file(out / "model.safetensors")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert all(ours[k].dtype == torch.bfloat16 for k in quantised)
    ref = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.bfloat16,
                                               quantization_config=FineGrainedFP8Config(dequantize=True)).state_dict()
    ours_loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    weights = [k for k in ref if k.endswith(("proj.weight", "gate_up_proj", "down_proj")) and ".layers." in k]
    assert len(weights) >= 20
    for k in weights:
        assert ref[k].dtype == torch.bfloat16 and torch.equal(ours_loaded[k], ref[k]), k


def test_dequantize_rows_streams_partial_blocks_as_transformers_formula():
    """converters.fp8 on a 300 x 200 weight (partial 128-blocks on both axes), read in row
    windows that start mid-block as the stream reads them: equal to transformers'
    _dequantize_fp8_weight computed in fp32 (DeepSeek's weight_dequant: fp32 product per
    block) then rounded once, for bf16 and fp32 outputs."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from converters.fp8 import dequantize_rows

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 200, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) + 0.01
    ref = _dequantize_fp8_weight(w.clone(), s, [128, 128], torch.float32)
    for dtype in (torch.bfloat16, torch.float32):
        got = torch.cat([dequantize_rows(w[a:b], s[a // 128:(b - 1) // 128 + 1], a, (128, 128), dtype)
                         for a, b in [(0, 100), (100, 250), (250, 300)]])
        assert torch.equal(got, ref.to(dtype))
    # every FP8 code (NaNs too), as the uint8 bytes the stream reads: bit for bit torch's own conversion
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(2, 128)
    ones = torch.ones(1, 1)
    want = _dequantize_fp8_weight(every.clone(), ones, [128, 128], torch.float32)
    got = dequantize_rows(every.view(torch.uint8).numpy(), ones, 0, (128, 128), torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_fp8_dtype_choice_and_bad_scales(ds, tmp_path):
    _, hf = ds
    fp8 = quantize_fp8(hf["deepseek_v2"], tmp_path / "fp8")
    mg = converters.hf_to_megatron(fp8, tmp_path / "mg32", tp=1, pp=1, dtype="fp32")
    ck = torch.load(mg / "release/mp_rank_00/model_optim_rng.pt", weights_only=False)
    assert ck["model"]["decoder.layers.1.self_attention.linear_q_proj.weight"].dtype == torch.float32
    t = load_file(fp8 / "model.safetensors")
    t["model.layers.1.self_attn.q_proj.weight_scale_inv"] = torch.ones(2, 2)
    save_file(t, fp8 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"q_proj.weight_scale_inv' has shape \[2, 2\], expected \[1, 1\]"):
        converters.hf_to_megatron(fp8, tmp_path / "bad", tp=1, pp=1)
    assert not (tmp_path / "bad").exists()


# ----------------------------------------------------------------------------- refused
@pytest.mark.parametrize("name, config, reason", [
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
     r"n_group=2, topk_group=1, num_experts_per_tok=2\): megatron-core scores a group by the sum of its top "
     r"topk // group_topk = 2 expert scores, transformers' DeepseekV2ForCausalLM by their maximum"),
    ("deepseek_v3", {"num_experts_per_tok": 3}, r"topk // group_topk = 3 expert scores, .* by their top-2 sum"),
    ("deepseek_v3", {"rms_norm_eps": 1e-5}, r"rms_norm_eps=1e-05: transformers' q/kv latent norms use eps 1e-06"),
    ("deepseek_v3", {"norm_topk_prob": False}, r"norm_topk_prob=false with top-2 sigmoid routing"),
    ("deepseek_v3", {"rope_interleave": False}, r"rope_interleave=false"),
])
def test_what_megatron_computes_differently_is_refused(ds, tmp_path, name, config, reason):
    root, hf = ds
    d = root / f"refused-{name}-{'-'.join(config)}"
    shutil.copytree(hf[name], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **config}))
    with pytest.raises(UnsupportedModelError, match=reason):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)
    assert not (tmp_path / "o").exists()


def test_refusal_is_one_line_on_the_command_line(ds, tmp_path, capsys):
    from toolkit.cli import main

    root, hf = ds
    d = root / "refused-cli"
    shutil.copytree(hf["deepseek_v3"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    code = main(["convert", "hf-to-megatron", str(d), str(tmp_path / "o"), "--tp", "1", "--pp", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "cannot be converted exactly" in err
    assert not (tmp_path / "o").exists()


def test_mtp_copy_of_the_embedding_must_equal_it(ds, tmp_path):
    """megatron shares the MTP module's embedding with the model's: a checkpoint whose copy
    differs cannot be converted without changing it."""
    _, hf = ds
    d = tmp_path / "v3"
    shutil.copytree(hf["deepseek_v3"], d)
    t = load_file(d / "model.safetensors")
    t["model.layers.3.embed_tokens.weight"][7, 3] += 1
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'model.layers.3.embed_tokens.weight' differs from "
                                              "'model.embed_tokens.weight'"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)
    assert not (tmp_path / "o").exists()


def test_uneven_split_problems_are_refused(ds, tmp_path):
    from toolkit.errors import PlanError

    _, hf = ds
    with pytest.raises(PlanError, match="pp=2 does not divide num_layers=3; set parallel.first_stage_layers"):
        converters.hf_to_megatron(hf["deepseek_v2"], tmp_path / "o", tp=1, pp=2)
    with pytest.raises(PlanError, match="first/last stage layers cannot be combined with embedding/loss accounting"):
        converters.hf_to_megatron(hf["deepseek_v2"], tmp_path / "o", tp=1, pp=2, first_stage_layers=2,
                                  embedding_in_split=True)


def test_torch_dist_with_transformer_engine_norm_names_is_read(ds, tmp_path):
    """megatron-core's TE spec for MLA (gpt_layer_specs: linear_q_up_proj / linear_kv_up_proj
    as layer-norm linears, a dense layer's pre-MLP norm fused into linear_fc1) stores the
    latent norms and the dense pre-MLP norm under other keys than the local spec: the same
    checkpoint re-saved by megatron's dist_checkpointing under those keys exports to the
    original bits."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.safe_globals import register_safe_globals

    from converters.formats.torch_dist import load_common
    from toolkit.mcore import cpu_compat

    cpu_compat.apply()  # megatron's writer calls torch.cuda.synchronize(); a no-op on CPU-only machines
    register_safe_globals()  # as Megatron-LM at start-up: common.pt holds an argparse.Namespace
    _, hf = ds
    mg = converters.hf_to_megatron(hf["deepseek_v2"], tmp_path / "local", tp=1, pp=1, fmt="torch_dist")
    te = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
          "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
          "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"}
    out = tmp_path / "te"
    (out / "release").mkdir(parents=True)
    (out / "latest_checkpointed_iteration.txt").write_text("release\n")
    shutil.copytree(mg / "hf", out / "hf")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        state, renamed = {}, 0
        for key, t in dist_checkpointing.load_plain_tensors(str(mg / "release")).items():
            if not isinstance(t, torch.Tensor):
                continue
            for old, new in te.items():
                renamed += old in key
                key = key.replace(old, new)
            state[key] = ShardedTensor.from_rank_offsets(key, t.contiguous(), replica_id=0)
        dist_checkpointing.save({"model": state, "args": load_common(mg / "release")["args"]}, str(out / "release"))
    finally:
        dist.destroy_process_group()
    assert renamed == 4  # the kv norm of 3 layers (no q LoRA: no q norm), layer 0's dense pre-MLP norm
    assert_identical(hf["deepseek_v2"], converters.megatron_to_hf(out, tmp_path / "hf"))
