"""Usage errors and exit codes through the installed `toolkit` script (the console entry
point a user runs), with whatever typer the environment carries: recent typer releases
vendor their own click (`typer._click`), whose exceptions `click.ClickException` does not catch."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.errors import EXIT_CODES, InputFileError, MissingInputError, PlanError, SpecError

from tests.conftest import ROOT, subprocess_env

SEED = str(ROOT / "examples/llama70b_1024gpu.yaml")
TOOLKIT = Path(sys.executable).parent / "toolkit"

USAGE_ERRORS = {
    "missing argument": ["plan"],
    "unknown option": ["plan", SEED, "--bogus"],
    "bad value": ["plan", SEED, "--top", "many"],
    "unknown command": ["plam", SEED],
    "unknown subcommand": ["convert", "hf-to-hf", "a", "b"],
    "missing option": ["data", "prepare", "in.jsonl", "--out", "x"],
}


def run_toolkit(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(TOOLKIT), *argv], capture_output=True, text=True, env=subprocess_env(), cwd=cwd,
                          timeout=120)


@pytest.mark.skipif(not TOOLKIT.is_file(), reason="no toolkit console script: the package is not installed here")
@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_error_is_one_line_and_exit_2(case):
    """One line naming what is wrong and the command whose --help shows the usage (click's own
    print was the usage, a hint and a 3-line box)."""
    r = run_toolkit(*USAGE_ERRORS[case])
    assert r.returncode == 2, (case, r.returncode, r.stderr[-1500:])
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert re.fullmatch(r"error: .+ \(`toolkit( \w[\w-]*)* --help` shows the usage\)\n", r.stderr), r.stderr


@pytest.mark.skipif(not TOOLKIT.is_file(), reason="no toolkit console script: the package is not installed here")
def test_usage_error_lines():
    assert run_toolkit("convert", "run-state").stderr == \
        "error: missing argument 'src' (`toolkit convert run-state --help` shows the usage)\n"
    assert run_toolkit("plam", SEED).stderr == \
        "error: no such command 'plam'. Did you mean 'plan'? (`toolkit --help` shows the usage)\n"
    r = run_toolkit("convert")  # a group without its command: the group's help, as click prints it
    assert r.returncode == 2 and "hf-to-megatron" in r.stdout and r.stderr == ""


@pytest.mark.skipif(not TOOLKIT.is_file(), reason="no toolkit console script: the package is not installed here")
def test_missing_inputs_exit_3_in_one_line(tmp_path):
    for argv in (["plan", "none.yaml"], ["convert", "hf-to-megatron", "no_hf", "out"],
                 ["verify", "no_hf", "no_ckpt"]):
        r = run_toolkit(*argv, cwd=tmp_path)
        assert r.returncode == 3, (argv, r.stderr[-1500:])
        assert r.stderr.count("\n") == 1 and "does not exist" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_exit_code_table_is_the_readme_table():
    """README's table lists exactly EXIT_CODES; the error classes use its codes."""
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", readme, flags=re.M))
    assert {int(k): v for k, v in rows.items()} == EXIT_CODES
    assert {SpecError.exit_code, PlanError.exit_code, InputFileError.exit_code, MissingInputError.exit_code} \
        <= set(EXIT_CODES)
