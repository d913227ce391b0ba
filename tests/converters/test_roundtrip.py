"""Round trips HF -> Megatron -> HF are bit-exact (names, dtypes, values, config) for every
dense architecture, at every small layout, in both formats, and through resharding.

These prove the inverse is exact; that the Megatron side is *right* is proven against
megatron-core itself in tests/converters/test_parity.py.
"""
from __future__ import annotations

import json
import zipfile

import pytest
import torch

import converters
from converters.formats.torch_legacy import RANK_FILE

from tests.support.convert_models import DENSE, make_hf

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2)]  # (tp, pp, vpp)
FORMATS = ["torch", "torch_dist"]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_hf(name, root / name) for name in DENSE}


def read_all(d) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def assert_identical(a_dir, b_dir) -> None:
    a, b = read_all(a_dir), read_all(b_dir)
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (a_dir, b_dir))
    assert ca == cb
    assert (b_dir / "generation_config.json").read_text() == (a_dir / "generation_config.json").read_text()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", list(DENSE))
def test_round_trip_every_layout(hf_models, tmp_path, arch, fmt):
    for tp, pp, vpp in LAYOUTS:
        mg = converters.hf_to_megatron(hf_models[arch], tmp_path / f"mg{tp}{pp}{vpp}", tp=tp, pp=pp, vpp=vpp, fmt=fmt)
        back = converters.megatron_to_hf(mg, tmp_path / f"hf{tp}{pp}{vpp}")
        assert_identical(hf_models[arch], back)


@pytest.mark.parametrize("arch", list(DENSE))
def test_reshard_then_export(hf_models, tmp_path, arch):
    """tp/pp/vpp and format changes chained, then export: still the original bits."""
    src = converters.hf_to_megatron(hf_models[arch], tmp_path / "a", tp=2, pp=2)
    b = converters.megatron_to_megatron(src, tmp_path / "b", tp=1, pp=2, vpp=2, fmt="torch_dist")
    c = converters.megatron_to_megatron(b, tmp_path / "c", tp=2, pp=1, fmt="torch")
    d = converters.megatron_to_megatron(c, tmp_path / "d", tp=1, pp=1)
    assert_identical(hf_models[arch], converters.megatron_to_hf(d, tmp_path / "hf"))


