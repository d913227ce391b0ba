"""The recipes' command line (toolkit.cli.train): default run folders, --help text."""
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.cli.train import default_run_dir
from toolkit.mcore.rendezvous import single_process_env

from tests.conftest import ROOT, free_port, subprocess_env


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


def test_data_is_part_of_the_spec_that_runs():
    """--data is train.data_path in the spec a run writes to spec.yaml (issue 37: it said null)."""
    from toolkit.cli.train import build_spec, parser
    from toolkit.spec import TrainingSpec

    seed = TrainingSpec.from_yaml(ROOT / "examples/llama70b_1024gpu.yaml")
    args = parser(None).parse_args(["--spec", "s.yaml", "--data", "data/corpus", "--steps", "5"])
    spec = build_spec(args, lambda: seed, None)
    assert (spec.train.data_path, spec.train.steps, seed.train.data_path) == ("data/corpus", 5, None)


def test_out_help_says_configs_come_from_dry_run():
    from toolkit.cli.train import parser

    text = parser("llama8b").format_help()
    assert "(with --dry-run: configs/)" in " ".join(text.split())


def test_check_stops_at_missing_data_in_one_line(tmp_path):
    """--check (what the launch scripts run first) refuses a missing dataset with exit 3 and one
    line, before torch, DeepSpeed or megatron-core are imported by the entry point."""
    r = subprocess.run([sys.executable, "-m", "toolkit.cli.train", "--spec", str(ROOT / "examples/llama70b_1024gpu.yaml"),
                        "--data", str(tmp_path / "corpus"), "--check"], capture_output=True, text=True,
                       env=subprocess_env(), timeout=120)
    assert (r.returncode, r.stdout) == (3, "")
    assert r.stderr == f"error: dataset '{tmp_path / 'corpus'}.bin' does not exist (make it with `toolkit data prepare`)\n"
    (tmp_path / "corpus.bin").write_bytes(b"")
    (tmp_path / "corpus.idx").write_bytes(b"")
    r = subprocess.run([sys.executable, "-c", "import sys; from toolkit.cli.train import main; "
                        f"code = main(['--spec', {str(ROOT / 'examples/llama70b_1024gpu.yaml')!r}, '--data', "
                        f"{str(tmp_path / 'corpus')!r}, '--check']); "
                        "print(code, sorted(m for m in ('torch', 'deepspeed', 'megatron') if m in sys.modules))"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert r.stdout == "0 []\n", r.stderr[-2000:]


INTERRUPTED = """
import os, signal, sys, time
from toolkit.atomic import Interrupted
from toolkit.cli.train import main

def make_spec():
    try:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the run is being set up
        time.sleep(5)
    except Interrupted:
        if {library_error!r}:  # a library turns it into its own error, as gloo does when a peer rank left first
            raise RuntimeError("Connection closed by peer")
        raise
sys.exit(main([], make_spec=make_spec))
"""


@pytest.mark.parametrize("library_error", [False, True])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_ctrl_c_is_one_line_from_rank_0_and_exit_130(library_error, rank):
    """A run's Ctrl-C in one process (the launch is tests/toolkit/runtime/test_interrupt.py): rank 0 prints one
    line, other ranks nothing, no traceback, exit 130; an error the interrupt caused counts as
    the interrupt."""
    # its own MASTER_PORT: rank 0 checks the port first (rendezvous.check_master_port), and the worker's environment
    # carries whatever port an earlier test set. Both rank-0 cases once exited 1 in a -n 2 run (2026-11-29; their
    # stderr was not shown then, it is now); a port that was in use is the one rank-0-only step seen to exit so
    r = subprocess.run([sys.executable, "-c", INTERRUPTED.format(library_error=library_error)], capture_output=True,
                       text=True, env=subprocess_env(RANK=rank, WORLD_SIZE="2", MASTER_PORT=str(free_port())),
                       timeout=120)
    assert (r.returncode, r.stdout) == (130, ""), r.stderr[-3000:]
    assert r.stderr == ("interrupted by SIGINT before the first step\n" if rank == "0" else ""), r.stderr


def test_resume_is_one_command_for_every_start_and_excludes_load(capsys):
    """--resume picks the run folder's checkpoint itself (toolkit.runtime.checkpoint_folder.resume_point);
    with --load as well it is a usage error (exit 2), and its help names the preemption exit code."""
    from toolkit.cli.train import parser

    assert parser(None).parse_args(["--spec", "s.yaml", "--resume"]).resume
    with pytest.raises(SystemExit) as e:
        parser(None).parse_args(["--spec", "s.yaml", "--resume", "--load", "runs/a"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert "exit 4" in " ".join(parser(None).format_help().split())
