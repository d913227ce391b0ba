"""Which checkpoint `--load` names and whether it is whole, from the file system alone.

No torch here: `--load runs/nope` is answered (exit 3) before a rank imports torch, megatron
or DeepSpeed, and an incomplete checkpoint (exit 1) before any of them is built.

A training checkpoint ``ROOT/global_step<N>/`` is written in a temporary sibling
``ROOT/.global_step<N>.partial-*`` (toolkit.atomic: locked while written, removed by the next
save of the same step once its writer is gone) and renamed into place when complete, then
``ROOT/latest`` names it. Its ``train_state.json``, written last inside it, lists every other
file with its size (``files``) and its CRC-32 (``crc32``, ISA-L's: each rank checksums a share
of the files after the save, and each checks a share again when a run loads it:
toolkit.runtime.checkpoint.verified). So a folder named ``global_step<N>`` is complete when the
runtime made it, and what is not (a temporary folder, a folder an older runtime left when it
was killed mid-save, a copy cut short, a file removed or truncated) is refused in one line
that says it is incomplete and names the newest complete checkpoint beside it. Checkpoints
written by `toolkit convert run-state` carry the same list; older ones without it must at
least hold ``model/`` and ``optimizer/`` torch_dist folders.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..atomic import LOCK
from ..errors import InputFileError, MissingInputError

LATEST = "latest"
STATE = "train_state.json"
MODEL, OPTIMIZER = "model", "optimizer"
FILES = "files"  # train_state.json: {path relative to the checkpoint: size in bytes} of every other file
CRC = "crc32"  # train_state.json: {path relative to the checkpoint: CRC-32} of the same files
CRC_BLOCK = 16 << 20
STEP_FOLDER = re.compile(r"global_step(\d+)")


GUIDE = "README.txt"  # in each checkpoint: what it holds and how other tools read it
GUIDE_TEXT = """A training checkpoint of ds-megatron-toolkit: megatron-core torch_dist files, which any layout loads.
  model/       the weights under megatron-core's names; model/hf/ holds config.json and the tokenizer
  optimizer/   the fp32 masters and Adam moments (Megatron-LM's distributed-optimizer keys)
  rng/, train_state.json   RNG states; step, samples, schedule, layout, every file's size and CRC-32

Continue training:      --load THIS_FOLDER (or the run folder), or --resume in the run folder
Hugging Face weights:   toolkit convert megatron-to-hf THIS_FOLDER/model HF_DIR
fp32 weights as DeepSpeed's tools give them (these are not DeepSpeed's own ZeRO files):
  toolkit convert run-state THIS_FOLDER OUT --to deepspeed
  python OUT/zero_to_fp32.py OUT FP32_DIR
