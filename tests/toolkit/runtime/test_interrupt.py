"""What a user sees when a run is stopped or cannot start, in one real 2-rank launch of a
recipe under the deepspeed launcher, as documented (issue 37, items 2 and 6):

- a second launch on the same port (the deepspeed launcher's 29500 by default) stops in one
  line that names --master_port, and leaves the first run alone;
- Ctrl-C (SIGINT to the launch's process group, as a terminal sends it) stops every rank:
  rank 0 says where the run stood in one line, no rank prints a traceback, exit 130;
- `toolkit status` says the run is running while it trains, and stopped without finishing after.

The deepspeed launcher's own process (deepspeed/launcher/runner.py) has no SIGINT handler on
one machine and prints its own KeyboardInterrupt traceback; that block, exactly, is the only
other thing allowed on stderr. It then dies of the signal: the shell's 130 (-2 here)."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")  # the launcher users type
RUNNER_FRAMES = ("deepspeed/launcher/runner.py", "result.wait()")


def launch_env() -> dict[str, str]:
    """The README's environment: the checkout on the path, no GPU, nothing told to DeepSpeed."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "TOOLKIT_VERBOSE")}
    return {**env, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def recipe(port: int, out: Path, steps: int) -> list[str]:
    return [DEEPSPEED, "--master_port", str(port), "--num_gpus", "2", "recipes/llama8b.py", "--flavor", "tiny",
            "--steps", str(steps), "--out", str(out)]


def without_runner_traceback(stderr: str) -> list[str]:
    """stderr's lines less the launcher's own KeyboardInterrupt traceback (asserted present once)."""
    lines = stderr.splitlines()
    start = [i for i, line in enumerate(lines) if line == "Traceback (most recent call last):"]
    assert len(start) == 1, stderr
    end = lines.index("KeyboardInterrupt", start[0])
    block = "\n".join(lines[start[0]:end + 1])
    assert all(frame in block for frame in RUNNER_FRAMES) and "toolkit" not in block, block
    return lines[:start[0]] + lines[end + 1:]


def first_step(p: subprocess.Popen, timeout: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step ") or time.monotonic() > deadline:
            return lines
    raise AssertionError("the run ended before its first step:\n" + "".join(lines) + p.stderr.read()[-3000:])


@pytest.mark.multirank
def test_a_taken_port_then_ctrl_c(tmp_path):
    port = free_port()
    run = subprocess.Popen(recipe(port, tmp_path / "a", 3000), cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # a terminal's foreground job
    try:
        started = first_step(run, 600)
        assert started[-1].startswith("step     1/3000")
        # the first launch holds its port and its run folder's lock while stopped (SIGSTOP, as a terminal's
        # Ctrl-Z): its ranks do not take the 2 cores from the second launch and `toolkit status` meanwhile
        os.killpg(run.pid, signal.SIGSTOP)
        second = subprocess.run(recipe(port, tmp_path / "b", 10), cwd=ROOT, env=launch_env(), capture_output=True,
                                text=True, timeout=600)
        assert second.returncode == 1 and second.stderr.splitlines() == [
            f"error: port {port} (MASTER_PORT) is in use on this machine, by another launch? Start this one on a "
            "free port: `deepspeed --master_port N ...` (torchrun: --master_port N)"], second.stderr[-3000:]
        assert run.poll() is None and not (tmp_path / "b" / "metrics.jsonl").exists()
        alive = status(tmp_path / "a")
        assert alive[0].startswith(f"run: {tmp_path / 'a'}: running (") and alive[1].startswith("step: "), alive
        os.killpg(run.pid, signal.SIGCONT)
        os.killpg(run.pid, signal.SIGINT)
        out, err = run.communicate(timeout=300)
        out = "".join(started) + out  # what rank 0 printed from the start
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == -signal.SIGINT, (run.returncode, err[-3000:])  # a shell reports 128 + 2 = 130
    ours = without_runner_traceback(err)
    assert len(ours) == 1, err[-3000:]
    m = re.fullmatch(r"interrupted by SIGINT after step (\d+)/3000; (.*)", ours[0])
    assert m and f"step {m[1]:>5}/3000 |" in out, ours  # the last step printed
    latest = tmp_path / "a" / "checkpoints" / "latest"  # tiny runs save every 15 steps
    tail = (f"the last checkpoint is {latest.read_text().strip()}: continue with --load {tmp_path / 'a'}"
            if latest.is_file() else "no checkpoint was written yet")
    assert m[2] == tail and (not latest.is_file() or (latest.parent / latest.read_text().strip()).is_dir())
    assert "Traceback" not in out and "[rank" not in out + err
    assert "stopped without finishing (killed or crashed" in status(tmp_path / "a")[0]


def status(run: Path) -> list[str]:
    """`toolkit status RUN` as a user types it."""
    r = subprocess.run([sys.executable, "-m", "toolkit", "status", str(run)], cwd=ROOT, env=launch_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout.splitlines()


def test_a_forked_helper_dies_of_ctrl_c_quietly():
    """Ctrl-C reaches every process of the terminal's group, also the writers megatron's
    dist_checkpointing forks during a save: they inherit the run's handler, which ends a forked
    process by the signal itself (no traceback, no Interrupted raised in a library's fork hook)
    and raises Interrupted only in the process that installed it."""
    code = ("import multiprocessing as mp, os, signal, sys, time\n"
            "from toolkit.runtime import interrupt\n"
            "def child():\n"
            "    os.kill(os.getpid(), signal.SIGINT); time.sleep(5); sys.exit(3)\n"
            "interrupt.install()\n"
            "p = mp.get_context('fork').Process(target=child); p.start(); p.join()\n"
            "print(p.exitcode)\n"
            "try:\n"
            "    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "except BaseException as e:\n"
            "    print(type(e).__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.split() == [str(-signal.SIGINT), "Interrupted"] and r.stderr == "", (r.stdout, r.stderr)


def test_ctrl_c_where_python_drops_exceptions_still_interrupts():
    """A SIGINT whose handler would run in a fork hook (as logging's, when megatron forks its
    checkpoint writers: seen once in about ten Ctrl-Cs of a 2-rank run) or in a __del__ is not
    lost as an "Exception ignored" print: a fork holds it back until os.fork has returned, and
    one raised in a __del__ is sent again; each is raised in the code that runs next."""
    code = ("import os, signal, time\n"
            "def hook():\n"
            "    os.kill(os.getpid(), signal.SIGINT); sum(range(1000))\n"
            "os.register_at_fork(after_in_parent=hook)  # before install(), as logging's are\n"
            "from toolkit.runtime import interrupt\n"
            "interrupt.install()\n"
            "try:\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        os._exit(0)\n"
            "    print('forked'); time.sleep(5); print('slept')\n"
            "except BaseException as e:\n"
            "    print(type(e).__name__, interrupt.seen() == signal.SIGINT)\n"
            "class Late:\n"
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGINT); sum(range(1000))\n"
            "interrupt.install()  # a second run in this process: the first signal raises again\n"
            "interrupt._received = None\n"
            "try:\n"
            "    x = Late(); del x\n"
            "    time.sleep(5); print('slept')\n"
            "except BaseException as e:\n"
            "    print(type(e).__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.split("\n") == ["forked", "Interrupted True", "Interrupted", ""] and r.stderr == "", (r.stdout,
                                                                                                      r.stderr)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signals_end_a_rank_that_is_starting(signum):
    """Before the run's first step (interrupt.training()) there is nothing to save: SIGTERM and
    SIGUSR1 interrupt at once, as SIGINT does (a launcher's SIGTERM after another rank failed no
    longer waits for its SIGKILL)."""
    code = ("import os, signal, time\n"
            "from toolkit.runtime import interrupt\n"
            "interrupt.install()\n"
            "try:\n"
            f"    os.kill(os.getpid(), {int(signum)}); time.sleep(5)\n"
            "except BaseException as e:\n"
            f"    print(type(e).__name__, interrupt.seen() == {int(signum)}, interrupt.preempt_signal())\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.split("\n") == ["Interrupted True None", ""] and r.stderr == "", (r.stdout, r.stderr)


def test_preemption_signals_are_recorded_not_raised():
    """Once the run trains (interrupt.training()), SIGTERM and SIGUSR1 (a scheduler's notice)
    only record the first one for the train loop (which stops at the end of the step, saving);
    SIGINT still interrupts at once."""
    code = ("import os, signal, time\n"
            "from toolkit.runtime import interrupt\n"
            "interrupt.install()\n"
            "interrupt.training()\n"
            "print(interrupt.preempt_signal())\n"
            "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1)\n"
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)\n"
            "print(interrupt.preempt_signal() == signal.SIGUSR1, interrupt.seen())\n"
            "try:\n"
            "    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "except BaseException as e:\n"
            "    print(type(e).__name__, interrupt.seen() == signal.SIGINT)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.split("\n") == ["None", "True None", "Interrupted True", ""] and r.stderr == "", (r.stdout, r.stderr)


_LEAVING = ("import os, signal, sys, time\n"
            "from toolkit.runtime import interrupt\n"
            "from toolkit.cli.train import exit_code\n"
            "from toolkit.errors import InputFileError\n"
            "interrupt.install()\n"
            "try:\n"
            "    try:\n"
            "        {first}\n"
            "    except BaseException:\n"
            "        {then}\n"
            "except BaseException as e:\n"
            "    print(exit_code(e, interrupt.Progress()))\n")
_ERROR = "raise InputFileError('checkpoint is damaged')"


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("first, then, code, said", [
    (_ERROR, "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)", 1, "error: checkpoint is damaged"),
    (_ERROR, "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)", 130, "interrupted by sigint"),
    ("os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)", _ERROR, 143, "interrupted by sigterm"),
], ids=["sigterm-after-the-error", "sigint-after-the-error", "sigterm-before-the-error"])
def test_a_launchers_sigterm_while_leaving_with_an_error_keeps_its_code(rank, first, then, code, said):
    """Every rank finds the same error (a damaged checkpoint); rank 0 says it and exits 1, and the
    launcher sends the other ranks SIGTERM (the test harness a second later, as DeepSpeed's): a rank
    still leaving with that error when it comes exits with the error's code, at once, not 143 (a
    loaded CI run had rank 1 exit 143). A SIGINT still wins (130), and a SIGTERM that came first
    stays the exit code of the error it caused (143)."""
    r = subprocess.run([sys.executable, "-c", _LEAVING.format(first=first, then=then)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": rank})
    assert r.stdout.split("\n") == [str(code), ""], (r.stdout, r.stderr)
    if rank == "0":
        assert said in r.stderr.lower(), r.stderr
    else:
        assert r.stderr == "", r.stderr
