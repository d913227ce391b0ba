"""A checkpoint's files checksummed when saved and checked when loaded, the ranks sharing the
reading (each reads every world-th file: checkpoint_folder.share), so a checkpoint is read
once between them however many ranks there are.

A save lists every file's size and CRC-32 in train_state.json, written last (toolkit.runtime.
checkpoint.save). A load checks them before anything is read into a model: a file truncated,
missing or changed since it was saved (a flipped byte) is refused in one line naming it, on
every rank alike. With ``fallback`` (``--resume-fallback``) the run continues instead from the
newest checkpoint before it that checks whole, and says which one it skipped and why.
Checkpoints without checksums (written before they were recorded) are checked by size only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..errors import InputFileError
from .checkpoint_folder import (CRC, MODEL, STEP_FOLDER, LoadSource, changed, checksums, incomplete_reason,
                                saved_state, share, step_folders)


def crc_all(folder: Path, names: list[str]) -> dict[str, int]:
    """Collective: {name: CRC-32} of every file of `folder` in `names` (the same list on every
    rank), each rank reading its share."""
    mine = checksums(folder, share(names, dist.get_rank(), dist.get_world_size()))
    parts: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return dict(sorted(kv for part in parts for kv in part.items()))


def damage(folder: Path) -> str | None:
    """Collective: why `folder` (a complete-looking training checkpoint) does not hold what was
    saved, the same answer on every rank; None when whole (or saved without checksums)."""
    reason = incomplete_reason(folder)
    if reason is None:
        crcs = saved_state(folder).get(CRC) or {}
        mine = {rel: crcs[rel] for rel in share(crcs, dist.get_rank(), dist.get_world_size())}
        reason = changed(folder, mine)
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r is not None), None)


@dataclass(frozen=True)
class Checked:
    source: LoadSource | None
    skipped: list[str]  # "'<folder>' (<why>)" of each newer checkpoint passed over (fallback only)


def verified(source: LoadSource | None, fallback: bool = False) -> Checked:
    """Collective: `source` when its checkpoint is whole; else an InputFileError naming the file,
    or with `fallback` the newest whole checkpoint before it (an InputFileError when none is)."""
    if source is None or source.training is None:
        return Checked(source, [])
    folder, skipped = source.training, []
    for candidate in [folder, *_older(folder)]:
        why = damage(candidate)
        if why is None:
            return Checked(LoadSource(candidate / MODEL, candidate), skipped)
        if not fallback:
            raise InputFileError(f"checkpoint '{candidate}' is damaged: {why}; it cannot be loaded (with --resume, "
                                 "--resume-fallback continues from the newest whole checkpoint before it)")
        skipped.append(f"'{candidate}' ({why})")
    raise InputFileError(f"no whole checkpoint at or before '{folder}': " + "; ".join(skipped))


def _older(folder: Path) -> list[Path]:
    """The global_step<N> folders beside `folder` with a smaller N, newest first."""
    m = STEP_FOLDER.fullmatch(folder.name)
    return [p for step, p in step_folders(folder.parent) if m is not None and step < int(m[1])]
