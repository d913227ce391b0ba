"""Memory does not grow with the model: every direction and format of conversion of a
16-layer model needs the same peak anonymous memory and peak RSS as of a 4-layer one
(each measured in a subprocess, above what the process held before the conversion).
A converter that held a rank's share (half of the 16-layer model at tp=2: 24 MB more
than the 4-layer one) or kept the sources mapped would fail by a wide margin."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import SUPPORT, subprocess_env

ANON_MIB, RSS_MIB = 4, 8


@pytest.mark.skipif(sys.platform != "linux", reason="reads peak memory from Linux's /proc/self/status")
def test_anonymous_and_total_rss_flat_from_4_to_16_layers(tmp_path):
    r = subprocess.run([sys.executable, str(SUPPORT / "convert_memory_worker.py"), str(tmp_path), "4", "16"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    small, large = got["4"], got["16"]
    print("\n" + "\n".join(f"  {k:46s} anon {small[k][0]:6.2f} -> {large[k][0]:6.2f} MiB   "
                           f"rss {small[k][1]:6.2f} -> {large[k][1]:6.2f} MiB" for k in small))
    assert len(small) == 6
    for k in small:
        assert abs(large[k][0] - small[k][0]) < ANON_MIB, k
        assert abs(large[k][1] - small[k][1]) < RSS_MIB, k
