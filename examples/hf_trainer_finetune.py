"""Fine-tune a tiny LLaMA with the HF Trainer + DeepSpeed; every setting comes from one spec.

    deepspeed --num_gpus 2 examples/hf_trainer_finetune.py

    toolkit config examples/hf_llama_tiny.yaml --out build/hf_cfg
    accelerate launch --config_file build/hf_cfg/accelerate_config.yaml examples/hf_trainer_finetune.py

The spec (default examples/hf_llama_tiny.yaml; `--set key=value` overrides it) gives the
batch, precision, optimizer, schedule and ZeRO stage; `cluster.gpu: cpu` runs the ranks on
CPU. `--model PATH` fine-tunes an HF checkpoint instead of a freshly initialised model of the
spec's architecture. Writes OUT/model (full weights, reload with from_pretrained); OUT is
build/hf_trainer_finetune unless --out says otherwise (that default folder is replaced on
each run; another folder only with --overwrite).
The text is tokenised as UTF-8 bytes (ids 0-255), so no tokenizer download is needed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import Trainer

from toolkit import quiet
from toolkit.atomic import check_output_dir
from toolkit.errors import ToolkitError
from toolkit.hf import PlanCallback, leave_process_group, load_model, save_model, training_arguments
from toolkit.spec import TrainingSpec, parse_assignment

SPEC = Path(__file__).with_name("hf_llama_tiny.yaml")
DEFAULT_OUT = Path("build/hf_trainer_finetune")
TEXT = """\
A training run on a large cluster fails in the least convenient way: an hour after it was
queued, when the global batch does not divide by the data-parallel size, when the optimizer
states do not fit, or when the checkpoint that was written turns out to be empty. The cure
is to write the run down once, check every rule before launching, and derive every setting
that the launcher, the runtime and the trainer read from that one description.
The data-parallel size is the world size divided by the product of the tensor, pipeline and
context parallel sizes. The global batch is the micro batch times the accumulation steps
times the data-parallel size. ZeRO stage one shards the optimizer states, stage two also the
gradients, and stage three the parameters themselves, which are gathered layer by layer when
they are needed and released afterwards. Offloading the optimizer to host memory trades step
time for device memory; the Adam update then runs on the CPU.
"""


class TextBlocks(torch.utils.data.Dataset):
    """Non-overlapping blocks of seq_len byte ids; labels are the inputs (the model shifts)."""

    def __init__(self, text: str, seq_len: int):
        ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.blocks = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def make_trainer(spec: TrainingSpec, out: Path, model_path: str | None = None, report=None) -> Trainer:
    args = training_arguments(spec, out / "trainer", report_to="none", save_strategy="no", disable_tqdm=True)
    model = load_model(spec, model_path, args=args)
    return Trainer(model=model, args=args, train_dataset=TextBlocks(TEXT, spec.batch.seq_len),
                   callbacks=[PlanCallback(spec, report=report)])


def finetune(spec: TrainingSpec, out: Path, model_path: str | None = None, overwrite: bool = False,
             report=None) -> Trainer:
    """Train, then save OUT/model; returns the Trainer (its engine still holds the weights)."""
    check_output_dir(out / "model", overwrite)  # fail now, not after training
    trainer = make_trainer(spec, out, model_path, report)
    trainer.train()
    save_model(trainer, out / "model", overwrite=overwrite)
    return trainer


def main(argv: list[str] | None = None) -> Trainer:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, default=SPEC)
    p.add_argument("--set", dest="sets", action="append", default=[], help="spec override key=value")
    p.add_argument("--model", default=None, help="HF checkpoint to fine-tune (default: fresh weights)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"output folder (default {DEFAULT_OUT}, replaced on each run)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT/model if --out names an existing run")
    p.add_argument("--verbose", action="store_true", help="also print what DeepSpeed, accelerate, transformers and "
                                                          "torch say about their own calls")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed launcher
    a = p.parse_args(argv)
    spec = TrainingSpec.from_yaml(a.spec)
    if a.sets:
        spec = spec.with_overrides(dict(parse_assignment(s) for s in a.sets))
    quiet.set_verbose(a.verbose)
    quiet.quiet_run(cpu=spec.cluster.gpu == "cpu", transformer_engine=False)  # the HF model, not megatron's layers
    quiet.quiet_hf_trainer()
    out, overwrite = (a.out, a.overwrite) if a.out is not None else (DEFAULT_OUT, True)
    trainer = finetune(spec, out, a.model, overwrite, report=print)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {trainer.state.global_step} steps; "
              f"model saved to {out / 'model'}")
    return trainer


if __name__ == "__main__":
    try:
        main()
    except ToolkitError as e:  # a spec the Trainer cannot run: one line, exit 2 (toolkit plan names it first)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    leave_process_group()
