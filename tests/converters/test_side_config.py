"""Issue 19, items 4 and 5: ``toolkit verify`` compares the two models first and names the
difference in one line (exit 1, no megatron run, no traceback); a checkpoint without args
is described by the ``hf/config.json`` beside it (what hf_to_megatron and the training
runtime write: ``checkpoints/global_stepN/model/hf/``) in every converter, and ``verify``
falls back to HF_DIR's config.json."""
from __future__ import annotations

import shutil

import pytest
import torch

import converters
from converters.dtypes import float32
from converters.formats.torch_legacy import RANK_FILE
from converters.synthetic import write_hf_checkpoint
from toolkit.cli import main

from tests.support.convert_memory_worker import CONFIG
from tests.converters.test_roundtrip import assert_identical, read_all


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("side") / "hf"
    write_hf_checkpoint(d, dict(CONFIG, num_hidden_layers=2, vocab_size=320, dtype="float32"), dtype=float32)
    (d / "generation_config.json").write_text("{}\n")
    return d


def strip_args(mg, fmt: str) -> None:
    """The checkpoint as megatron-core alone writes it: no Megatron-LM args."""
    if fmt == "torch":
        for f in (mg / "release").glob(f"*/{RANK_FILE}"):
            ck = torch.load(f, weights_only=False)
            torch.save({k: v for k, v in ck.items() if k != "args"}, f)
    else:
        torch.save({"checkpoint_version": 3.0, "iteration": 0}, mg / "release" / "common.pt")


def test_verify_names_the_difference_in_one_line(hf, tmp_path, capsys):
    other = tmp_path / "hf512"
    write_hf_checkpoint(other, dict(CONFIG, num_hidden_layers=2, vocab_size=512), dtype=float32)
    mg = converters.hf_to_megatron(other, tmp_path / "mg")
    assert main(["verify", str(hf), str(mg)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: '{hf}' and '{mg}' hold different models: vocab_size 320 vs 512 (HF vs checkpoint)\n"


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_side_folder_describes_a_checkpoint_without_args(hf, tmp_path, fmt):
    mg = converters.hf_to_megatron(hf, tmp_path / "mg", tp=2, pp=2, fmt=fmt)
    strip_args(mg, fmt)
    assert_identical(hf, converters.megatron_to_hf(mg, tmp_path / "back"))
    re = converters.megatron_to_megatron(mg, tmp_path / "re", tp=1, pp=1, fmt="torch")
    assert_identical(hf, converters.megatron_to_hf(re, tmp_path / "back2"))


def test_the_training_runtimes_model_folder_converts_as_it_is(hf, tmp_path):
    """checkpoints/global_stepN/model/: torch_dist files with no args, hf/config.json inside."""
    mg = converters.hf_to_megatron(hf, tmp_path / "mg", fmt="torch_dist")
    strip_args(mg, "torch_dist")
    model = tmp_path / "global_step7" / "model"
    shutil.copytree(mg / "release", model)
    shutil.copytree(mg / "hf", model / "hf")
    assert main(["convert", "megatron-to-hf", str(model), str(tmp_path / "exported")]) == 0
    assert_identical(hf, tmp_path / "exported")


def test_verify_uses_hf_dirs_config_when_the_checkpoint_has_none(hf, tmp_path, monkeypatch):
    """No args, no side folder: HF_DIR's config.json describes the checkpoint, in this process
    and for the megatron run (given its path; the run itself is checked in the parity tests)."""
    import converters.parity as parity

    mg = converters.hf_to_megatron(hf, tmp_path / "mg", fmt="torch_dist")
    strip_args(mg, "torch_dist")
    shutil.rmtree(mg / "hf")
    jobs = []

    def megatron_logits(got, nproc, timeout=0):
        jobs.extend(got)
        return [parity.hf_logits(hf, parity.sample_tokens(320))]

    monkeypatch.setattr(parity, "megatron_logits", megatron_logits)
    assert converters.verify(hf, mg) == 0.0
    assert jobs == [{"megatron_dir": str(mg), "hf_config": str(hf)}]
    assert read_all(hf)  # the folder is a real model


def test_model_differences_name_multi_latent_attention_sizes():
    """DeepSeek models differ in their latent sizes too; each is named (HF vs checkpoint)."""
    from converters.parity import model_differences
    from toolkit.models import shape_from_hf

    from tests.support.deepseek_models import hf_config

    v3 = hf_config("deepseek_v3")
    other = dict(v3, kv_lora_rank=v3["kv_lora_rank"] * 2)
    assert model_differences(shape_from_hf(v3), shape_from_hf(v3)) == []
    assert model_differences(shape_from_hf(v3), shape_from_hf(other)) == \
        [f"mla.kv_lora_rank {v3['kv_lora_rank']} vs {2 * v3['kv_lora_rank']}"]
    assert "multi-latent attention yes vs no" in model_differences(shape_from_hf(v3), shape_from_hf(CONFIG))
