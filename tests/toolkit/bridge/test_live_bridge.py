"""toolkit.bridge on a live sharded model, in ONE torchrun launch of 4 CPU ranks
(tests/support/bridge_worker.py): Qwen2 (tied embeddings: the last stage's copy, q/k/v biases) at
tp=2 x pp=2 with 2 virtual chunks per stage, Qwen3-MoE (untied, q/k norms, bf16 file into an fp32 model) at
pp=2 x ep=2 (dense weights data-parallel over the ep ranks). For each:
- loading the HF folder into the model built from it gives transformers' logits within 1e-5;
- after every weight is changed, export_hf's tensors (and save_hf's folder) equal bit for bit
  what the converters' megatron_to_hf makes of megatron-core's own torch_dist save of the same
  live model, in the converters' order; export_hf(dst="all") gives every rank the same bytes;
- Qwen2 built as the runtime builds it under ZeRO-3 (tp=2, every parameter partitioned over the
  2 data-parallel ranks by deepspeed.zero.Init): load_hf writes the partitions and export_hf,
  gathering them, gives back the HF file byte for byte;
- examples/bridge_rl_loop.py on the same 4 ranks: the runtime trains 3 steps under ZeRO-3 (each
  parameter partitioned over the 4 ranks), export_hf streams the weights from the DeepSpeed engine
  into a transformers model in a spawned process, whose logits equal the training model's within
  1e-5 (the example exits 1 otherwise).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from converters.mapping import ModelMap
from converters.parity import hf_logits, max_diff, sample_tokens
from tests.conftest import SUPPORT, subprocess_env
from tests.support.convert_models import VOCAB, make_hf
from toolkit.models import read_hf_config, shape_from_hf

pytestmark = pytest.mark.multirank

CASES = {"qwen2": {"tp": 2, "pp": 2, "vpp": 2}, "qwen3_moe": {"pp": 2, "ep": 2}}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge")
    jobs = []
    for name, layout in CASES.items():
        out = root / f"out-{name}"
        out.mkdir()
        jobs.append({"hf": str(make_hf(name, root / name)), "layout": layout, "out": str(out)})
    (root / "out-zero3").mkdir()
    jobs.append({"hf": str(root / "qwen2"), "layout": {"tp": 2}, "out": str(root / "out-zero3"), "zero3": True})
    (root / "out-example").mkdir()
    jobs.append({"example": True, "out": str(root / "out-example")})
    (root / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                        str(SUPPORT / "bridge_worker.py"), str(root / "jobs.json")],
                       check=False, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_load_gives_transformers_logits(launched, name):
    got = torch.load(launched / f"out-{name}" / "logits.pt", weights_only=True)
    diff = max_diff(got, hf_logits(launched / name, sample_tokens(VOCAB)))
    print(f"{name} {CASES[name]}: max|dlogit| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_export_equals_converters(launched, name):
    result = json.loads((launched / f"out-{name}" / "result.json").read_text())
    assert result["built_as_said"]  # transformer_config / layer_specs describe the chunks build_model gave
    shape = shape_from_hf(read_hf_config(launched / name))
    assert result["order"] == list(ModelMap(shape, 512).hf_shapes)  # the documented order
    assert sorted(result["order"]) == result["converted"]
    assert result["changed_from_file"]  # the weights exported are not the file loaded
    assert result["export_differs"] == []
    assert result["bucket_order"] == result["order"] and result["bucket_differs"] == []
    assert result["save_differs"] == []
    assert result["all_ranks_equal"]


def test_zero3_partitions_load_and_export(launched):
    result = json.loads((launched / "out-zero3" / "result.json").read_text())
    assert result["partitioned"]
    assert len(result["order"]) == len(ModelMap(shape_from_hf(read_hf_config(launched / "qwen2")), 512).hf_shapes)
    assert result["export_differs"] == []


def test_rl_loop_example_reaches_transformers(launched):
    result = json.loads((launched / "out-example" / "result.json").read_text())
    line = re.search(r"zero=3 losses=\[(.*)\] max\|dlogit\| training vs transformers = (\S+)", result["printed"])
    assert line, result["printed"]
    print(line.group(0))
    losses = [float(x) for x in line.group(1).split(",")]
    assert losses[-1] < losses[0]  # it trained: the weights exported are not the initial ones
    assert float(line.group(2)) <= 1e-5
    assert result["code"] == 0
