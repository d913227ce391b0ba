"""The libraries' chatter, kept out of a command's default output; ``--verbose`` (or
``TOOLKIT_VERBOSE=1`` in the environment, which a launcher passes on to every rank) keeps it.

A command prints the toolkit's own lines, the metrics and the warnings that concern the
user's run. What the libraries print besides is silenced by its exact text, each for a
reason; any other warning still shows:

- megatron-core warns at import that TransformerEngine and Apex are absent (8 lines before
  `toolkit data prepare` had read its arguments). The toolkit builds megatron's local layer
  spec and torch's optimizers without them, and a spec that needs TransformerEngine is
  refused by name before anything is built (toolkit.runtime.trainer.unsupported). It also
  warns that its own default ``cuda_graph_scope`` ("full") is deprecated.
- torch 2.13 deprecates ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` with a
  FutureWarning on every call. DeepSpeed's ZeRO (reduce-scatter of gradients, all-gather of
  ZeRO-3 parameters) and megatron's sequence parallelism make those calls, not the user; a
  ZeRO-3 run repeated it 1,400 times, because a filter change anywhere in the process resets
  the registry that shows a warning once.
- megatron-core's advice about recomputing ``core_attn`` concerns TransformerEngine's fused
  attention, so it is silenced when the spec builds the local layer spec; its
  CUDA_DEVICE_MAX_CONNECTIONS advice concerns GPUs and is silenced on a CPU run.
- DeepSpeed prints a line when its CPU shared-memory all-reduce op loads (``without_lines``),
  and warns that it chose the CPU for lack of a GPU: where the spec targets the CPU, the
  toolkit tells DeepSpeed so (``DS_ACCELERATOR=cpu``), which is what that warning asks for.
- The HF Trainer (``quiet_hf_trainer``): transformers hands accelerate one accumulation step
  whatever the run ("the Trainer handles GAS itself"), so accelerate warns of a "mismatch" with
  DeepSpeed's (the spec's) and keeps DeepSpeed's, on every run that accumulates; and
  transformers draws a progress bar for writing or loading a few tensors.
- peft 0.21 calls transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model
  (``quiet_peft``); a command that only writes files on a machine without CUDA tells DeepSpeed
  the CPU before transformers imports it (``quiet_deepspeed_detection``).
- torch's CUDA build (PyPI's default torch) on a machine without a GPU logs "No CUDA runtime is
  found, using CUDA_HOME=..." as DeepSpeed imports ``torch.utils.cpp_extension``: once per rank of
  a CPU run (it broke the one-line error of every CPU launch under torch 2.14.1's CUDA build). It
  is dropped where the run is on the CPU anyway (``quiet_run`` with ``cpu``, and
  ``quiet_deepspeed_detection``).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator

VERBOSE_ENV = "TOOLKIT_VERBOSE"

IMPORT_NOTICES = (r".*(Transformer Engine|Apex) (is|are) not installed", r"full scope is deprecated")
TORCH_DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"
CORE_ATTN_TE_ADVICE = r"If you are using transformer_engine as the transformer implementation, the core_attn"
CUDA_CONNECTIONS_ADVICE = r"When using sequence parallelism it is recommended to set the environment variable " \
                          r"CUDA_DEVICE_MAX_CONNECTIONS"
DEEPSPEED_SHM_BUILT = r"DeepSpeed \S+shm_comm_op built successfully$"
PEFT_GRADIENT_CHECKPOINTING = r"`is_gradient_checkpointing` is deprecated"
CUDA_HOME_NOTICE = r"No CUDA runtime is found, using CUDA_HOME="
ACCELERATE_GA_NOTICE = (r"Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config "
                        r"has \d+\. Using DeepSpeed's value\.")


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def set_verbose(verbose: bool) -> None:
    """``--verbose``: this process and every process it starts keep the libraries' output."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"


def quiet_imports() -> None:
    """Before megatron-core is imported: its import-time notices about absent optional packages."""
    if is_verbose():
        return
    for notice in IMPORT_NOTICES:
        warnings.filterwarnings("ignore", message=notice)


def quiet_run(cpu: bool, transformer_engine: bool) -> None:
    """Before a run builds anything: what the libraries say about calls they make themselves.
    ``cpu``: the spec targets the CPU (cluster.gpu cpu); ``transformer_engine``: it builds
    megatron's TransformerEngine layer spec (toolkit.kernels)."""
    if is_verbose():
        return
    quiet_imports()
    warnings.filterwarnings("ignore", message=TORCH_DEPRECATED_COLLECTIVES, category=FutureWarning)
    if not transformer_engine:
        warnings.filterwarnings("ignore", message=CORE_ATTN_TE_ADVICE, category=UserWarning)
    if cpu:
        warnings.filterwarnings("ignore", message=CUDA_CONNECTIONS_ADVICE, category=UserWarning)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        drop_log_record("torch.utils.cpp_extension", CUDA_HOME_NOTICE)
    logging.getLogger("megatron").setLevel(logging.WARNING)


class _Drop(logging.Filter):
    """Drops a logger's records whose message matches ``pattern``."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def drop_log_record(logger: str, pattern: str) -> None:
    """The records of ``logger`` matching ``pattern`` are dropped (once per process, however often asked)."""
    log = logging.getLogger(logger)
    if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern for f in log.filters):
        log.addFilter(_Drop(pattern))


def quiet_hf_trainer() -> None:
    """Before an HF Trainer run: accelerate's accumulation notice, transformers' progress bars."""
    if is_verbose():
        return
    drop_log_record("accelerate.accelerator", ACCELERATE_GA_NOTICE)
    quiet_transformers_progress()


def quiet_transformers_progress() -> None:
    """transformers' progress bars (writing or loading the shards of a model)."""
    if is_verbose():
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def quiet_peft() -> None:
    """peft 0.21 calls transformers' deprecated ``is_gradient_checkpointing`` itself when it
    wraps a model (``PeftModel.from_pretrained``): a FutureWarning about peft's code."""
    if not is_verbose():
        warnings.filterwarnings("ignore", message=PEFT_GRADIENT_CHECKPOINTING, category=FutureWarning)


def quiet_deepspeed_detection() -> None:
    """For a command that computes nothing (it writes files) on a machine without CUDA: tell
    DeepSpeed the CPU, which it would pick anyway, so that importing it (transformers'
    ``save_pretrained`` does, through accelerate) does not warn that it picked the CPU."""
    if is_verbose() or os.environ.get("DS_ACCELERATOR"):
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
        drop_log_record("torch.utils.cpp_extension", CUDA_HOME_NOTICE)


@contextlib.contextmanager
def without_lines(*patterns: str) -> Iterator[None]:
    """Print what the block prints on stdout, except whole lines matching ``patterns`` (for
    libraries that ``print``); everything passes in verbose mode."""
    if is_verbose():
        yield
        return
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        drop = [re.compile(p) for p in patterns]
        kept = [line for line in buf.getvalue().splitlines(keepends=True) if not any(d.search(line) for d in drop)]
        sys.stdout.write("".join(kept))
        sys.stdout.flush()
