"""--export-hf: the final weights as a Hugging Face model folder.

Every checkpoint's ``model/`` (megatron-core torch_dist) carries an ``hf/`` side folder,
the converters' convention: the model's config.json and, when the training data was
prepared with a tokenizer folder, its tokenizer files. The last checkpoint is converted by
``converters.megatron_to_hf`` on rank 0 while the others wait, so the export holds weights,
config and tokenizer; the result (success or the error's message) is shared so every rank
ends the same way.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from ..atomic import check_output_dir, sync_tree
from ..errors import ToolkitError
from ..models import hf_config_dict
from . import checkpoint


class ExportError(ToolkitError):
    """The trained weights cannot be exported as a Hugging Face model."""


def check_export(plan, out_dir: str | Path | None, overwrite: bool) -> None:
    """Before training: the converters must know the architecture, and an existing export
    folder is an error unless overwriting."""
    if out_dir is None:
        return
    from ..models.family import check_supported

    check_supported(plan.shape.architecture)
    check_output_dir(out_dir, overwrite)


def export_hf(sess, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Collective; returns out_dir."""
    model_dir = final_model_dir(sess)
    error = [None]
    if dist.get_rank() == 0:
        try:
            from converters import megatron_to_hf

            megatron_to_hf(model_dir, out_dir, hf_config=model_dir / "hf", overwrite=overwrite)
        except Exception as e:  # reported on every rank below
            error[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ExportError(f"export to '{out_dir}' failed: {error[0]}")
    return Path(out_dir)


def final_model_dir(sess) -> Path:
    """The torch_dist weights of the checkpoint saved at the end of the run; when the run had
    no step left to train (--load of a checkpoint at train.steps, into another --out), those
    of the checkpoint it loaded."""
    from .trainer import checkpoint_root

    own = checkpoint_root(sess.plan, sess.opts) / checkpoint.tag(sess.state.step) / "model"
    loaded = sess.resumed
    if not own.is_dir() and loaded is not None and loaded.schedule is not None and loaded.step == sess.state.step:
        return Path(loaded.folder) / "model"
    return own



TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")  # transformers >= 4.43 keeps the chat template apart


def write_hf_side(model_dir: Path, shape, tokenizer: str | None) -> None:
    """model/hf/: config.json of the trained model, plus the tokenizer's files (rank 0)."""
    side = model_dir / "hf"
    side.mkdir(parents=True, exist_ok=True)
    (side / "config.json").write_text(json.dumps(hf_config_dict(shape), indent=2) + "\n")
    src = Path(tokenizer) if tokenizer else None
    for name in TOKENIZER_FILES if src is not None and src.is_dir() else ():
        if (src / name).is_file():
            shutil.copy2(src / name, side / name)
    sync_tree(side)  # on the disk before `latest` names the checkpoint
