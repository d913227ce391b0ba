"""--stages: a checkpoint converted a few pipeline stages at a time into one folder
(converters.staged) is, once every stage is in, the whole conversion: legacy, byte for byte;
torch_dist, the same tensors as megatron-core's dist_checkpointing reads them. Until then every
reader refuses it naming the missing stages.

That the whole conversion is right is proven against megatron-core's GPTModel in
tests/converters/test_parity.py (multi-rank); these tests prove the staged folder is the same,
and read it back through the converters' own reader to the original HF bits.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import converters
from converters.dtypes import float32
from converters.errors import CheckpointError, ConversionSetupError
from converters.staged import STAGING, missing_stages
from converters.synthetic import write_hf_checkpoint
from toolkit.errors import OutputExistsError

from tests.converters.test_roundtrip import read_all
from tests.support.convert_models import hf_config

# (pp, vpp, split): even pp 2; pp 4 with vpp 2 (interleaved chunks); an uneven split (5 + 3 layers)
LAYOUTS = [(2, 1, {}), (4, 2, {}), (2, 1, {"first_stage_layers": 5})]


@pytest.fixture(autouse=True)
def fixed_serialization_id(monkeypatch):
    """torch.save gives every file 40 random digits (``.data/serialization_id``, which torch.load
    only logs) and so does the legacy writer (formats.torch_zip): two whole conversions of one
    model differ in those bytes and their CRC-32s only. Held fixed here, so that every other byte
    is compared."""
    from converters.formats import torch_zip

    monkeypatch.setattr(torch_zip, "serialization_id", lambda: "0" * 40)


# Qwen2 (tied embeddings: the last stage holds the output layer) with 8 layers, so that pp 4 x vpp 2 is a layout
QWEN2_8 = {"qwen2": ("qwen2-tiny", {"num_hidden_layers": 8, "layer_types": ["full_attention"] * 8}, torch.float32)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Random weights of the real shapes (converters.synthetic: no transformers needed to make them)."""
    root = tmp_path_factory.mktemp("hf")
    out = {"qwen2": hf_config("qwen2", QWEN2_8), "mixtral": hf_config("mixtral")}
    out = {name: dict(cfg, dtype="float32") for name, cfg in out.items()}  # as the export writes it
    for name, cfg in out.items():
        write_hf_checkpoint(root / name, cfg, float32)
    return {name: root / name for name in out}


@pytest.fixture(scope="module")
def hf(models):
    return models["qwen2"]


def same_weights(a, b) -> None:
    """The HF folders hold the same tensors (names, dtypes, values) and config."""
    x, y = read_all(a), read_all(b)
    assert sorted(x) == sorted(y)
    assert all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def files(d) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(r, n), d): open(os.path.join(r, n), "rb").read()
            for r, _, names in os.walk(d) for n in names}


@pytest.mark.parametrize("pp,vpp,split", LAYOUTS)
def test_stages_in_any_order_are_the_whole_conversion(hf, tmp_path, pp, vpp, split):
    whole = files(converters.hf_to_megatron(hf, tmp_path / "whole", tp=2, pp=pp, vpp=vpp, **split))
    for order in (list(range(pp)), list(reversed(range(pp)))):
        out = tmp_path / f"staged-{'-'.join(map(str, order))}"
        for k in order:
            assert not (out / "latest_checkpointed_iteration.txt").exists()
            converters.hf_to_megatron(hf, out, tp=2, pp=pp, vpp=vpp, stages=str(k), **split)
        assert files(out) == whole
        same_weights(hf, converters.megatron_to_hf(out, tmp_path / f"hf-{out.name}"))


def test_expert_parallel_stages(models, tmp_path):
    """Mixtral at pp 2 x ep 2 x tp 2 (rank folders mp_rank_TT_PPP_EEE), stages 1 then 0."""
    kw = dict(tp=2, pp=2, ep=2)
    whole = files(converters.hf_to_megatron(models["mixtral"], tmp_path / "whole", **kw))
    for k in (1, 0):
        converters.hf_to_megatron(models["mixtral"], tmp_path / "staged", stages=str(k), **kw)
    assert files(tmp_path / "staged") == whole
    assert any(n.startswith("release/mp_rank_01_001_001/") for n in whole)
    same_weights(models["mixtral"], converters.megatron_to_hf(tmp_path / "staged", tmp_path / "back"))


