"""--export-hf: the final weights as a Hugging Face model folder (a LoRA run's: merged);
--export-peft: a LoRA run's adapters in peft's format (toolkit.runtime.adapters).

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
from ..errors import SpecError, ToolkitError
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


def check_export_peft(plan, out_dir: str | Path | None, overwrite: bool) -> None:
    """Before training: --export-peft needs a LoRA run (and what --export-hf needs)."""
    if out_dir is None:
        return
    if plan.spec.finetune.method != "lora":
        raise SpecError("--export-peft needs finetune.method=lora (this run trains every weight: use --export-hf)")
    check_export(plan, out_dir, overwrite)


def export_hf(sess, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Collective; returns out_dir. A LoRA run's export holds the base with the adapters merged
    (toolkit.runtime.adapters)."""
    model_dir = final_model_dir(sess)
    if sess.plan.spec.finetune.method == "lora":
        return _on_rank_zero(lambda: write_merged(sess.plan, model_dir, Path(out_dir), overwrite), out_dir)
    from converters import megatron_to_hf

    return _on_rank_zero(lambda: megatron_to_hf(model_dir, out_dir, hf_config=model_dir / "hf", overwrite=overwrite),
                         out_dir)


def export_peft(sess, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Collective; the adapters in peft's format (toolkit.runtime.adapters); returns out_dir."""
    model_dir = final_model_dir(sess)
    return _on_rank_zero(lambda: write_peft_adapter(sess.plan, model_dir, Path(out_dir), overwrite), out_dir)


def write_peft_adapter(plan, model_dir: Path, out_dir: Path, overwrite: bool) -> None:
    """The adapters of a torch_dist ``model/`` in peft's format, in a new folder (one process)."""
    from ..atomic import atomic_output_dir
    from .adapters import write_peft

    with atomic_output_dir(out_dir, overwrite) as tmp:
        write_peft(tmp, _hf_adapters(plan, model_dir), plan.spec.finetune.lora, None)


def _hf_adapters(plan, model_dir: Path) -> dict:
    from converters.formats import dcp

    from .adapters import hf_adapters, read_adapters

    padded = dcp.tensors(model_dir)["embedding.word_embeddings.weight"].shape[0]
    adapters = read_adapters(model_dir)
    modules = hf_adapters(plan.shape, padded, adapters)
    if not modules:  # never an adapter folder that adapts nothing, nor a "merged" base unchanged
        raise ExportError(f"'{model_dir}' holds {len(adapters)} adapter tensors and none of them maps to a Hugging "
                          f"Face module of {plan.shape.architecture}")
    return modules


def write_merged(plan, model_dir: Path, out_dir: Path, overwrite: bool) -> None:
    """The base exported by the converters, then W + (alpha / r) B A per adapted weight, in a new
    folder (one process; ``model_dir`` has the hf/ side folder)."""
    from converters import megatron_to_hf

    from ..atomic import atomic_output_dir
    from .adapters import base_only, merge_into

    lora = plan.spec.finetune.lora
    with atomic_output_dir(out_dir, overwrite) as tmp:
        base_only(model_dir, tmp / ".base")
        megatron_to_hf(tmp / ".base", tmp / ".hf", hf_config=model_dir / "hf")
        merge_into(tmp / ".hf", _hf_adapters(plan, model_dir), lora.alpha / lora.rank)
        shutil.rmtree(tmp / ".base")
        for p in (tmp / ".hf").iterdir():
            p.rename(tmp / p.name)
        (tmp / ".hf").rmdir()


def _on_rank_zero(work, out_dir) -> Path:
    """Run `work` on rank 0 while the others wait; its error (as one line) is raised on every rank."""
    error = [None]
    if dist.get_rank() == 0:
        try:
            work()
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