def test_legacy_files_are_ordinary_torch_files(hf_models, tmp_path):
    """weights_only load without mmap, valid zip CRCs, Megatron's dict layout."""
    mg = converters.hf_to_megatron(hf_models["qwen2"], tmp_path / "mg", tp=2, pp=2, vpp=1)
    assert (mg / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    files = sorted((mg / "release").glob(f"mp_rank_*/{RANK_FILE}"))
    assert [f.parent.name for f in files] == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    for f in files:
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None  # every record's CRC-32 is right
        import argparse

        with torch.serialization.safe_globals([argparse.Namespace]):
            ck = torch.load(f, weights_only=True)
        assert list(ck)[:4] == ["args", "checkpoint_version", "iteration", "model"]
        assert ck["checkpoint_version"] == 3.0 and ck["args"].tensor_model_parallel_size == 2
        assert ck["args"].padded_vocab_size == 512 and ck["args"].vocab_size == 500
    last = torch.load(files[1], weights_only=False)["model"]
    first = torch.load(files[0], weights_only=False)["model"]
    # tied embeddings with pp > 1: the last stage keeps its own copy of (its shard of) the embedding
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    shard1 = torch.load(files[2], weights_only=False)["model"]["embedding.word_embeddings.weight"]
    assert shard1.shape == (256, 64) and shard1[500 - 256:].abs().sum() == 0 < shard1[:500 - 256].abs().sum()
    assert "decoder.layers.0.self_attention.linear_qkv._extra_state" in first


def test_records_split_over_many_chunks_stay_exact(hf_models, tmp_path, monkeypatch):
    """With 1 KiB chunks every record is many chunks, written and checksummed by the writer
    threads in whatever order they finish: the CRC-32s combine right and the bits survive."""
    import converters.stream

    monkeypatch.setattr(converters.stream, "CHUNK_BYTES", 1024)
    mg = converters.hf_to_megatron(hf_models["llama"], tmp_path / "mg", tp=2, pp=2)
    for f in sorted((mg / "release").glob(f"mp_rank_*/{RANK_FILE}")):
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None
    assert_identical(hf_models["llama"], converters.megatron_to_hf(mg, tmp_path / "hf"))


def test_dtype_default_and_explicit(hf_models, tmp_path):
    """No silent down-cast: bf16 stays bf16, fp32 stays fp32; --dtype converts everything."""
    mg = converters.hf_to_megatron(hf_models["mistral"], tmp_path / "mg", tp=1, pp=1)
    ck = torch.load(mg / "release/mp_rank_00" / RANK_FILE, weights_only=False)
    assert {t.dtype for t in ck["model"].values() if t is not None} == {torch.bfloat16}
    assert ck["args"].bf16 and ck["args"].params_dtype == torch.bfloat16
    up = converters.megatron_to_hf(mg, tmp_path / "fp32", dtype="fp32")
    t = read_all(up)
    assert {v.dtype for v in t.values()} == {torch.float32}
    assert json.loads((up / "config.json").read_text())["dtype"] == "float32"
    orig = read_all(hf_models["mistral"])
    assert all(torch.equal(t[k], orig[k].float()) for k in orig)


def test_sharded_hf_output_loads_in_transformers(hf_models, tmp_path):
    """Several safetensors shards + index.json, read back by transformers itself."""
    from transformers import AutoModelForCausalLM

    mg = converters.hf_to_megatron(hf_models["qwen3"], tmp_path / "mg", tp=2, pp=1)
    out = converters.megatron_to_hf(mg, tmp_path / "hf", max_shard_size=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    model = AutoModelForCausalLM.from_pretrained(out)
    ref = AutoModelForCausalLM.from_pretrained(hf_models["qwen3"])
    tokens = torch.arange(12)[None]
    assert torch.equal(model(tokens).logits, ref(tokens).logits)


UNEVEN = [  # megatron's uneven splits of 4 layers: (pp, vpp, split) -> layers per stage
    (2, 1, {"first_stage_layers": 3}),  # 3 + 1
    (2, 1, {"last_stage_layers": 3}),  # 1 + 3
    (3, 1, {"embedding_in_split": True, "loss_in_split": True}),  # (4 + 2) / 3 = 2 each: 1 + 2 + 1
    (2, 2, {"first_stage_layers": 2}),  # vpp with an uneven split: 1 layer per chunk
    (2, 3, {"embedding_in_split": True, "loss_in_split": True}),  # 1 per chunk: the first holds only the
]  # embedding, the last only the output layer (0 + 1 + 1 | 1 + 1 + 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_uneven_splits_round_trip_and_are_recorded(hf_models, tmp_path, fmt):
    """Layers placed as megatron places them (toolkit.parallel.pipeline), the split in the args
    as Megatron-LM records it and read back; export gives the original bits (Llama, and
    Qwen2 whose tied output layer goes to the last stage)."""
    for arch in ("llama", "qwen2"):
        for pp, vpp, split in UNEVEN:
            out = tmp_path / f"{arch}-{pp}{vpp}-{'-'.join(split)}"
            mg = converters.hf_to_megatron(hf_models[arch], out, tp=1, pp=pp, vpp=vpp, fmt=fmt, **split)
            args = _args(mg, fmt)
            assert converters.layout_from_args(args) == converters.Layout(pp=pp, vpp=vpp, **split)
            assert args.decoder_first_pipeline_num_layers == split.get("first_stage_layers")
            assert args.account_for_loss_in_pipeline_split == split.get("loss_in_split", False)
            assert_identical(hf_models[arch], converters.megatron_to_hf(mg, tmp_path / f"hf-{out.name}"))
    mg = converters.hf_to_megatron(hf_models["llama"], tmp_path / "placed", tp=1, pp=3, embedding_in_split=True,
                                   loss_in_split=True)
    layers = [{k.split(".")[2] for k in torch.load(f, weights_only=False)["model"] if k.startswith("decoder.layers.")}
              for f in sorted((mg / "release").glob(f"mp_rank_00_*/{RANK_FILE}"))]
    assert [len(x) for x in layers] == [1, 2, 1]


def _args(mg, fmt: str):
    if fmt == "torch":
        return torch.load(next((mg / "release").glob(f"mp_rank_*/{RANK_FILE}")), weights_only=False)["args"]
    from converters.formats.torch_dist import load_common

    return load_common(mg / "release")["args"]


def test_reshard_between_even_and_uneven_splits(hf_models, tmp_path):
    """even -> uneven -> other uneven -> even, through both formats: the original bits."""
    src = converters.hf_to_megatron(hf_models["llama"], tmp_path / "a", tp=2, pp=2)
    b = converters.megatron_to_megatron(src, tmp_path / "b", tp=1, pp=2, first_stage_layers=3, fmt="torch_dist")
    c = converters.megatron_to_megatron(b, tmp_path / "c", tp=2, pp=3, embedding_in_split=True, loss_in_split=True,
                                        fmt="torch")
    d = converters.megatron_to_megatron(c, tmp_path / "d", tp=1, pp=4)
    assert_identical(hf_models["llama"], converters.megatron_to_hf(d, tmp_path / "hf"))


def test_uneven_split_without_args_is_read_from_the_files(hf_models, tmp_path):
    """A legacy checkpoint without args (as megatron's own state dicts are saved) whose
    stages hold 3 + 1 layers: the split is inferred from the rank files."""
    mg = converters.hf_to_megatron(hf_models["llama"], tmp_path / "mg", tp=1, pp=2, first_stage_layers=3)
    for f in (mg / "release").glob(f"mp_rank_*/{RANK_FILE}"):
        ck = torch.load(f, weights_only=False)
        del ck["args"]
        torch.save(ck, f)
    out = converters.megatron_to_hf(mg, tmp_path / "hf", hf_config=hf_models["llama"])
    assert_identical(hf_models["llama"], out)


def test_args_holding_megatron_enums_are_read(hf_models, tmp_path):
    """Megatron-LM's args carry megatron's own enums: reading them needs megatron's allow-list
    for weights_only loading, which is asked for only then."""
    from megatron.core.enums import ModelType

    mg = converters.hf_to_megatron(hf_models["llama"], tmp_path / "mg", tp=1, pp=1)
    f = mg / "release/mp_rank_00" / RANK_FILE
    ck = torch.load(f, weights_only=False)
    ck["args"].model_type = ModelType.encoder_or_decoder
    torch.save(ck, f)
    assert_identical(hf_models["llama"], converters.megatron_to_hf(mg, tmp_path / "hf"))
