"""The planning commands import neither torch nor transformers nor deepspeed nor
megatron: a user waits for arithmetic, not for GPU libraries (benchmarks/startup_bench.py
measures the times). One fresh interpreter runs the commands in turn and reports, after
each, which heavy packages are loaded."""
import json
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env

HEAVY = ("torch", "transformers", "deepspeed", "megatron")
PROBE = """
import json, sys
from toolkit.cli import main
heavy, seen = {heavy!r}, {{}}
for argv in {commands!r}:
    code = main(argv)
    seen[" ".join(argv)] = [code, sorted(m for m in sys.modules if m.split(".")[0] in heavy)]
print("PROBE " + json.dumps(seen))
"""


def test_plan_config_models_import_no_heavy_library(tmp_path):
    seed = str(ROOT / "examples/llama70b_1024gpu.yaml")
    spec405 = tmp_path / "405b.yaml"
    spec405.write_text("model: llama3.1-405b\ncluster: {nodes: 128, gpus_per_node: 8, gpu: h100-80gb}\n"
                       "batch: {global: 2048, seq_len: 8192}\n")
    corpus = str(ROOT / "toolkit/runtime/corpus/tiny_corpus.txt")
    commands = [["--help"], ["plan", seed], ["plan", seed, "--json"], ["config", seed, "--out", str(tmp_path / "c")],
                ["models"], ["gpus"], ["plan", str(spec405), "--auto", "--top", "2"],
                ["plan", seed, "--set", "parallel.tp=3"], ["--version"],
                # its arguments are checked before torch, transformers and megatron load (issue 37: 6.5 s and 8
                # lines of megatron's warnings before "tokenizer folder does not exist")
                ["data", "prepare", corpus, "--tokenizer", "nope", "--out", str(tmp_path / "d")]]
    r = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY, commands=commands)], capture_output=True,
                       text=True, env=subprocess_env(), timeout=300, cwd=tmp_path)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    assert line, r.stderr[-2000:]
    seen = json.loads(line[0][len("PROBE "):])
    assert [code for code, _ in seen.values()] == [0, 0, 0, 0, 0, 0, 0, 2, 0, 3]
    assert {cmd: mods for cmd, (_, mods) in seen.items() if mods} == {}
    assert r.stderr.splitlines()[-1] == "error: tokenizer folder 'nope' does not exist"
