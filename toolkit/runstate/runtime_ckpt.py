"""The runtime's own training checkpoint as files (toolkit.runtime.checkpoint writes it):
``ROOT/latest`` naming ``ROOT/global_step<N>/`` with ``model/`` (torch_dist weights and the
``hf/`` side folder), ``optimizer/`` (torch_dist, Megatron-LM's distributed-optimizer keys and
param groups) and ``train_state.json``. Read and written here without a process group."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputFileError
from ..runtime.checkpoint_folder import (CRC, FILES, GUIDE, GUIDE_TEXT, LATEST, MODEL, OPTIMIZER, STATE, checksums,
                                        manifest, resolve, tag)

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
SIDE = "hf"


@dataclass(frozen=True)
class RunCheckpoint:
    folder: Path  # ROOT/global_step<N>

    @property
    def model(self) -> Path:
        return self.folder / MODEL

    @property
    def optimizer(self) -> Path:
        return self.folder / OPTIMIZER

    @property
    def state(self) -> dict:
        return json.loads((self.folder / STATE).read_text())

    def optimizer_common(self) -> dict:
        """{"optimizer": {"param_groups": [...]}, "param_state_sharding_type": ...}."""
        common = load_common(self.optimizer)
        if "optimizer" not in common or "optimizer" not in common["optimizer"]:
            raise InputFileError(f"'{self.optimizer}' holds no optimizer param groups (a checkpoint of an older "
                                 "runtime: resume it once and save again)")
        return common["optimizer"]

    def hf_config(self) -> dict:
        side = self.model / SIDE / "config.json"
        if not side.is_file():
            raise InputFileError(f"'{self.model}' has no {SIDE}/config.json describing the model")
        return json.loads(side.read_text())


def open_run(path: str | Path) -> RunCheckpoint:
    """A complete training checkpoint (checkpoint_folder.resolve refuses anything else)."""
    return RunCheckpoint(resolve(path))


def load_common(folder: Path) -> dict:
    """A torch_dist folder's common.pt (Megatron-LM keeps its args there as a Namespace)."""
    import argparse

    p = folder / COMMON
    if not p.is_file():
        return {}
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(p, map_location="cpu", weights_only=True)


def write_torch_dist_files(folder: Path, common: dict) -> None:
    """common.pt and metadata.json of a torch_dist folder whose .metadata is already written."""
    torch.save(common, folder / COMMON)
    (folder / METADATA_JSON).write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))


def finish_run(root: Path, step: int, state: dict, side: Path | dict) -> Path:
    """train_state.json (with the list of every other file, its size and CRC-32, which --load checks),
    the model's hf/ side folder (copied, or a config dict) and ROOT/latest, written last.
    Returns the checkpoint folder."""
    folder = root / tag(step)
    side_dir = folder / MODEL / SIDE
    if isinstance(side, Path):
        shutil.copytree(side, side_dir)
    else:
        side_dir.mkdir(parents=True)
        (side_dir / "config.json").write_text(json.dumps(side, indent=2) + "\n")
    (folder / GUIDE).write_text(GUIDE_TEXT)
    files = manifest(folder)
    (folder / STATE).write_text(json.dumps({**state, FILES: files, CRC: checksums(folder, files)}) + "\n")
    (root / LATEST).write_text(tag(step))
    return folder
