"""`toolkit status RUN_DIR` from the file system alone: the last step, throughput, the latest
complete checkpoint, and whether the run is alive (a lock its rank 0 holds while it trains;
checked here against a real process that holds it and is then killed). The same on a real
2-rank run is in tests/toolkit/runtime/test_interrupt.py."""
import json
import signal
import subprocess
import sys

import pytest

from toolkit.errors import InputFileError, MissingInputError, OutputExistsError
from toolkit.runtime import run_status
from toolkit.runtime.checkpoint_folder import STATE

from tests.conftest import ROOT, subprocess_env
from tests.toolkit.runtime.test_resume import fake_checkpoint


def fake_run(folder, steps: int = 10, logged: int = 3) -> None:
    folder.mkdir(parents=True)
    (folder / "spec.yaml").write_text(f"train:\n  steps: {steps}\n  save_dir: checkpoints\n")
    with (folder / "metrics.jsonl").open("w") as f:
        for s in range(1, logged + 1):
            f.write(json.dumps({"step": s, "loss": 3.0 - 0.5 * s, "lr": 1e-3, "grad_norm": 1.0,
                                "tokens_per_s": 1000.0 * s, "step_time_s": 0.5}) + "\n")
        f.write('{"step": 4, "lo')  # a record being written as status reads


def test_a_run_that_stopped_and_one_that_finished(tmp_path):
    run = tmp_path / "a"
    fake_run(run)
    root = run / "checkpoints"
    fake_checkpoint(root / "global_step2", 2)
    fake_checkpoint(root / "global_step3", 3)
    (root / "global_step3" / STATE).unlink()
    (root / "latest").write_text("global_step3")
    st = run_status.status(run)
    now = st.last_at + 30
    assert st.lines(now) == [
        f"run: {run}: not running (stopped after step 3 of 10: --resume continues it)",
        "step: 3/10 (30.0%), logged 30 s ago; loss 1.5000, lr 1.000e-03",
        "throughput: 2,000 tokens/s, 0.5 s/step (mean of the last 20 logged steps)",
        f"checkpoint: {root / 'global_step2'} (`latest` names 'global_step3', which is incomplete: no "
        "train_state.json, which a save writes last: the save did not finish)"]
    done = tmp_path / "b"
    fake_run(done, steps=3)
    assert run_status.status(done).state == "finished"
    assert run_status.status(done).lines()[-1] == "checkpoint: none complete yet"


def test_alive_while_its_process_holds_the_lock_stopped_once_it_is_killed(tmp_path):
    run = tmp_path / "a"
    fake_run(run)
    code = ("import sys, time; from pathlib import Path; from toolkit.runtime import run_status\n"
            "run_status.hold(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code, str(run)], cwd=ROOT, env=subprocess_env(),
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "held\n"
        st = run_status.status(run)
        assert st.state == "running" and st.owner["pid"] == p.pid
        assert st.lines()[0].startswith(f"run: {run}: running (") and f"pid {p.pid}, for " in st.lines()[0]
        assert "to go" in st.lines()[2]  # 7 steps at 0.5 s
        with pytest.raises(OutputExistsError, match=rf"'{run}' belongs to a run that is still running \(.*pid {p.pid}"):
            run_status.check_not_running(run)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    st = run_status.status(run)
    assert st.state == "stopped" and "stopped without finishing (killed or crashed" in st.lines()[0]
    run_status.check_not_running(run)  # a dead run's folder can be resumed
    run_status.hold(run)
    run_status.release(run)
    assert not (run / run_status.RUNNING).exists() and run_status.status(run).state == "not running"


def test_bad_folders(tmp_path):
    with pytest.raises(MissingInputError, match="does not exist"):
        run_status.status(tmp_path / "nope")
    with pytest.raises(InputFileError, match="is not a run folder"):
        run_status.status(tmp_path)
    run = tmp_path / "a"
    fake_run(run)
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(InputFileError, match=r"metrics.jsonl:2: not a JSON record"):
        run_status.status(run)
    r = subprocess.run([sys.executable, "-m", "toolkit", "status", str(tmp_path / "nope")], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (3, "", f"error: run folder '{tmp_path / 'nope'}' does not exist\n")
