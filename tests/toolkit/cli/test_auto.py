"""toolkit plan --auto / --top / --explain / --json."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import yaml

from toolkit.cli import main

from tests.conftest import ROOT, subprocess_env

SPEC = {"model": "llama2-7b", "cluster": {"nodes": 6, "gpus_per_node": 4, "gpu": "h100-80gb"},
        "batch": {"global": 48, "seq_len": 4096}}  # no parallel, zero, recompute or batch.micro


def _write(tmp_path, data) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_auto_json_candidates_best_first(tmp_path, capsys):
    assert main(["plan", _write(tmp_path, {**SPEC, "parallel": {"tp": 2}}), "--json"]) == 0
    plan_keys = set(json.loads(capsys.readouterr().out))
    assert main(["plan", _write(tmp_path, SPEC), "--auto", "--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cands = out["candidates"]
    assert len(cands) == 3
    assert all(plan_keys | {"step_time_s", "tokens_per_s", "mfu"} <= set(c) for c in cands)
    assert [c["step_time_s"] for c in cands] == sorted(c["step_time_s"] for c in cands)
    assert all(c["valid"] and c["fits"] and c["step_time_s"] == c["time"]["step_time_s"] for c in cands)
    assert all(abs(sum(c["time"]["seconds"].values()) - c["step_time_s"]) < 1e-9 * c["step_time_s"] for c in cands)
    assert out["search"]["fitting"] >= 3 and out["search"]["headroom"] == 0.05 and "spec_layout" not in out


def test_auto_table_explain_and_the_specs_own_layout(tmp_path, capsys):
    spec = {**SPEC, "parallel": {"tp": 4, "pp": 2}, "zero": {"stage": 1}}
    assert main(["plan", _write(tmp_path, spec), "--auto", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "top 5 of" in text and "heads_divisible" in text and "tp=3 does not divide num_attention_heads=32" in text
    assert "tp=8 is larger than a node" in text and "warning" in text
    assert "the spec's own layout:" in text and "estimated faster" in text
    assert "where the step goes" in text and "#1 tp" in text and "spec tp4 pp2" in text  # --explain's seconds
    assert "gemm" in text and "bubble" in text and "step" in text


def test_top_and_explain_need_auto(tmp_path, capsys):
    assert main(["plan", _write(tmp_path, SPEC), "--explain"]) == 2
    assert "--auto" in capsys.readouterr().err


def test_nothing_fits_exits_2(tmp_path, capsys):
    spec = {**SPEC, "estimate": {"headroom": 0.99}}
    assert main(["plan", _write(tmp_path, spec), "--auto"]) == 2
    assert "fits in memory" in capsys.readouterr().err


def test_auto_keeps_unknown_keys_errors(tmp_path, capsys):
    assert main(["plan", _write(tmp_path, {**SPEC, "paralel": {"tp": 2}}), "--auto"]) == 2
    assert "unknown key 'paralel' (did you mean 'parallel'?)" in capsys.readouterr().err


def test_ctrl_c_during_the_search_is_one_line_and_exit_130():
    """Ctrl-C reaches the whole process group, the forked search workers too: one line from
    the command, exit 130, no worker's traceback (issue 37: `Process ForkPoolWorker-1:` debris)."""
    p = subprocess.Popen([sys.executable, "-m", "toolkit", "plan", str(ROOT / "examples/llama70b_1024gpu.yaml"),
                          "--auto"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                         start_new_session=True)  # its own process group, as a terminal's foreground job
    deadline = time.monotonic() + 120
    while not psutil.Process(p.pid).children() and time.monotonic() < deadline:  # the workers are searching
        time.sleep(0.01)
    assert p.poll() is None, p.communicate()
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert (p.returncode, err) == (130, "interrupted by SIGINT\n") and out == ""


def test_auto_says_what_zero3_picks_would_take_with_nothing_hidden(tmp_path, capsys):
    """A DeepSpeed ZeRO-3 pick whose estimate hides much of its gathers and reduce-scatters: one warning
    line on stderr with each such candidate's step if none were hidden, the same figures as make_plan's
    zero3_overlap warning of that layout (docs/planner.md, "DeepSpeed's own ZeRO-3 runs"); not in --json."""
    import re

    from toolkit.plan import make_plan
    from toolkit.spec import TrainingSpec

    spec = {"model": "llama3-70b", "target": "hf", "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu": "h100-80gb"},
            "zero": {"stage": 3}, "recompute": "full", "batch": {"micro": 1, "global": 32, "seq_len": 1024}}
    own = [f.message for f in make_plan(TrainingSpec.from_dict(spec)).findings if f.rule == "zero3_overlap"]
    bound, step = re.search(r"with none hidden the step is (\S+) s, not (\S+) s", own[0]).groups()
    assert main(["plan", _write(tmp_path, spec), "--auto", "--top", "3"]) == 0
    err = capsys.readouterr().err
    assert f"With none hidden: #1 {bound} s, not {step} s; #2 " in err  # #1 is the spec's own layout here
    assert main(["plan", _write(tmp_path, spec), "--auto", "--top", "3", "--json"]) == 0
    assert "With none hidden" not in capsys.readouterr().err
