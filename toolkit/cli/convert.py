"""`toolkit convert hf-to-megatron | megatron-to-hf | megatron-to-megatron | run-state` and `toolkit verify`."""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from ..errors import MissingInputError, PlanError
from . import app

convert_app = typer.Typer(no_args_is_help=True, help="Exact, streaming HF <-> Megatron-core checkpoint conversion.")
app.add_typer(convert_app, name="convert")

Tp = Annotated[int, typer.Option("--tp", min=1, help="tensor parallel size")]
Pp = Annotated[int, typer.Option("--pp", min=1, help="pipeline parallel size")]
Vpp = Annotated[int, typer.Option("--vpp", min=1, help="virtual pipeline chunks per stage")]
Ep = Annotated[int, typer.Option("--ep", min=1, help="expert parallel size (MoE)")]
Etp = Annotated[int | None, typer.Option("--etp", min=1, help="expert tensor parallel size (default: tp)")]
Dtype = Annotated[str | None, typer.Option("--dtype", help="bf16 | fp16 | fp32 (default: the source's dtype)")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="replace OUT_DIR if it exists")]
Grouped = Annotated[bool, typer.Option("--moe-grouped-gemm", help="expert weights in grouped-GEMM naming")]
First = Annotated[int | None, typer.Option("--first-stage-layers", min=1, help="uneven pipeline: layers on the first "
                                           "stage (Megatron-LM's --decoder-first-pipeline-num-layers)")]
Last = Annotated[int | None, typer.Option("--last-stage-layers", min=1, help="uneven pipeline: layers on the last "
                                          "stage (--decoder-last-pipeline-num-layers)")]
Embedding = Annotated[bool, typer.Option("--embedding-in-split", help="the embedding counts as a layer of the first "
                                         "stage (--account-for-embedding-in-pipeline-split)")]
Loss = Annotated[bool, typer.Option("--loss-in-split", help="the output layer and loss count as a layer of the last "
                                    "stage (--account-for-loss-in-pipeline-split)")]
Workers = Annotated[int, typer.Option("--workers", min=1, help="processes writing the output files in parallel")]


class Bar:
    """A tqdm bar in bytes on stderr, fed by the library's progress callback; it appears
    with the first bytes written (validation errors print nothing but the error)."""

    def __init__(self, what: str):
        self.what, self.bar, self.total = what, None, 0
        self.start = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(desc=self.what, total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, leave=False)
        self.total = total
        self.bar.update(done - self.bar.n)  # redrawn at most every tqdm.mininterval

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def existing(path: Path, what: str) -> Path:
    """An input path that must exist (exit 3 otherwise, before any work or heavy import)."""
    if not path.exists():
        raise MissingInputError(f"{what} '{path}' does not exist")
    return path


def _split(first: int | None, last: int | None, embedding: bool, loss: bool) -> dict:
    return dict(first_stage_layers=first, last_stage_layers=last, embedding_in_split=embedding, loss_in_split=loss)


def _fp8_notice(hf_dir: Path, dtype: str | None) -> None:
    """Say so when FP8 block-scaled weights (converters.fp8) or MXFP4 experts (converters.packed)
    are dequantised."""
    from converters.fp8 import fp8_block
    from toolkit.models import read_hf_config

    cfg = hf_dir / "config.json"
    block = fp8_block(read_hf_config(cfg)) if cfg.is_file() else None
    if block is not None:
        print(f"FP8 (e4m3) weights with {block[0]}x{block[1]} block scales: dequantised to {dtype or 'bf16'} "
              "(float32 product per block, one rounding)", file=sys.stderr)
    elif cfg.is_file() and (read_hf_config(cfg).get("quantization_config") or {}).get("quant_method") == "mxfp4":
        print(f"MXFP4 experts (32-value blocks, power-of-two scales): dequantised to {dtype or 'bf16'} an expert at "
              "a time, as transformers' convert_moe_packed_tensors", file=sys.stderr)


# the layout's spec keys (in the rules' messages, toolkit.plan.rules) -> this command line's flags
LAYOUT_FLAGS = {"tp": "--tp", "pp": "--pp", "vpp": "--vpp", "ep": "--ep", "etp": "--etp",
                "first_stage_layers": "--first-stage-layers", "last_stage_layers": "--last-stage-layers",
                "embedding_in_split": "--embedding-in-split", "loss_in_split": "--loss-in-split"}
_KEY_VALUE = re.compile(r"(?<![\w.*])(?:parallel\.)?(" + "|".join(LAYOUT_FLAGS) + r")=(\d+)")
_SPEC_KEY = re.compile(r"(?<![\w.])(?:parallel\.(" + "|".join(LAYOUT_FLAGS) + r")|("
                       + "|".join(k for k in LAYOUT_FLAGS if "_" in k) + r"))\b")


