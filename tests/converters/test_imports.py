"""What a conversion imports (issue 13's start-up item): the weights are moved as bytes,
so no command imports transformers (config.json is read as JSON), deepspeed or megatron;
HF -> legacy Megatron imports no torch either (the torch.save files are laid out without
it), nor, since issue 44, does anything torch_dist: DCP's .metadata is pickled without torch
(converters.formats.dcp_pickle) and torch pickles and DCP metadata are read without it
(converters.formats.torch_unpickle). One fresh interpreter per group of commands, through
the CLI; benchmarks/convert_bench.py measures the time from spawn to the first byte read."""
from __future__ import annotations

import json
import subprocess
import sys

from converters.dtypes import float32
from converters.synthetic import write_hf_checkpoint

from tests.conftest import subprocess_env
from tests.support.convert_memory_worker import CONFIG

HEAVY = ("torch", "transformers", "deepspeed", "megatron")
PROBE = """
import json, sys
from toolkit.cli import main
codes = [main(argv) for argv in {commands!r}]
print("PROBE " + json.dumps([codes, sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))]))
"""


def heavy_imports(*commands: list[str]) -> tuple[list[int], list[str]]:
    """(exit codes, heavy packages imported) of these commands run in turn in one interpreter."""
    r = subprocess.run([sys.executable, "-c", PROBE.format(commands=list(commands), heavy=HEAVY)],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    assert line, r.stderr[-2000:]
    codes, heavy = json.loads(line[0][len("PROBE "):])
    return codes, heavy


def test_conversions_import_only_what_they_use(tmp_path):
    """Also DeepSeek-V3 (MLA, experts, its settings checked against transformers' defaults
    read as JSON); only FP8 dequantisation needs torch there."""
    from tests.support.deepseek_models import hf_config

    hf, ds = tmp_path / "hf", tmp_path / "ds"
    write_hf_checkpoint(hf, dict(CONFIG, num_hidden_layers=2), dtype=float32)
    write_hf_checkpoint(ds, hf_config("deepseek_v3"), dtype=float32)
    layout = ["--tp", "2", "--pp", "1"]
    assert heavy_imports(["convert", "hf-to-megatron", str(hf), str(tmp_path / "t"), *layout],
                         ["convert", "hf-to-megatron", str(ds), str(tmp_path / "ds-t"), *layout]) == ([0, 0], [])
    to_dist = ["convert", "hf-to-megatron", str(hf), str(tmp_path / "d"), *layout, "--format", "torch_dist"]
    assert heavy_imports(to_dist,
                         ["convert", "megatron-to-megatron", str(tmp_path / "t"), str(tmp_path / "r"), "--tp", "1",
                          "--pp", "2"],
                         ["convert", "megatron-to-megatron", str(tmp_path / "d"), str(tmp_path / "d2"), "--tp", "1"],
                         ["convert", "megatron-to-hf", str(tmp_path / "d"), str(tmp_path / "h")],
                         ["convert", "megatron-to-hf", str(tmp_path / "ds-t"), str(tmp_path / "ds-h")]) \
        == ([0, 0, 0, 0, 0], [])


def test_public_names_stay_what_they_name_after_every_module_is_loaded():
    """The package imports its public names lazily; a submodule of the same name as one of them
    would replace it as the package's attribute once loaded (`from converters import X` then gives
    the module, and calling it fails only inside a run-state export, as CI once saw)."""
    code = ("import importlib, pkgutil, types, converters\n"
            "for m in pkgutil.walk_packages(converters.__path__, 'converters.'):\n"
            "    importlib.import_module(m.name)\n"
            "print('BAD', [n for n in converters.__all__ if isinstance(getattr(converters, n), types.ModuleType)\n"
            "             or not callable(getattr(converters, n))])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert "BAD []" in r.stdout, r.stdout + r.stderr[-2000:]
