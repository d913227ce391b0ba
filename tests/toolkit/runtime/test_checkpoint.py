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
