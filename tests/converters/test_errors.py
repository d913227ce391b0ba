"""Bad input: each case is a one-line error naming the problem, a non-zero exit, and
nothing written (no OUT_DIR, no partial folder beside it)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import converters
from converters.errors import (
    CheckpointError,
    CorruptFileError,
    LayoutMismatchError,
    MissingTensorError,
    TensorShapeError,
)
from converters.formats.torch_legacy import RANK_FILE
from toolkit.cli import main
from toolkit.errors import OutputExistsError, PlanError
from toolkit.models import UnsupportedArchitectureError

from tests.support.convert_models import make_hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf("llama", tmp_path_factory.mktemp("err") / "llama")


@pytest.fixture
def copy(tmp_path, llama):
    def make(edit=None):
        d = tmp_path / "hf"
        shutil.copytree(llama, d)
        if edit:
            tensors = load_file(d / "model.safetensors")
            edit(tensors)
            save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        return d

    return make


def nothing_written(out) -> bool:
    return not out.exists() and not any(p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())


def cli_error(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


# ----------------------------------------------------------------------------- command line
def test_unsupported_architecture(capsys, copy, tmp_path):
    d = copy()
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    code, err = cli_error(capsys, ["convert", "hf-to-megatron", str(d), str(tmp_path / "out"), "--tp", "1", "--pp", "1"])
    assert code == 2 and len(err.splitlines()) == 1
    assert "unsupported architecture 'GPT2LMHeadModel'" in err and "LlamaForCausalLM, MistralForCausalLM" in err
    assert nothing_written(tmp_path / "out")


def test_tp_not_dividing_heads_or_groups(capsys, llama, tmp_path):
    code, err = cli_error(capsys, ["convert", "hf-to-megatron", str(llama), str(tmp_path / "o"), "--tp", "3", "--pp", "1"])
    assert code == 2 and "--tp 3 does not divide num_attention_heads=4" in err and len(err.splitlines()) == 1
    with pytest.raises(PlanError, match="tp=4 does not divide num_query_groups=2"):
        converters.hf_to_megatron(llama, tmp_path / "o", tp=4, pp=1)
    assert nothing_written(tmp_path / "o")


def test_pp_not_dividing_layers(llama, tmp_path):
    with pytest.raises(PlanError, match="pp=3 does not divide num_layers=4"):
        converters.hf_to_megatron(llama, tmp_path / "o", tp=1, pp=3)
    with pytest.raises(PlanError, match="vpp=4 does not divide the 2 layers per pipeline stage"):
        converters.hf_to_megatron(llama, tmp_path / "o", tp=1, pp=2, vpp=4)
    assert nothing_written(tmp_path / "o")


def test_layout_errors_name_the_command_line_flags(capsys, llama, tmp_path):
    """The rules speak the spec's keys (pp=3, parallel.first_stage_layers); the command line
    says its own flags (issue 37: `convert --pp 3` named spec keys)."""
    cases = {("--pp", "5"): "--pp 5 is larger than num_layers=4",
             ("--pp", "2", "--vpp", "4"): "--vpp 4 does not divide the 2 layers per pipeline stage",
             ("--pp", "3"): "--pp 3 does not divide num_layers=4; set --first-stage-layers / --last-stage-layers",
             ("--pp", "2", "--vpp", "2", "--first-stage-layers", "1"): "--vpp 2 does not divide --first-stage-layers 1"}
    for flags, message in cases.items():
        code, err = cli_error(capsys, ["convert", "hf-to-megatron", str(llama), str(tmp_path / "o"), *flags])
        assert code == 2 and len(err.splitlines()) == 1 and message in err, (flags, err)
        assert not re.search(r"(?<![-\w])(tp|pp|vpp)=|_stage_layers|parallel\.", err), err
    assert nothing_written(tmp_path / "o")


def test_out_dir_exists(capsys, llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = cli_error(capsys, ["convert", "hf-to-megatron", str(llama), str(out), "--tp", "1", "--pp", "1"])
    assert code == 1 and "already exists (pass --overwrite to replace it)" in err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["convert", "hf-to-megatron", str(llama), str(out), "--tp", "1", "--pp", "1", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "release").is_dir()


def test_legacy_rank_missing(capsys, llama, tmp_path):
    mg = converters.hf_to_megatron(llama, tmp_path / "mg", tp=2, pp=2)
    shutil.rmtree(mg / "release/mp_rank_01_001")
    code, err = cli_error(capsys, ["convert", "megatron-to-hf", str(mg), str(tmp_path / "hf")])
    assert code == 1 and "missing rank folder(s) for tp=2 pp=2 vpp=1: mp_rank_01_001" in err
    assert nothing_written(tmp_path / "hf")


# ----------------------------------------------------------------------------- library
def test_missing_tensor(copy, tmp_path):
    d = copy(lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError, match="missing tensor: model.layers.2.mlp.up_proj.weight"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)
    assert nothing_written(tmp_path / "o")


def test_wrong_shape(copy, tmp_path):
    d = copy(lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(TensorShapeError, match=r"'model.layers.1.self_attn.k_proj.weight' has shape \[16, 64\], "
                                               r"expected \[32, 64\]"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)
    assert nothing_written(tmp_path / "o")


def test_unexpected_hf_tensor(copy, tmp_path):
    d = copy(lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)


def test_truncated_and_corrupt_safetensors(copy, tmp_path):
    d = copy()
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-1000])
    with pytest.raises(CorruptFileError, match="is truncated or corrupt: tensor '.*' ends at byte"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)
    f.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CorruptFileError, match="header is not JSON"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(CorruptFileError, match="only 2 bytes"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)
    assert nothing_written(tmp_path / "o")


def test_index_names_missing_shard(llama, tmp_path):
    mg = converters.hf_to_megatron(llama, tmp_path / "mg", tp=1, pp=1)
    hf = converters.megatron_to_hf(mg, tmp_path / "hf", max_shard_size=200_000)
    shards = sorted(hf.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"index.json names shard '{shards[1].name}', which is not in"):
        converters.hf_to_megatron(hf, tmp_path / "o", tp=1, pp=1)
    assert nothing_written(tmp_path / "o")


def test_args_and_files_disagree_on_tp(llama, tmp_path):
    """A legacy checkpoint whose args say tp=1 but which has two tensor-parallel folders."""
    mg = converters.hf_to_megatron(llama, tmp_path / "mg", tp=2, pp=1)
    for f in (mg / "release").glob(f"*/{RANK_FILE}"):
        ck = torch.load(f, weights_only=False)
        ck["args"].tensor_model_parallel_size = 1
        torch.save(ck, f)
    with pytest.raises(LayoutMismatchError, match="args say tp=1 pp=1 vpp=1 but the checkpoint has rank folder"):
        converters.megatron_to_hf(mg, tmp_path / "hf")
    assert nothing_written(tmp_path / "hf")


def test_corrupt_legacy_file_and_no_args(llama, tmp_path):
    mg = converters.hf_to_megatron(llama, tmp_path / "mg", tp=1, pp=1)
    f = mg / "release/mp_rank_00" / RANK_FILE
    ck = torch.load(f, weights_only=False)
    torch.save({k: v for k, v in ck.items() if k != "args"}, f)
    shutil.rmtree(mg / "hf")  # nor the side folder's config.json
    from converters.errors import ConversionSetupError

    with pytest.raises(ConversionSetupError, match="no args and no hf/config.json beside it; pass --hf-config"):
        converters.megatron_to_hf(mg, tmp_path / "hf")
    f.write_bytes(b"garbage")
    with pytest.raises(CorruptFileError, match="is not a readable torch checkpoint"):
        converters.megatron_to_hf(mg, tmp_path / "hf", hf_config=llama)
    assert nothing_written(tmp_path / "hf")


def test_output_exists_library(llama, tmp_path):
    with pytest.raises(OutputExistsError):
        converters.hf_to_megatron(llama, tmp_path, tp=1, pp=1)


def test_unsupported_architecture_in_family_registry(copy, tmp_path):
    """Refused before anything reads the config as that model (every family the planner
    knows is converted now, DeepSeek included: an architecture neither knows)."""
    d = copy()
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError, match="unsupported architecture 'GPTNeoXForCausalLM' for conv.*"
                                                           "DeepseekV3ForCausalLM"):
        converters.hf_to_megatron(d, tmp_path / "o", tp=1, pp=1)
