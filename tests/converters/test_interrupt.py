"""Interrupted and parallel conversions, with real processes and signals.

SIGTERM (what a scheduler sends at a time limit) and SIGINT stop a conversion in the
middle of writing with one line and the shell's exit code (143, 130), and leave nothing
behind (no OUT_DIR, no hidden partial folder), with one writer process or several. A run
killed outright (SIGKILL) cannot clean up; the next run for the same output removes its
partial folder and says so in one line, while a partial folder whose process still runs
is left alone. ``--workers 2`` writes the same checkpoint as one process, and a worker's
error reaches the caller as itself.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import converters
from converters.dtypes import float32
from converters.errors import CorruptFileError
from converters.jobs import FileJob, run
from converters.stream import Meter
from converters.synthetic import write_hf_checkpoint
from toolkit.atomic import remove_stale

from tests.conftest import SUPPORT, subprocess_env
from tests.support.convert_memory_worker import CONFIG


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("interrupt") / "hf"
    write_hf_checkpoint(d, dict(CONFIG, num_hidden_layers=4), dtype=float32)
    return d


def slow_cli(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """The convert command, writing slowly, started; returns once it has written a chunk."""
    flag = tmp_path / "flag"
    flag.unlink(missing_ok=True)
    p = subprocess.Popen([sys.executable, str(SUPPORT / "convert_slow_cli.py"), "convert", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=subprocess_env(SLOW_FLAG=str(flag)))
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "the conversion never started writing"
        time.sleep(0.02)
    return p, flag


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.partial-"))


def last_line(text: str) -> str:
    return text.replace("\r", "\n").strip().splitlines()[-1]


@pytest.mark.parametrize("sig,code,workers", [(signal.SIGTERM, 143, "2"), (signal.SIGINT, 130, "1")])
def test_signal_removes_the_partial_output(hf, tmp_path, sig, code, workers):
    out = tmp_path / "mg"
    p, _ = slow_cli(tmp_path, "hf-to-megatron", str(hf), str(out), "--tp", "2", "--pp", "1", "--workers",
                    workers)
    assert leftovers(tmp_path, "mg")  # it is writing
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == code, err[-2000:]
    assert "Traceback" not in err
    assert last_line(err) == f"interrupted by {signal.Signals(sig).name}: '{out}' was not written (its partial " \
                             "files are removed)"
    assert not out.exists() and leftovers(tmp_path, "mg") == []


def test_partial_folder_of_a_killed_run_is_removed_by_the_next(hf, tmp_path):
    out = tmp_path / "mg"
    p, _ = slow_cli(tmp_path, "hf-to-megatron", str(hf), str(out), "--tp", "1", "--pp", "1", "--format", "torch_dist")
    p.kill()
    p.communicate(timeout=60)
    [stale] = leftovers(tmp_path, "mg")
    r = subprocess.run([sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(hf), str(out),
                        "--tp", "1", "--pp", "1", "--format", "torch_dist"], capture_output=True, text=True,
                       env=subprocess_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    notes = [ln for ln in r.stderr.splitlines() if "no longer runs" in ln]
    assert notes == [f"removed '{tmp_path.resolve() / stale}', left by an earlier run for '{out.resolve()}' that no "
                     "longer runs"]
    assert leftovers(tmp_path, "mg") == [] and (out / "release" / ".metadata").is_file()


def test_partial_folder_of_a_live_process_is_left_alone(tmp_path):
    """Another process writing the same output (its folder's lock held) keeps its folder;
    once that process is gone, its folder is stale."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom toolkit.atomic import atomic_output_dir\n"
        f"with atomic_output_dir({str(tmp_path / 'out')!r}) as d:\n    print(d, flush=True)\n    time.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        partial = Path(holder.stdout.readline().strip())
        assert partial.is_dir()
        assert remove_stale((tmp_path / "out").resolve()) == [] and partial.is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale((tmp_path / "out").resolve()) == [partial] and not partial.exists()


def test_two_workers_write_what_one_writes(hf, tmp_path):
    """Bit-exact round trips with every step on two worker processes, both formats."""
    from tests.converters.test_roundtrip import read_all

    want = read_all(hf)
    for fmt in ("torch", "torch_dist"):
        mg = converters.hf_to_megatron(hf, tmp_path / f"mg-{fmt}", tp=2, pp=2, fmt=fmt, workers=2)
        re = converters.megatron_to_megatron(mg, tmp_path / f"re-{fmt}", tp=1, pp=2, workers=2)
        back = read_all(converters.megatron_to_hf(re, tmp_path / f"hf-{fmt}", workers=2, max_shard_size=4 << 20))
        assert len(list((tmp_path / f"hf-{fmt}").glob("*.safetensors"))) > 2
        assert sorted(back) == sorted(want) and all(torch.equal(back[k], want[k]) for k in want)
    # one shard: its tensors are cut between the two workers; the file is byte for byte one worker's
    one, two = (converters.megatron_to_hf(mg, tmp_path / f"one-shard-{n}", workers=n) for n in (1, 2))
    assert (one / "model.safetensors").read_bytes() == (two / "model.safetensors").read_bytes()


def test_one_shard_is_cut_between_workers(tmp_path):
    """With fewer shards than workers each shard is several jobs (runs of tensors of about
    equal bytes, back to back after the header); with enough shards, one job a shard."""
    from converters.dtypes import bfloat16
    from converters.formats import hf as hf_format
    from converters.stream import Target

    targets = [Target(f"t{i}", (64, 32), bfloat16, ()) for i in range(5)]
    jobs = hf_format.weight_jobs(tmp_path, targets, workers=2)
    assert [j.path.name for j in jobs] == ["model.safetensors"] * 2
    assert sorted(j.nbytes for j in jobs) == [2 * 4096, 3 * 4096]
    assert (tmp_path / "model.safetensors").stat().st_size == len(hf_format.header_bytes(
        [(t.name, t.shape, t.dtype) for t in targets])) + 5 * 4096
    assert len(hf_format.weight_jobs(tmp_path, targets, max_shard_size=8192, workers=2)) == 3


def test_a_workers_error_reaches_the_caller(tmp_path):
    def fails(path, source, meter, writer):
        raise CorruptFileError(f"bad source for {path.name}")

    def works(path, source, meter, writer):
        path.write_bytes(b"x")

    jobs = [FileJob(tmp_path / "a", 2, works), FileJob(tmp_path / "b", 1, fails)]
    before = _children()  # other tests of this pytest process may have left helpers of their own
    with pytest.raises(CorruptFileError, match="bad source for b"):
        run(jobs, source=None, meter=Meter(3, None), workers=2)
    assert _children() <= before  # no worker left running or unreaped (a zombie is still listed)


def _children() -> set[int]:
    """PIDs of this process's children (running or zombie), from /proc."""
    from pathlib import Path

    return {int(pid) for task in Path("/proc/self/task").iterdir()
            for pid in (task / "children").read_text().split()}
