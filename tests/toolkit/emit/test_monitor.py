"""train.monitor: DeepSpeed's own monitor sections, Megatron-LM's flags, and a tiny CPU run
whose TensorBoard events and CSV files, read back by tensorboard's own reader, hold the
losses of metrics.jsonl."""
import csv
import json
import subprocess
import sys

import pytest

from toolkit.backends.deepspeed import unknown_deepspeed_keys
from toolkit.emit.deepspeed import deepspeed_config
from toolkit.emit.megatron import megatron_lm_args
from toolkit.emit.monitor import wandb_environment
from toolkit.errors import SpecError
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

from tests.conftest import ROOT, spec_dict, subprocess_env

MONITOR = {"tensorboard": {"dir": "tb"}, "wandb": {"project": "llm", "offline": True}, "csv": {}}


def test_sections_are_deepspeeds_own_and_flags_megatron_lms():
    from deepspeed.monitor.config import get_monitor_config

    plan = make_plan(TrainingSpec.from_dict(spec_dict(**{"train.monitor": MONITOR})))
    cfg = deepspeed_config(plan)
    assert cfg["tensorboard"] == {"enabled": True, "output_path": "tb", "job_name": ""}
    assert cfg["csv_monitor"]["output_path"] == "csv" and cfg["wandb"]["project"] == "llm"
    assert unknown_deepspeed_keys(cfg) == []
    parsed = get_monitor_config(cfg)
    assert parsed.enabled and parsed.tensorboard.enabled and parsed.wandb.enabled and parsed.csv_monitor.enabled
    args = megatron_lm_args(plan)
    assert args[args.index("--tensorboard-dir") + 1] == "tb" and args[args.index("--wandb-project") + 1] == "llm"
    assert wandb_environment(plan.spec)["WANDB_MODE"] == "offline"
    off = make_plan(TrainingSpec.from_dict(spec_dict()))
    assert not {"tensorboard", "wandb", "csv_monitor"} & set(deepspeed_config(off))


def test_unknown_monitor_keys_are_errors():
    with pytest.raises(SpecError, match=r"unknown key 'train.monitor.tensorbord' \(did you mean 'tensorboard'\?\)"):
        TrainingSpec.from_dict(spec_dict(**{"train.monitor": {"tensorbord": {}}}))
    with pytest.raises(SpecError, match=r"unknown key 'train.monitor.wandb.ofline' \(did you mean 'offline'\?\)"):
        TrainingSpec.from_dict(spec_dict(**{"train.monitor": {"wandb": {"project": "p", "ofline": True}}}))


def test_tiny_run_writes_tensorboard_events_and_csv_with_the_logged_losses(tmp_path):
    """One process (no launcher), 3 steps, TensorBoard and CSV on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "recipes/llama8b.py"), "--flavor", "tiny", "--steps", "3",
                        "--out", str(out), "--set", "train.monitor={tensorboard: {}, csv: {dir: metrics_csv}}"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(events.Tags()["scalars"])
    read = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert read == [(m["step"], pytest.approx(m["loss"], rel=1e-6)) for m in logged]
    with open(out / "metrics_csv" / "train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "loss"] and [float(v) for _, v in rows[1:]] == [m["loss"] for m in logged]
    assert not (tmp_path / "tensorboard").exists()  # nothing in the working directory
