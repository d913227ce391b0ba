"""``train.monitor`` -> DeepSpeed's monitor sections (``tensorboard``, ``wandb``,
``csv_monitor``) and the matching Megatron-LM flags.

Relative folders are inside the run folder. In the generated ds_config.json they stay
relative: the generated launch scripts start in the config folder, and DeepSpeed opens
them from the working directory. The recipes' runtime passes its run folder as ``base``
(toolkit.runtime.monitor). W&B's offline mode and folder are environment variables
(WANDB_MODE, WANDB_DIR, WANDB_NAME): DeepSpeed's WandbConfig has no field for them.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the emitters read a Plan, they never make one
    from ..spec import TrainingSpec

MONITOR_SECTIONS = ("tensorboard", "wandb", "csv_monitor")


def _path(folder: str, base: Path | None) -> str:
    return str(base / folder) if base is not None and not Path(folder).is_absolute() else folder


def deepspeed_monitor_sections(spec: TrainingSpec, base: Path | None = None) -> dict[str, Any]:
    """The DeepSpeed config sections of ``spec.train.monitor`` (only the enabled ones).
    job_name is empty: the events go straight into the folder the spec names."""
    m, out = spec.train.monitor, {}
    if m.tensorboard is not None:
        out["tensorboard"] = {"enabled": True, "output_path": _path(m.tensorboard.dir, base), "job_name": ""}
    if m.wandb is not None:
        out["wandb"] = {"enabled": True, "project": m.wandb.project, "group": m.wandb.group, "team": m.wandb.team}
    if m.csv is not None:
        out["csv_monitor"] = {"enabled": True, "output_path": _path(m.csv.dir, base), "job_name": ""}
    return out


def wandb_environment(spec: TrainingSpec, base: Path | None = None) -> dict[str, str]:
    """What wandb.init reads from the environment for ``train.monitor.wandb``."""
    w = spec.train.monitor.wandb
    if w is None:
        return {}
    env = {"WANDB_DIR": _path(w.dir, base), "WANDB_NAME": w.name or spec.model}
    return {**env, "WANDB_MODE": "offline"} if w.offline else env


def megatron_monitor_args(spec: TrainingSpec) -> list[str]:
    """Megatron-LM's flags for the same monitors (it has no CSV writer; W&B offline is
    WANDB_MODE=offline in the launch environment)."""
    m, args = spec.train.monitor, []
    if m.tensorboard is not None:
        args += ["--tensorboard-dir", m.tensorboard.dir, "--tensorboard-log-interval", str(spec.train.log_interval),
                 "--log-timers-to-tensorboard"]
    if m.wandb is not None:
        args += ["--wandb-project", m.wandb.project, "--wandb-exp-name", m.wandb.name or spec.model,
                 "--wandb-save-dir", m.wandb.dir]
    return args