Other tools' training state: toolkit convert run-state THIS_FOLDER OUT --to universal | megatron-lm | hf
"""


def tag(step: int) -> str:
    return f"global_step{step}"


@dataclass(frozen=True)
class LoadSource:
    weights: Path  # a torch_dist folder of weights
    training: Path | None  # the training checkpoint folder, or None for bare weights (start at step 0)


def load_source(path: str | Path | None) -> LoadSource | None:
    """--load: bare torch_dist weights (converted from Hugging Face, Megatron-LM) start at step
    0 from them; a complete training checkpoint continues where it stopped."""
    if path is None:
        return None
    if not Path(path).exists():
        raise MissingInputError(f"checkpoint '{path}' does not exist")
    weights = weights_only(path)
    if weights is not None:
        return LoadSource(weights, None)
    folder = resolve(path)
    return LoadSource(folder / MODEL, folder)


def resolve(path: str | Path) -> Path:
    """A complete checkpoint folder from: the folder itself, a ROOT with `latest`, or a run
    folder whose checkpoints/ has one."""
    p = Path(path)
    if not p.exists():
        raise MissingInputError(f"checkpoint '{path}' does not exist")
    for root in (p, p / "checkpoints"):
        if (root / LATEST).is_file():
            name = (root / LATEST).read_text().strip()
            if not (root / name).is_dir():
                raise InputFileError(f"'{root / LATEST}' names '{name}', which is not in '{root}'"
                                     f"{_hint(root, None)}")
            return check_complete(root / name)
    if _looks_like_checkpoint(p):
        return check_complete(p)
    raise InputFileError(f"no checkpoint at '{path}' (expected a '{LATEST}' file or a global_step folder)")


def _looks_like_checkpoint(p: Path) -> bool:
    return (p / STATE).is_file() or any((p / part).is_dir() for part in (MODEL, OPTIMIZER, "rng")) or \
        STEP_FOLDER.fullmatch(p.name) is not None or ".partial-" in p.name


def check_complete(folder: Path) -> Path:
    """`folder` when it is a whole checkpoint; else one line saying it is incomplete and why."""
    reason = incomplete_reason(folder)
    if reason is not None:
        raise InputFileError(f"checkpoint '{folder}' is incomplete ({reason}){_hint(folder.parent, folder)}")
    return folder


def incomplete_reason(folder: Path) -> str | None:
    """Why `folder` is not a whole checkpoint, or None."""
    if ".partial-" in folder.name:
        return "a save that did not finish: the temporary folder it was written in"
    if not (folder / STATE).is_file():
        return f"no {STATE}, which a save writes last: the save did not finish"
    try:
        files = json.loads((folder / STATE).read_text()).get(FILES)
    except (ValueError, AttributeError):
        return f"its {STATE} is not a JSON object"
    if files is None:  # an older runtime's checkpoint: its two torch_dist folders at least
        missing = [part for part in (MODEL, OPTIMIZER) if not (folder / part / ".metadata").is_file()]
        return f"no {missing[0]}/.metadata" if missing else None
    for rel, size in files.items():
        p = folder / rel
        if not p.is_file():
            return f"'{rel}' is missing"
        if p.stat().st_size != size:
            return f"'{rel}' holds {p.stat().st_size} bytes, {size} when it was saved"
    return None


def _hint(root: Path, other_than: Path | None) -> str:
    newest = newest_complete(root, other_than)
    return f"; the newest complete checkpoint there is '{newest}'" if newest else "; there is no complete one beside it"


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """(N, folder) of every global_step<N> folder of `root`, newest first (none: no `root`)."""
    if not root.is_dir():
        return []
    return sorted(((int(m[1]), p) for p in root.iterdir() if (m := STEP_FOLDER.fullmatch(p.name)) and p.is_dir()),
                  reverse=True)


def newest_complete(root: Path, other_than: Path | None = None) -> Path | None:
    """The complete global_step<N> folder of `root` with the largest N (not `other_than`)."""
    return next((p for _, p in step_folders(root) if p != other_than and incomplete_reason(p) is None), None)


def resume_point(root: Path, fallback: bool = False) -> Path | None:
    """--resume: the checkpoint a run continues from, its checkpoint root's `latest`, or None
    when there is none: the run starts from step 0. So the same command line serves the first
    start and every restart (a requeued job). Without `latest` (a run stopped before it wrote
    one, an older runtime) the newest complete global_step<N> folder. A `latest` naming a folder
    that is not complete (damaged after it was saved: a save itself never leaves that) is an
    error unless `fallback` (--resume-fallback): then the newest complete one."""
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        reason = incomplete_reason(named) if named.is_dir() else "it is not there"
        if reason is None:
            return named
        if not fallback:
            newest = newest_complete(root, named)
            other = f"'{newest}'" if newest else "none: it starts afresh"
            raise InputFileError(f"the latest checkpoint '{named}' is incomplete ({reason}); --resume-fallback "
                                 f"continues from the newest complete one before it ({other})")
    return newest_complete(root)


def prune(root: Path, keep: int, saved: int) -> list[Path]:
    """train.keep_checkpoints: remove all but the `keep` newest complete global_step<N> folders of
    steps up to `saved`, the one just completed (which `latest` names); returns what was removed.
    A folder of a later step is from before a resume at an earlier one (a damaged checkpoint that
    --resume-fallback passed over): counting it would remove the checkpoint just saved, which
    `latest` names; it is removed once a save passes its step. Incomplete
    folders are left for a person to look at (the next save of their step clears its own). Each
    goes through toolkit.atomic.discard (renamed out of sight, then deleted), so a kill during the
    pruning leaves no half-deleted global_step folder (it did: tests/toolkit/runtime/
    test_checkpoint.py's kill at a random moment once found global_step1 without its
    model/__0_0.distcp); the trash such a kill leaves goes at the next pruning."""
    from ..atomic import discard, remove_trash

    remove_trash(root)
    gone = [p for n, p in step_folders(root) if n <= saved and incomplete_reason(p) is None][keep:]
    for p in gone:
        discard(p)
    return gone


def manifest(folder: Path) -> dict[str, int]:
    """{relative path: size} of every file in `folder` but train_state.json (which lists them)
    and a temporary folder's lock file: what incomplete_reason checks on load."""
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            rel = Path(d, n).relative_to(folder).as_posix()
            if rel not in (STATE, LOCK) and not os.path.islink(os.path.join(d, n)):
                out[rel] = os.path.getsize(os.path.join(d, n))
    return dict(sorted(out.items()))


def file_crc32(path: Path) -> int:
    """The CRC-32 of a file, read in 16 MiB blocks (ISA-L's CRC-32: about 7x zlib's)."""
    from isal import isal_zlib

    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CRC_BLOCK):
            crc = isal_zlib.crc32(block, crc)
    return crc


def share(names: Iterable[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` checksums: every world-th of the sorted names, so the
    ranks read the checkpoint once between them."""
    return sorted(names)[rank::world]


def checksums(folder: Path, names: Iterable[str]) -> dict[str, int]:
    return {rel: file_crc32(folder / rel) for rel in names}


def changed(folder: Path, expected: dict[str, int]) -> str | None:
    """Why a file of `expected` ({relative path: CRC-32}) does not hold what was saved, or None."""
    for rel, crc in sorted(expected.items()):
        p = folder / rel
        if not p.is_file():
            return f"'{rel}' is missing"
        found = file_crc32(p)
        if found != crc:
            return f"'{rel}' does not hold what was saved (CRC-32 {found:08x}, {crc:08x} when it was saved)"
    return None


def saved_state(folder: Path) -> dict:
    """A checkpoint's train_state.json."""
    return json.loads((folder / STATE).read_text())


def weights_only(path: str | Path) -> Path | None:
    """The torch_dist folder of a bare megatron model (e.g. converted from Hugging Face), or
    None: the folder itself, or a Megatron-LM checkpoint root whose
    latest_checkpointed_iteration.txt names `release` or an iteration (iter_0000123/)."""
    from converters.staged import check_finished

    p = Path(path)
    check_finished(p)  # a conversion some of whose pipeline stages are still missing
    marker = p / "latest_checkpointed_iteration.txt"
    if marker.is_file():
        it = marker.read_text().strip()
        p = p / (it if it == "release" else f"iter_{int(it):07d}")
        if not (p / "metadata.json").is_file():
            raise InputFileError(f"'{p}' is not a torch_dist checkpoint (a legacy one? convert it with "
                                 "`toolkit convert ... --format torch_dist`)")
    return p if (p / "metadata.json").is_file() and not (p / STATE).is_file() else None