def as_flags(message: str) -> str:
    """A layout rule's message in this command line's words: `pp=3` -> `--pp 3`,
    `parallel.first_stage_layers` or `last_stage_layers` -> `--first-stage-layers`,
    `--last-stage-layers` (the rules speak the spec's keys; `tp` alone is left as a word)."""
    message = _KEY_VALUE.sub(lambda m: f"{LAYOUT_FLAGS[m[1]]} {m[2]}", message)
    return _SPEC_KEY.sub(lambda m: LAYOUT_FLAGS[m[1] or m[2]], message)


def one_torch_thread() -> None:
    """The converters run their own threads (writers, ``--workers`` processes); torch's
    intra-op pool under them (FP8 dequantisation, dtype casts) adds threads that spin for
    work on the same cores: a dequantised chunk took 3.3x the CPU time with torch's 2
    threads as with 1 on the 2-core build machine (benchmarks/convert_bench.py
    --unit-costs). A user's OMP_NUM_THREADS is left alone."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"  # read when torch loads its OpenMP runtime
    if "torch" in sys.modules:  # loaded already: tell it directly
        sys.modules["torch"].set_num_threads(1)


def one_blas_thread() -> None:
    """numpy's OpenBLAS starts a thread per core when numpy loads, and they spin waiting for
    work the converters never give them (they do no BLAS): ~40 ms of CPU per process on the
    2-core build machine (``import numpy`` then idle: 106-127 ms CPU, 74-78 ms with one
    thread). One thread, unless the user chose OPENBLAS_NUM_THREADS or OMP_NUM_THREADS, or
    numpy is loaded already (then it is too late to ask)."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read when numpy loads its OpenBLAS


@convert_app.callback()
def _before_any_conversion() -> None:
    # runs before the subcommand imports the converters (and numpy)
    one_blas_thread()


