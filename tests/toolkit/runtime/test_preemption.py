"""Runs survive preemption, damaged checkpoints and bad steps (issue 42, items 1, 2, 3 and 5),
on 2 real CPU ranks of the tiny Llama recipe's command line, each rank started by the test (as srun starts a job's
tasks) so that each rank's exit code is seen; test-only events come from
tests/support/preempt_recipe.py (a rank signals itself as a step starts; a rank's loss made NaN).

One command line, run three times into one folder with --resume, is stopped by SIGTERM on
rank 1 as step 3 starts (rank 0 gets no signal), then by SIGUSR1 on rank 0 as step 5 starts,
with a NaN loss on rank 1 at step 4 (train.on_nan=skip); each stop saves the step in which the
signal came and exits 4 on both ranks (a SIGTERM on rank 1 in the middle of the second save
changes nothing), the third run finishes. Before it, a copy of the folder with a flipped byte in
step 5's checkpoint is refused, then passed over with --resume-fallback. Its losses and learning rates
are the uninterrupted run's (same events but no signal), bit for bit. The three runs save in the
background (train.async_save, issue 42 item 4: megatron-core's async dist_checkpointing), the
uninterrupted one synchronously: the third run resumes from the second's background save, and its
last checkpoint holds the same bytes as the uninterrupted run's (torch's .metadata: the same but for
the id and folder of the save). A NaN with train.on_nan=stop exits 5 naming the step and the rank."""
import contextlib
import json
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from toolkit.runtime.checkpoint_folder import file_crc32, resolve
from toolkit.runtime.interrupt import PREEMPTED

from tests.conftest import ROOT, SUPPORT, free_port, subprocess_env

STEPS = 6
SETS = ["--set", "train.save_interval=100", "--set", "train.on_nan=skip"]
GRACE = 60  # seconds a rank has after SIGTERM from the test (a preempted rank saves first) before it is stopped


