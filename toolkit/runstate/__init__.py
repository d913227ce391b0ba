"""Training state (weights, fp32 masters, Adam moments, step, schedule position) between this
runtime's checkpoints and other tools':

- ``runtime``: the runtime's own (toolkit.runtime.checkpoint; ``--load`` resumes it at any layout);
- ``universal``: DeepSpeed's universal checkpoint (toolkit.runstate.universal);
- ``megatron-lm``: Megatron-LM's torch_dist checkpoint with fully reshardable
  distributed-optimizer state (toolkit.runstate.megatron_lm);
- ``hf``: Hugging Face weights plus DeepSpeed-universal optimizer state under HF names, a folder
  the HF Trainer (toolkit.hf) resumes from (toolkit.runstate.hf_trainer); an output only;
- ``deepspeed``: DeepSpeed's own ZeRO files and ``latest``, written by DeepSpeed's engine, which
  its ``zero_to_fp32.py`` and ``ds_to_universal`` read (toolkit.runstate.deepspeed_zero); an
  output only (DeepSpeed's ``ds_to_universal`` turns it into a universal checkpoint, which
  converts back).

    convert_run_state(src, out, to=..., hf_config=None, overwrite=False, progress=None)

The source's format is recognised from its files. The output is written in a temporary
sibling folder and renamed into place when complete; an existing ``out`` is replaced only with
``overwrite``. Between two formats that are not the runtime's, the state passes through a
temporary runtime checkpoint.
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..atomic import atomic_output_dir, check_output_dir
from ..errors import InputFileError, MissingInputError, SpecError

FORMATS = ("runtime", "universal", "megatron-lm", "hf", "deepspeed")
OUTPUT_ONLY = ("hf", "deepspeed")


class UnknownFormatError(SpecError):
    """A format name that is not one of FORMATS."""


def detect(path: str | Path) -> str:
    """Which of FORMATS the checkpoint at `path` is (a root folder or one checkpoint)."""
    from . import hf_trainer, megatron_lm, universal
    from ..runtime.checkpoint_folder import LATEST, STATE

    p = Path(path)
    if not p.exists():
        raise MissingInputError(f"'{p}' does not exist")
    if (p / LATEST).is_file() and any((p / (p / LATEST).read_text().strip()).glob("*_optim_states.pt")):
        return "deepspeed"
    if (p / LATEST).is_file() or (p / STATE).is_file() or (p / "checkpoints" / LATEST).is_file():
        return "runtime"
    if (p / hf_trainer.TRAINER_STATE).is_file() and (p / universal.LATEST).is_file():
        return "hf"
    if (p / universal.LATEST).is_file() or (p / "zero").is_dir():
        return "universal"
    if (p / megatron_lm.TRACKER).is_file() or (p / "common.pt").is_file():
        return "megatron-lm"
    raise InputFileError(f"'{p}' is none of: a runtime checkpoint (latest / train_state.json), a DeepSpeed "
                         f"universal checkpoint ({universal.LATEST} / zero/), a Megatron-LM checkpoint "
                         f"({megatron_lm.TRACKER} / common.pt)")


def _to_runtime(src: Path, fmt: str, out: Path, hf_config: dict | None, progress) -> None:
    from . import megatron_lm, universal

    if fmt == "universal":
        universal.universal_to_runtime(universal.find_tag(src), out, hf_config, progress=progress)
    else:
        megatron_lm.megatron_lm_to_runtime(megatron_lm.find_iteration(src), out, hf_config, progress)


def _from_runtime(src: Path, to: str, out: Path, progress) -> None:
    from . import hf_trainer, megatron_lm, universal
    from .runtime_ckpt import open_run

    ck = open_run(src)
    if to == "deepspeed":
        from .deepspeed_zero import runtime_to_deepspeed

        runtime_to_deepspeed(ck, out, progress)
    elif to == "hf":
        hf_trainer.runtime_to_hf_trainer(ck, out, progress)
    elif to == "universal":
        universal.runtime_to_universal(ck, out, progress)
    else:
        megatron_lm.runtime_to_megatron_lm(ck, out, progress)


def _hf_config(hf_config: str | Path | dict | None) -> dict | None:
    if hf_config is None or isinstance(hf_config, dict):
        return hf_config
    p = Path(hf_config)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise MissingInputError(f"HF config '{p}' does not exist")
    return json.loads(p.read_text())


def convert_run_state(src: str | Path, out: str | Path, *, to: str, hf_config: str | Path | dict | None = None,
                      overwrite: bool = False, progress: Callable[[int], None] | None = None) -> Path:
    """Convert the training state at `src` into format `to` at `out` (see the module docstring).
    `progress(bytes)` is called as tensor bytes are written. Returns `out`."""
    if to not in FORMATS:
        raise UnknownFormatError(f"unknown format '{to}'; use one of {', '.join(FORMATS)}")
    src, fmt = Path(src), detect(src)
    if fmt == to:
        raise UnknownFormatError(f"'{src}' is already a {to} checkpoint")
    if fmt in OUTPUT_ONLY:
        how = (" or DeepSpeed's ds_to_universal's output of it" if fmt == "deepspeed" else "")
        raise UnknownFormatError(f"'{src}' is a {fmt} checkpoint, which is written here but not read (convert "
                                 f"the runtime checkpoint it came from{how})")
    check_output_dir(out, overwrite)
    cfg = _hf_config(hf_config)
    with atomic_output_dir(out, overwrite) as tmp:
        if fmt == "runtime":
            _from_runtime(src, to, tmp, progress)
        elif to == "runtime":
            _to_runtime(src, fmt, tmp, cfg, progress)
        else:
            with tempfile.TemporaryDirectory(prefix=".run-state-", dir=tmp.parent) as mid:
                _to_runtime(src, fmt, Path(mid), cfg, progress)
                _from_runtime(Path(mid), to, tmp, progress)
    return Path(out)


__all__ = ["FORMATS", "convert_run_state", "detect"]