def _run(what: str, out: Path, fn, *args, **kwargs) -> None:
    """SIGTERM/SIGINT remove the unfinished output on the way out: one line, exit 128 + signal."""
    from ..atomic import Interrupted, signals_raise
    from ..kernels import eager_fusions

    one_torch_thread()  # before torch is imported
    eager_fusions()  # megatron, imported by the torch_dist format, would load inductor for fusions never called
    bar = Bar(what)
    try:
        with signals_raise():
            fn(*args, progress=bar, **kwargs)
    except PlanError as e:
        raise PlanError([as_flags(m) for m in e.errors]) from None
    except Interrupted as e:
        bar.close()
        print(f"interrupted by {e.name}: '{out}' was not written (its partial files are removed)", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    finally:
        bar.close()
    print(f"wrote {out} ({bar.total / 2**30:.2f} GiB in {time.perf_counter() - bar.start:.1f} s)")


@convert_app.command("hf-to-megatron")
def hf_to_megatron_cmd(hf_dir: Path, out_dir: Path, tp: Tp = 1, pp: Pp = 1, vpp: Vpp = 1, ep: Ep = 1,
                       etp: Etp = None,
                       fmt: Annotated[str, typer.Option("--format", help="torch | torch_dist")] = "torch",
                       dtype: Dtype = None, grouped_gemm: Grouped = False, overwrite: Overwrite = False,
                       first_stage_layers: First = None, last_stage_layers: Last = None,
                       embedding_in_split: Embedding = False, loss_in_split: Loss = False,
                       workers: Workers = 1,
                       stages: Annotated[str | None, typer.Option(
                           "--stages", help="A or A-B: only these pipeline stages (0-based), into a folder other "
                           "commands (other hosts) fill with the rest; the last one finishes it")]
                       = None) -> None:
    """HF model folder -> Megatron checkpoint at this layout (FP8 block-scaled weights are
    dequantised to --dtype, default bf16)."""
    existing(hf_dir, "HF model folder")
    from converters import hf_to_megatron

    _fp8_notice(hf_dir, dtype)
    _run("hf-to-megatron", out_dir, hf_to_megatron, hf_dir, out_dir, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, fmt=fmt,
         dtype=dtype, grouped_gemm=grouped_gemm, overwrite=overwrite, workers=workers, stages=stages,
         **_split(first_stage_layers, last_stage_layers, embedding_in_split, loss_in_split))
    if stages is not None:
        from converters.staged import missing_stages

        missing = missing_stages(out_dir)
        print(f"{out_dir}: stage(s) {', '.join(map(str, missing))} still missing" if missing
              else f"{out_dir}: every stage is in; the checkpoint is finished")


@convert_app.command("megatron-to-hf")
def megatron_to_hf_cmd(megatron_dir: Path, out_dir: Path,
                       hf_config: Annotated[Path | None, typer.Option(
                           "--hf-config",
                           help="HF config.json (or folder) if the checkpoint has no args nor hf/config.json")] = None,
                       dtype: Dtype = None, overwrite: Overwrite = False, workers: Workers = 1) -> None:
    """Megatron checkpoint (any layout, torch or torch_dist) -> HF model folder."""
    existing(megatron_dir, "Megatron checkpoint")
    from converters import megatron_to_hf

    _run("megatron-to-hf", out_dir, megatron_to_hf, megatron_dir, out_dir, hf_config=hf_config, dtype=dtype,
         overwrite=overwrite, workers=workers)


@convert_app.command("megatron-to-megatron")
def megatron_to_megatron_cmd(megatron_dir: Path, out_dir: Path, tp: Tp = 1, pp: Pp = 1, vpp: Vpp = 1, ep: Ep = 1,
                             etp: Etp = None,
                             fmt: Annotated[str | None, typer.Option(
                                 "--format", help="torch | torch_dist (default: the source's)")] = None,
                             dtype: Dtype = None,
                             grouped_gemm: Annotated[bool | None, typer.Option(
                                 "--moe-grouped-gemm/--moe-sequential-mlp",
                                 help="expert naming (default: the source's)")] = None,
                             overwrite: Overwrite = False, first_stage_layers: First = None,
                             last_stage_layers: Last = None, embedding_in_split: Embedding = False,
                             loss_in_split: Loss = False, workers: Workers = 1) -> None:
    """Reshard a Megatron checkpoint (tp/pp/vpp/ep/etp, even or uneven pipeline split)
    and/or change its format."""
    existing(megatron_dir, "Megatron checkpoint")
    from converters import megatron_to_megatron

    _run("megatron-to-megatron", out_dir, megatron_to_megatron, megatron_dir, out_dir, tp=tp, pp=pp, vpp=vpp, ep=ep,
         etp=etp, fmt=fmt, dtype=dtype, grouped_gemm=grouped_gemm, overwrite=overwrite, workers=workers,
         **_split(first_stage_layers, last_stage_layers, embedding_in_split, loss_in_split))


@convert_app.command("run-state")
def run_state_cmd(src: Path, out_dir: Path,
                  to: Annotated[str, typer.Option("--to", help="runtime | universal | megatron-lm | hf | deepspeed")],
                  hf_config: Annotated[Path | None, typer.Option(
                      "--hf-config", help="HF config.json (or model folder) when the source does not name its model")] = None,
                  overwrite: Overwrite = False) -> None:
    """Training state (weights, fp32 masters, Adam moments, step) between this runtime, DeepSpeed's universal
    checkpoint and Megatron-LM's torch_dist distributed-optimizer checkpoint; --to hf: HF weights plus the
    optimizer state the HF Trainer (toolkit.hf, DeepSpeed load_universal) resumes from; --to deepspeed:
    DeepSpeed's own ZeRO files (its engine writes them), which its zero_to_fp32.py and ds_to_universal read."""
    from toolkit.runstate import convert_run_state

    bar = Bar("run-state")
    done = [0, 0]  # bytes written, bytes at the last bar update

    def progress(n: int) -> None:
        done[0] += n
        if done[0] - done[1] >= 1 << 26:
            done[1] = done[0]
            bar(done[0], done[0])

    try:
        convert_run_state(src, out_dir, to=to, hf_config=hf_config, overwrite=overwrite, progress=progress)
    finally:
        bar.close()
    print(f"wrote {out_dir} ({done[0] / 2**30:.2f} GiB of tensors in {time.perf_counter() - bar.start:.1f} s)")


@app.command("verify")
def verify_cmd(hf_dir: Path, megatron_dir: Path,
               tolerance: Annotated[float, typer.Option("--tolerance", help="max |logit diff| accepted")] = 1e-4,
               hf_config: Annotated[Path | None, typer.Option(
                   "--hf-config", help="HF config.json if neither the checkpoint nor HF_DIR has one")] = None) -> None:
    """Logits of megatron-core's GPTModel (checkpoint layout, CPU ranks) vs transformers: exit 0 within tolerance."""
    existing(hf_dir, "HF model folder"), existing(megatron_dir, "Megatron checkpoint")
    from converters import verify

    from ..quiet import quiet_transformers_progress

    quiet_transformers_progress()  # its bar for loading a few tensors; the steps below say what runs
    start = time.perf_counter()

    def step(what: str) -> None:
        print(f"[{time.perf_counter() - start:5.1f} s] logits of {what}", file=sys.stderr, flush=True)

    diff = verify(hf_dir, megatron_dir, tolerance=tolerance, hf_config=hf_config, progress=step)
    print(f"max |logit diff| = {diff:.3g} (tolerance {tolerance:g}): OK ({time.perf_counter() - start:.1f} s)")