def ranks(args: list[str], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Both ranks of one launch of preempt_recipe.py ARGS, each started directly (output to
    files: a rank blocked on a full pipe would hold the other in a collective); once a rank
    fails (an exit code but 0 or 4) the others get SIGTERM, as from a launcher. A rank still
    running GRACE seconds later (or at `timeout`) gets SIGABRT, with every process it started,
    whose faulthandler writes every thread's stack to its stderr, and then SIGKILL: the test
    fails showing where each stood."""
    env = subprocess_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                         PYTHONFAULTHANDLER="1")
    start, done = time.monotonic(), []
    with tempfile.TemporaryDirectory() as tmp:
        logs = [(Path(tmp) / f"out{r}", Path(tmp) / f"err{r}") for r in range(2)]
        procs = []
        for r, (out, err) in enumerate(logs):
            with out.open("w") as o, err.open("w") as e:
                procs.append(subprocess.Popen([sys.executable, str(SUPPORT / "preempt_recipe.py"), *args], cwd=ROOT,
                                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=o, stderr=e))
        try:
            # when a rank fails, the others get SIGTERM a second later, as from the deepspeed launcher
            # (which polls its ranks each second): ranks waiting for rank 0's error line stop at once
            failed = terminated = None
            while any(p.poll() is None for p in procs) and time.monotonic() < start + timeout:
                if failed is None and any(p.returncode not in (None, 0, PREEMPTED) for p in procs):
                    failed = time.monotonic()
                if terminated is None and failed is not None and time.monotonic() > failed + 1:
                    signal_all(running(procs), signal.SIGTERM)
                    terminated = time.monotonic()
                if terminated is not None and time.monotonic() > terminated + GRACE:
                    break
                time.sleep(0.05)
            if any(p.poll() is None for p in procs):
                stuck = running(procs, children=True)  # before a rank dies of SIGABRT and its writers lose their parent
                signal_all(stuck, signal.SIGABRT)
                time.sleep(5)
                signal_all(stuck, signal.SIGKILL)
            for p, (out, err) in zip(procs, logs):
                done.append(subprocess.CompletedProcess(p.args, p.wait(30), tail_of(out), tail_of(err)))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    print(f"launch {[a for a in args if a.startswith('--') and a != '--set']}: {time.monotonic() - start:.0f} s, "
          f"exit codes {[r.returncode for r in done]}")
    return done


def signal_all(procs: list, sig: int) -> None:
    """`sig` to each of these psutil.Process that is still running."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def running(procs: list[subprocess.Popen], children: bool = False) -> list:
    """The ranks still running as psutil.Process, with every process they started if `children`
    (a background save's writers, which inherit the faulthandler: a writer stuck in its fork shows
    its stack too)."""
    import psutil

    out = []
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank = psutil.Process(p.pid)
                out += [rank, *(rank.children(recursive=True) if children else [])]
    return out


def tail_of(path: Path, limit: int = 1 << 20) -> str:
    """A rank's output, its last MiB at most, with its whole size when longer: a rank that kept
    writing (once, in CI, a launch here grew a pytest worker to 22 GiB) fails the test, not the machine."""
    size = path.stat().st_size
    with path.open("rb") as f:
        f.seek(max(0, size - limit))
        text = f.read().decode(errors="replace")
    return text if size <= limit else f"[{size} bytes written; the last {limit}:]\n{text}"


def recipe(out, *extra: str) -> list[str]:
    return [str(ROOT / "recipes" / "llama8b.py"), "--flavor", "tiny", "--steps", str(STEPS), "--out", str(out),
            *SETS, *extra]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def said(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


@pytest.mark.multirank
def test_preempted_twice_and_a_nan_skipped_is_the_uninterrupted_run(tmp_path):
    events = ["--nan", "4:1"]
    ref = ranks([*events, *recipe(tmp_path / "ref")])
    assert [r.returncode for r in ref] == [0, 0], said(ref[0]) + said(ref[1])
    whole = metrics(tmp_path / "ref")
    assert [m["step"] for m in whole] == list(range(1, STEPS + 1))
    assert whole[3]["loss"] is None and whole[3]["grad_norm"] is None, whole[3]  # step 4: NaN, skipped
    assert [m.get("skipped_steps", 0) for m in whole] == [0, 0, 0, 1, 1, 1]
    assert whole[4]["lr"] == whole[3]["lr"], "a skipped step does not move the schedule (megatron's rule)"
    assert all(math.isfinite(m["loss"]) for m in whole if m["step"] != 4)

    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    command = [*events, "--signal", "3:1:SIGTERM", "--signal", "5:0:SIGUSR1", "--signal-in-save", "5:1:SIGTERM",
               *recipe(out, "--resume", "--set", "train.async_save=true")]
    first = ranks(command)
    assert [r.returncode for r in first] == [4, 4], said(first[0]) + said(first[1])
    assert (root / "latest").read_text() == "global_step3"  # the signal came as step 3 started
    assert first[0].stderr.splitlines()[-1] == (
        f"preempted (SIGTERM or SIGUSR1 on another rank): stopped after step 3/{STEPS} and saved "
        f"{root / 'global_step3'}; run the same command with --resume to continue (exit 4)"), first[0].stderr
    assert first[1].stderr.count("Traceback") == 0, first[1].stderr[-3000:]

    second = ranks(command)
    assert [r.returncode for r in second] == [4, 4], said(second[0]) + said(second[1])
    assert f"resumed '{root / 'global_step3'}' at step 3" in second[0].stdout
    assert (root / "latest").read_text() == "global_step5"  # SIGTERM on rank 1 in the middle of this save
    assert resolve(out) == root / "global_step5" and not list(root.glob(".global_step*"))  # complete, nothing partial
    assert second[0].stderr.splitlines()[-1].startswith(f"preempted (SIGUSR1 here): stopped after step 5/{STEPS}")

    damaged_copy_is_refused_then_passed_over(tmp_path, out, events, whole)

    third = ranks(command)
    assert [r.returncode for r in third] == [0, 0], said(third[0]) + said(third[1])
    assert f"resumed '{root / 'global_step5'}' at step 5" in third[0].stdout
    parts = metrics(out)
    assert [m["step"] for m in parts] == list(range(1, STEPS + 1))
    losses = [(m["loss"], m["lr"], m["grad_norm"]) for m in parts]
    assert losses == [(m["loss"], m["lr"], m["grad_norm"]) for m in whole], (losses, whole)
    assert [m.get("skipped_steps", 0) for m in parts] == [0, 0, 0, 1, 1, 1]  # carried in train_state.json
    same_bytes(tmp_path / "ref" / "checkpoints" / "global_step6", root / "global_step6")
    print("losses, stopped at 3 and 5 and resumed:", [m["loss"] for m in parts])
    print("losses, uninterrupted:               ", [m["loss"] for m in whole])

    stop = ranks(["--nan", "2:1", *recipe(tmp_path / "stop", "--set", "train.on_nan=stop")])
    assert [r.returncode for r in stop] == [5, 5], said(stop[0]) + said(stop[1])
    assert stop[0].stderr.splitlines()[-1] == (
        "error: step 2: the loss is nan on rank 1 and the gradient norm is inf (train.on_nan=stop; "
        "train.on_nan=skip drops such a step's update and goes on)"), stop[0].stderr[-2000:]
    assert stop[1].stderr == "", stop[1].stderr[-2000:]
    assert [m["step"] for m in metrics(tmp_path / "stop")] == [1]
    assert not (tmp_path / "stop" / "checkpoints").exists()


def same_bytes(sync: Path, background: Path) -> None:
    """Two checkpoints of the same state, saved synchronously and in the background, hold the same
    files with the same bytes; torch's .metadata the same but for the save's id and temporary folder."""
    import pickle

    from toolkit.runtime.checkpoint_folder import CRC, saved_state

    a, b = saved_state(sync), saved_state(background)
    assert {k: v for k, v in a.items() if k not in ("files", CRC)} == {k: v for k, v in b.items() if k not in ("files", CRC)}
    assert sorted(a["files"]) == sorted(b["files"])
    differ = sorted(k for k in a[CRC] if a[CRC][k] != b[CRC][k])
    assert differ == ["model/.metadata", "optimizer/.metadata"], differ
    for rel in differ:
        meta = [pickle.loads((folder / rel).read_bytes()) for folder in (sync, background)]
        assert meta[0].storage_meta.save_id != meta[1].storage_meta.save_id
        for m in meta:
            m.storage_meta = None
        assert meta[0] == meta[1], rel


def damaged_copy_is_refused_then_passed_over(tmp_path: Path, out: Path, events: list[str], whole: list[dict]) -> None:
    """A copy of the run stopped at step 5 with one flipped byte in one of step 5's optimizer
    shards (its size unchanged): --resume refuses it naming the file, on both ranks (exit 1,
    the file's CRC-32 against train_state.json's); --resume-fallback continues from step 3 (and
    says it skipped step 5 and why) to the uninterrupted run's curve; train.keep_checkpoints=1
    then leaves only the newest checkpoint, also when saving in the background every 2 steps (the save of
    step 4 written while steps 5 and 6 train; pruned once step 6's is complete)."""
    copy = tmp_path / "damaged"
    shutil.copytree(out, copy)
    root = copy / "checkpoints"
    shard = sorted((root / "global_step5" / "optimizer").glob("*.distcp"))[0]
    saved = file_crc32(shard)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    rel = shard.relative_to(root / "global_step5").as_posix()
    refused = ranks([*events, *recipe(copy, "--resume")])
    assert [r.returncode for r in refused] == [1, 1], said(refused[0]) + said(refused[1])
    assert refused[0].stderr.splitlines()[-1] == (
        f"error: checkpoint '{root / 'global_step5'}' is damaged: '{rel}' does not hold what was saved (CRC-32 "
        f"{file_crc32(shard):08x}, {saved:08x} when it was saved); it cannot be loaded (with --resume, "
        "--resume-fallback continues from the newest whole checkpoint before it)"), refused[0].stderr[-3000:]
    assert refused[1].stderr == "", refused[1].stderr[-3000:]

    fell = ranks([*events, *recipe(copy, "--resume-fallback", "--set", "train.keep_checkpoints=1", "--set",
                                   "train.save_interval=2", "--set", "train.async_save=true")])
    assert [r.returncode for r in fell] == [0, 0], said(fell[0]) + said(fell[1])
    assert f"resumed '{root / 'global_step3'}' at step 3" in fell[0].stdout, fell[0].stdout[-3000:]
    assert f"; skipped '{root / 'global_step5'}' ('{rel}' does not hold what was saved" in fell[0].stdout
    assert [(m["loss"], m["lr"], m["grad_norm"]) for m in metrics(copy)] == \
        [(m["loss"], m["lr"], m["grad_norm"]) for m in whole]
    assert sorted(p.name for p in root.iterdir()) == ["global_step6", "latest"]