def plain_tensors(folder) -> dict:
    """Every tensor of a torch_dist folder as megatron-core's dist_checkpointing.load_plain_tensors
    reads it (one process, a gloo group of one)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    from toolkit.mcore import cpu_compat

    cpu_compat.apply()
    register_safe_globals()  # common.pt holds an argparse.Namespace, as Megatron-LM's does
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return dist_checkpointing.load_plain_tensors(str(folder / "release"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,layout", [("qwen2", dict(tp=2, pp=2)), ("qwen2", dict(tp=1, pp=4, vpp=2)),
                                         ("mixtral", dict(tp=2, pp=2, ep=2))])
def test_torch_dist_stages_load_as_the_whole_conversion(models, tmp_path, name, layout):
    """torch_dist: each stage writes its own .distcp files (__K_i.distcp) and chunk list; the
    finishing command writes the one .metadata from them. megatron-core's load_plain_tensors
    reads the same tensors as from the whole conversion; the other files are the same bytes."""
    whole = converters.hf_to_megatron(models[name], tmp_path / "whole", fmt="torch_dist", **layout)
    out = tmp_path / "staged"
    for k in reversed(range(layout["pp"])):
        converters.hf_to_megatron(models[name], out, fmt="torch_dist", stages=str(k), **layout)
    a, b = plain_tensors(whole), plain_tensors(out)
    assert sorted(a) == sorted(b) and len(a) > 10
    assert all(not isinstance(a[k], torch.Tensor) or (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])) for k in a)
    kept = lambda fs: {n: v for n, v in fs.items() if not n.endswith((".distcp", ".metadata"))}  # noqa: E731
    assert kept(files(out)) == kept(files(whole))
    assert {n for n in files(out) if n.endswith(".distcp")} == {f"release/__{k}_0.distcp" for k in range(layout["pp"])}
    same_weights(models[name], converters.megatron_to_hf(out, tmp_path / "back"))


def test_commands_at_the_same_time(hf, tmp_path):
    """Four processes (as four hosts would), one stage each, started together: one plan, one
    side folder, and exactly one of them finishes the folder (the staging lock), which is the
    whole conversion."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Barrier(4), tmp_path / "mg"

    def one(k: int) -> None:
        start.wait()
        converters.hf_to_megatron(hf, out, tp=1, pp=4, stages=str(k))

    procs = [ctx.Process(target=one, args=(k,)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert files(out) == files(converters.hf_to_megatron(hf, tmp_path / "whole", tp=1, pp=4))


def test_ranges_and_the_missing_stages_readers_name(hf, tmp_path):
    out = tmp_path / "mg"
    converters.hf_to_megatron(hf, out, tp=1, pp=4, stages="1-2")
    assert missing_stages(out) == [0, 3]
    for read in (lambda: converters.megatron_to_hf(out, tmp_path / "hf"),
                 lambda: converters.megatron_to_megatron(out, tmp_path / "mm"),
                 lambda: __import__("toolkit.runtime.checkpoint_folder").runtime.checkpoint_folder.load_source(out)):
        with pytest.raises(CheckpointError, match=r"stage\(s\) 0, 3 of pp=4 are missing"):
            read()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "mm").exists()
    converters.hf_to_megatron(hf, out, tp=1, pp=4, stages="3")
    converters.hf_to_megatron(hf, out, tp=1, pp=4, stages=(0, 0))
    assert missing_stages(out) is None and not (out / STAGING).exists()
    assert files(out) == files(converters.hf_to_megatron(hf, tmp_path / "whole", tp=1, pp=4))


def test_refusals_leave_nothing_written(hf, tmp_path):
    out = tmp_path / "mg"
    for bad in ("5", "2-1", "x", "1-4"):
        with pytest.raises(ConversionSetupError, match="--stages"):
            converters.hf_to_megatron(hf, out, tp=1, pp=4, stages=bad)
    assert not out.exists()
    converters.hf_to_megatron(hf, out, tp=1, pp=2, stages="0")
    before = files(out)
    with pytest.raises(OutputExistsError, match=r"stage\(s\) 0 of .* converted already"):
        converters.hf_to_megatron(hf, out, tp=1, pp=2, stages="0")
    with pytest.raises(ConversionSetupError, match="with tensor_model_parallel_size=1.*; this command has "
                                                   "tensor_model_parallel_size=2"):
        converters.hf_to_megatron(hf, out, tp=2, pp=2, stages="1")
    with pytest.raises(ConversionSetupError, match="params_dtype"):
        converters.hf_to_megatron(hf, out, tp=1, pp=2, dtype="bf16", stages="1")
    assert files(out) == before
    converters.hf_to_megatron(hf, out, tp=1, pp=2, stages="0", overwrite=True)  # converted again: same bytes
    assert files(out) == before
    converters.hf_to_megatron(hf, out, tp=1, pp=2, stages="1")
    with pytest.raises(OutputExistsError, match="finished checkpoint already"):
        converters.hf_to_megatron(hf, out, tp=1, pp=2, stages="1", overwrite=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data").write_text("x")
    with pytest.raises(OutputExistsError, match="not an unfinished staged conversion"):
        converters.hf_to_megatron(hf, tmp_path / "other", tp=1, pp=2, stages="0")


def test_command_line(hf, tmp_path, capsys):
    """Exit 2 and one line for a range outside the layout (nothing written); each command says
    what is still missing; the readers (convert, verify) exit 1 naming the missing stages."""
    from toolkit.cli import main

    out = tmp_path / "mg"
    convert = ["convert", "hf-to-megatron", str(hf), str(out), "--tp", "1", "--pp", "4", "--stages"]
    assert main([*convert, "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--stages 5-5 is outside the layout: pp=4 has stages 0-3") and len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.iterdir())
    assert main([*convert, "0-1"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{out}: stage(s) 2, 3 still missing")
    assert main([*convert, "1"]) == 1
    assert "stage(s) 1 of" in capsys.readouterr().err
    for argv in (["convert", "megatron-to-hf", str(out), str(tmp_path / "hf")], ["verify", str(hf), str(out)]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert "unfinished staged conversion: stage(s) 2, 3 of pp=4 are missing" in err and len(err.splitlines()) == 1
    assert main([*convert, "2-3"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{out}: every stage is in; the checkpoint is finished")
    assert sorted(p.name for p in out.iterdir()) == ["hf", "latest_checkpointed_iteration.txt", "release"]


def test_a_finish_that_stopped_is_completed_by_converting_a_stage_again(hf, tmp_path, monkeypatch):
    """Every stage in, the finishing command killed after moving some files into release/:
    readers say so; converting any stage again with --overwrite finishes it, the same bytes."""
    from converters import staged

    out = tmp_path / "mg"
    monkeypatch.setattr(staged, "finish", lambda out, complete=None: False)  # the finishing command dies here
    for k in (0, 1):
        converters.hf_to_megatron(hf, out, tp=2, pp=2, stages=str(k))
    monkeypatch.undo()
    monkeypatch.setattr("converters.formats.torch_zip.serialization_id", lambda: "0" * 40)
    (out / "release").mkdir()
    moved = sorted((staged.stage_dir(out, 1) / "release").iterdir())[0]
    moved.rename(out / "release" / moved.name)  # half way through the renames
    with pytest.raises(CheckpointError, match="holds every stage but was not finished"):
        converters.megatron_to_hf(out, tmp_path / "hf")
    converters.hf_to_megatron(hf, out, tp=2, pp=2, stages="0", overwrite=True)
    assert files(out) == files(converters.hf_to_megatron(hf, tmp_path / "whole", tp=2, pp=2))
