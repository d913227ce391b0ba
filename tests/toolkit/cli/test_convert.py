"""`toolkit convert ...` end to end (in-process and as `python -m toolkit`)."""
from __future__ import annotations

import subprocess
import sys

from toolkit.cli import main

from tests.conftest import subprocess_env
from tests.support.convert_models import make_hf
from tests.converters.test_roundtrip import assert_identical


def test_convert_commands_chain(tmp_path, capsys):
    hf = make_hf("qwen2", tmp_path / "hf")
    mg, re, back = tmp_path / "mg", tmp_path / "re", tmp_path / "back"
    assert main(["convert", "hf-to-megatron", str(hf), str(mg), "--tp", "2", "--pp", "2", "--vpp", "1"]) == 0
    assert main(["convert", "megatron-to-megatron", str(mg), str(re), "--tp", "1", "--pp", "2", "--vpp", "2"]) == 0
    assert main(["convert", "megatron-to-hf", str(re), str(back), "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == 3 and "GiB in" in out
    assert_identical(hf, back)


def test_torch_dist_from_python_m_toolkit(tmp_path):
    """megatron's checkpoint writer starts helper processes with spawn, which re-imports
    __main__: `python -m toolkit` must survive that."""
    hf = make_hf("llama", tmp_path / "hf")
    r = subprocess.run([sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(hf), str(tmp_path / "mg"),
                        "--tp", "2", "--pp", "1", "--format", "torch_dist"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "mg/release/metadata.json").is_file() and (tmp_path / "mg/hf/config.json").is_file()
