"""What a conversion imports (issue 13's start-up item): the weights are moved as bytes,
so no command imports transformers (config.json is read as JSON), deepspeed or megatron;
HF -> legacy Megatron imports no torch either (the torch.save files are laid out without
it). torch is needed where torch's own code is the format: torch_dist's DCP metadata, and
reading torch pickles (export and reshard). One fresh interpreter per command, through the
CLI; benchmarks/convert_bench.py --startup measures the time to the first byte read."""
from __future__ import annotations

import json
import subprocess
import sys

from converters.dtypes import float32
from converters.synthetic import write_hf_checkpoint

from .conftest import subprocess_env
from .convert_memory_worker import CONFIG

HEAVY = ("torch", "transformers", "deepspeed", "megatron")
PROBE = """
import json, sys
from toolkit.cli import main
code = main({argv!r})
print("PROBE " + json.dumps([code, sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))]))
"""


def heavy_imports(argv: list[str]) -> tuple[int, list[str]]:
    r = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv, heavy=HEAVY)], capture_output=True, text=True,
                       env=subprocess_env(), timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    assert line, r.stderr[-2000:]
    return tuple(json.loads(line[0][len("PROBE "):]))


def test_conversions_import_only_what_they_use(tmp_path):
    hf = tmp_path / "hf"
    write_hf_checkpoint(hf, dict(CONFIG, num_hidden_layers=2), dtype=float32)
    layout = ["--tp", "2", "--pp", "1"]
    assert heavy_imports(["convert", "hf-to-megatron", str(hf), str(tmp_path / "t"), *layout]) == (0, [])
    assert heavy_imports(["convert", "hf-to-megatron", str(hf), str(tmp_path / "d"), *layout,
                          "--format", "torch_dist"]) == (0, ["torch"])
    assert heavy_imports(["convert", "megatron-to-megatron", str(tmp_path / "t"), str(tmp_path / "r"), "--tp", "1",
                          "--pp", "2"]) == (0, ["torch"])
