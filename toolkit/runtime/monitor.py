"""Live metrics of a run through DeepSpeed's own monitors (TensorBoard, W&B, CSV), from
``train.monitor``: the same numbers rank 0 writes to metrics.jsonl, one event each per
logged step, against the optimizer step.

The sections are toolkit.emit.monitor's, with relative folders placed in the run folder;
DeepSpeed's engine gets none of them (toolkit.runtime.engine.runtime_config drops them), so
one writer per monitor exists and nothing lands in the launch's working directory.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict
from pathlib import Path

from ..emit.monitor import deepspeed_monitor_sections, wandb_environment
from ..errors import ToolkitError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # monitor -> the package DeepSpeed imports for it
PREFIX = "train/"


class MonitorPackageError(ToolkitError):
    """A monitor the spec turns on needs a package that is not installed."""


def check_monitor_packages(spec) -> None:
    """Before any process starts: one line naming the missing package."""
    for name, package in PACKAGES.items():
        if getattr(spec.train.monitor, name) is not None and importlib.util.find_spec(package) is None:
            raise MonitorPackageError(f"train.monitor.{name} needs the '{package}' package: pip install {package}")


def metric_events(metrics) -> list[tuple[str, float, int]]:
    """(name, value, step) events of one StepMetrics, the tuples DeepSpeed's monitors write."""
    values = {k: v for k, v in asdict(metrics).items() if k not in ("step", "mtp_loss") and v is not None}
    values.update({f"mtp_{k + 1}_loss": v for k, v in enumerate(metrics.mtp_loss or [])})
    return [(PREFIX + k, float(v), metrics.step) for k, v in values.items()]


class RunMonitor:
    """DeepSpeed's MonitorMaster over the spec's monitors (writers exist on rank 0 only)."""

    def __init__(self, spec, out: Path, rank: int):
        sections = deepspeed_monitor_sections(spec, base=out)
        self.master = None
        if not sections:
            return
        if rank == 0:
            os.environ.update(wandb_environment(spec, out))
        from deepspeed.monitor.config import get_monitor_config
        from deepspeed.monitor.monitor import MonitorMaster

        self.master = MonitorMaster(get_monitor_config(sections))

    def write(self, metrics) -> None:
        if self.master is not None:
            self.master.write_events(metric_events(metrics))

    def close(self) -> None:
        tb = getattr(self.master, "tb_monitor", None)
        if tb is not None and tb.summary_writer is not None:
            tb.summary_writer.close()
        wb = getattr(self.master, "wandb_monitor", None)
        if wb is not None:
            import wandb

            wandb.finish()
