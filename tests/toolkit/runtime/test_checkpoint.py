"""A save killed outright (SIGKILL, as a node failure or the OOM killer ends it) leaves the
checkpoints before it as they were and nothing --load takes for complete (issue 38 item 10):
the runtime writes each checkpoint in a temporary folder and renames it into place once
complete (toolkit.runtime.checkpoint), and --load refuses a folder that is not whole
(toolkit.runtime.checkpoint_folder). Then the recipe's command line resumes the run from the
checkpoint before the kill, says what it resumed, and writes the killed step's checkpoint anew.
One process, no launcher (each run here is one rank)."""
import subprocess
import sys

import pytest

from toolkit.errors import InputFileError
from toolkit.runtime.checkpoint_folder import resolve

from tests.conftest import ROOT, SUPPORT, subprocess_env


@pytest.mark.multirank
def test_a_save_killed_outright_leaves_the_previous_checkpoint_and_nothing_loadable(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(SUPPORT / "kill_during_save.py"), str(out)], capture_output=True,
                       text=True, env=subprocess_env(), timeout=600)
    assert r.returncode == -9, r.stderr[-3000:]
    root = out / "checkpoints"
    [partial] = root.glob(".global_step2.partial-*")
    assert (root / "latest").read_text() == "global_step1" and not (root / "global_step2").exists()
    assert sorted(p.name for p in partial.iterdir()) == [".lock", "model"]  # killed before the optimizer state
    assert resolve(out) == root / "global_step1"
    with pytest.raises(InputFileError, match=r"is incomplete \(a save that did not finish.*global_step1'"):
        resolve(partial)

    recipe = [sys.executable, str(ROOT / "recipes" / "llama8b.py"), "--flavor", "tiny", "--out", str(out)]
    bad = subprocess.run([*recipe, "--load", str(partial)], capture_output=True, text=True, env=subprocess_env(),
                         timeout=600)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith(f"error: checkpoint '{partial}' is incomplete (a save that did not finish")

    again = subprocess.run([*recipe, "--load", str(out), "--steps", "2", "--set", "train.save_interval=1"],
                           capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    said = f"resumed '{root / 'global_step1'}' at step 1 (8 samples consumed); learning rate: the checkpoint's " \
           "schedule, the same as this run's (cosine decay over 2 steps (16 samples))"
    assert said in again.stdout.splitlines(), again.stdout
    assert "step     2/2 | loss" in again.stdout
    assert (root / "latest").read_text() == "global_step2" and resolve(out) == root / "global_step2"
    assert not list(root.glob(".global_step2.partial-*")), "the killed save's folder is removed by the next save"
    print(said)


KILLS = 2  # launches of the save loop killed at a random moment, one with train.async_save
# (benchmarks/kill_resume.py: 20 kills of 2-rank runs at five layouts, run by hand)


@pytest.mark.multirank
def test_sigkill_at_random_moments_of_saves_leaves_the_previous_checkpoint_latest(tmp_path):
    """tests/support/save_loop.py saves checkpoint after checkpoint (a step between saves; every
    other launch with train.async_save, its writer a forked process) and is killed with its whole
    process group (SIGKILL: the rank, megatron's writers and its queue's process, as a node
    failure ends them) at a random moment, KILLS times, each launch continuing from the one
    before through the runtime's own resume path (every file's CRC-32 checked, weights and
    optimizer state loaded). After each kill `latest` names a complete checkpoint that checks
    whole, no older than the last one the loop reported, and no global_step folder is incomplete.
    Each launch's first step is the one after the checkpoint it resumed, and a step trained again
    after a kill (its save cut, so the next launch resumed before it) has the loss, learning rate
    and gradient norm it had the first time, bit for bit: the curve the launches leave is one run's.
    (The 2-rank layouts, killed 20 times against an uninterrupted run: benchmarks/kill_resume.py.)"""
    import os
    import random
    import signal
    import time

    from toolkit.runtime.checkpoint_folder import (CRC, LATEST, changed, incomplete_reason, newest_complete,
                                                   saved_state, step_folders)

    out, root, rng = tmp_path / "run", tmp_path / "run" / "checkpoints", random.Random(42)
    seen, moments, cut, trained, again = 0, [], [], {}, 0
    for launch in range(KILLS):
        mode = "async" if launch % 2 else "sync"
        err = tmp_path / f"err{launch}"
        with err.open("w") as e:
            p = subprocess.Popen([sys.executable, str(SUPPORT / "save_loop.py"), str(out), mode],
                                 stdout=subprocess.PIPE, stderr=e, text=True, env=subprocess_env(),
                                 start_new_session=True)
        try:
            ready = said(p, "ready")
            assert ready and int(ready[1]) >= seen, err.read_text()[-3000:]
            runs = {}
            first = said(p, "latest", runs)  # one step and its save done: the loop is at its pace
            assert first, err.read_text()[-3000:]
            assert min(runs) == int(ready[1]) + 1, (ready, runs)  # it resumed where `ready` said
            moments.append(round(rng.uniform(0.0, 3.0), 2))
            time.sleep(moments[-1])
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        cut.append([sorted(f.name for f in partial.iterdir()) for partial in root.glob(".global_step*.partial-*")])
        lines = [line.split() for line in p.stdout.read().splitlines()]
        runs.update(step_line(w) for w in lines if step_line(w))
        for step, values in runs.items():
            again += step in trained
            assert trained.setdefault(step, values) == values, (step, trained[step], values)
        seen = max([seen, int(first[1]), *(int(w[1]) for w in lines if w[:1] == ["latest"])])
        latest = root / (root / LATEST).read_text()
        assert int(latest.name.removeprefix("global_step")) >= seen, (latest, seen)
        assert incomplete_reason(latest) is None and changed(latest, saved_state(latest)[CRC]) is None
        assert all(incomplete_reason(f) is None for _, f in step_folders(root)), list(root.iterdir())
        assert newest_complete(root) in (latest, latest.parent / f"global_step{saved_state(latest)['step'] + 1}")
    print(f"killed at {moments} s after the first save of each launch, leaving partial saves holding {cut}; latest "
          f"after the last kill: {latest.name}; steps trained: {max(trained)}, {again} of them again after a kill "
          "with the same loss, lr and grad norm")


def said(p: subprocess.Popen, word: str, runs: dict | None = None) -> list[str]:
    """The next line of `p`'s output that starts with `word`, split (the libraries print lines of their own),
    or [] at its end; the step lines before it go into `runs`."""
    for line in p.stdout:
        if runs is not None and step_line(line.split()):
            runs.update([step_line(line.split())])
        if line.split()[:1] == [word]:
            return line.split()
    return []


def step_line(words: list[str]) -> tuple[int, tuple[str, ...]] | None:
    """save_loop.py's ``step N LOSS LR GRAD_NORM``: (N, the floats' reprs), else None."""
    return (int(words[1]), tuple(words[2:])) if len(words) == 5 and words[0] == "step" and words[1].isdigit() else None
