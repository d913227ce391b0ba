"""examples/bridge_rl_loop.py on 2 CPU ranks: the runtime trains 3 steps under ZeRO-3 (each
parameter partitioned over the 2 ranks), export_hf streams the weights from the DeepSpeed engine
(gathering each parameter for its tensor) into a transformers model in a spawned process, whose
logits must equal the training model's within 1e-5 (the example exits 1 otherwise)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env

pytestmark = pytest.mark.multirank


def test_zero3_export_reaches_transformers(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "examples" / "bridge_rl_loop.py"), "--out", str(tmp_path / "run")],
                       check=False, capture_output=True, text=True, env=subprocess_env(), timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    line = re.search(r"zero=3 losses=\[(.*)\] max\|dlogit\| training vs transformers = (\S+)", r.stdout)
    assert line, r.stdout[-2000:]
    print(line.group(0))
    losses = [float(x) for x in line.group(1).split(",")]
    assert losses[-1] < losses[0]  # it trained: the weights exported are not the initial ones
    assert float(line.group(2)) <= 1e-5
