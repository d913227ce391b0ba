"""The recipes' command line (toolkit.runtime.train): default run folders, --help text."""
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.runtime.train import default_run_dir, single_process_env

from .conftest import ROOT, subprocess_env


@pytest.mark.parametrize("name, sets, want", [
    ("llama70b-tiny", [], "runs/llama70b-tiny"),
    ("llama8b-tiny", [], "runs/llama8b-tiny"),
    ("llama70b-tiny", ["parallel.tp=2"], "runs/llama70b-tiny-tp2"),
    ("llama8b-tiny", ["zero.stage=3", "zero.offload_optimizer=cpu"], "runs/llama8b-tiny-stage3-offload_optimizer-cpu"),
    ("spec", ["optimizer.lr=1e-3", "moe.aux_loss_coeff=null"], "runs/spec-lr-1e-3-aux_loss_coeff-null"),
])
def test_default_run_folder_per_recipe_flavour_and_layout(name, sets, want):
    assert default_run_dir(name, sets) == Path(want)


def test_no_launcher_means_one_local_rank(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    note = single_process_env("deepspeed --num_gpus N recipes/llama8b.py --flavor tiny")
    import os

    assert note.startswith("note: no launcher") and "deepspeed --num_gpus N recipes/llama8b.py" in note
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert single_process_env("x") is None  # under a launcher (RANK set) nothing changes


def test_recipe_help_is_the_whole_docstring():
    r = subprocess.run([sys.executable, str(ROOT / "recipes/llama70b.py"), "--help"], capture_output=True, text=True,
                       env=subprocess_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Megatron-Bridge's published layout for this job" in r.stdout  # from the docstring's middle
    assert "--set parallel.vpp=2`." in r.stdout  # and its last line
    assert "runs/llama70b-tiny-tp2" in r.stdout and "trains on this one process" in r.stdout
