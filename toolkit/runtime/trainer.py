"""Train a Plan: megatron-core model, DeepSpeed engine, indexed data, checkpoints, metrics.

``train(plan, options, on_step)`` is what ``python -m toolkit.runtime.train`` and every
recipe run on each rank; ``close(session)`` ends a run (a process that trains again, or
does something else afterwards, gets the run's memory and process groups back). It reads
everything from the plan (layout, batch, optimizer, DeepSpeed config); nothing here
re-derives a size the plan knows. It never prints: rank 0 appends one JSON line per
logged step to OUT/metrics.jsonl and calls `on_step`.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import OutputExistsError, SpecError, ToolkitError
from . import checkpoint, data, grads, state
from .distributed import Grid, init_parallel, release_model_parallel
from .engine import build_engine, drop_module_references
from .init import init_layout_independent
from .model import build_model_chunks
from .monitor import RunMonitor
from .mpu import forget_grid
from .pipeline import Pipe
from .schedule import train_step

BUILTIN = "builtin"
CORPUS = Path(__file__).parent / "corpus"


class RuntimeLimitError(ToolkitError):
    """The plan is valid, but this runtime cannot run it (said before anything starts)."""

    exit_code = 2


class WorldSizeError(ToolkitError):
    exit_code = 2


@dataclass(frozen=True)
class RunOptions:
    out: Path
    data: str | None = None  # dataset prefix; BUILTIN: the small corpus shipped with the toolkit
    load: str | None = None  # checkpoint to resume, or a bare torch_dist model to start from
    overwrite: bool = False


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    step_time_s: float
    mtp_loss: list[float] | None = None  # per MTP module (megatron's "mtp_K loss"); None without MTP


def unsupported(plan, cuda: bool | None = None, te: bool | None = None) -> list[str]:
    """What stops this machine from running a valid plan: hardware and libraries only (the
    runtime's own limits are the plan's rules, toolkit.plan.runtime_rules). `cuda`, `te`:
    whether the ranks have GPUs and TransformerEngine (default: this machine)."""
    from ..kernels import CPU, spec_kernels

    cuda = torch.cuda.is_available() if cuda is None else cuda
    gpu = plan.spec.cluster.gpu
    checks = [(gpu != CPU and not cuda, f"cluster.gpu={gpu} but this machine has no CUDA device (a CPU run "
                                        "needs cluster.gpu=cpu: use --flavor tiny)")]
    if spec_kernels(plan.spec).transformer_engine and cuda:
        te = _has_transformer_engine() if te is None else te
        checks.append((not te, "attention.backend=flash builds megatron's TransformerEngine layer spec, and "
                               "transformer_engine is not importable here; install it or set "
                               "attention.backend=unfused"))
    return [msg for bad, msg in checks if bad]


def _has_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def check_world(plan, found: int) -> None:
    lay = plan.layout
    if found != lay.world:
        parts = " x ".join(f"{k}{v}" for k, v in (("tp", lay.tp), ("pp", lay.pp), ("cp", lay.cp), ("dp", lay.dp))
                           if v > 1 or k in ("tp", "dp"))
        raise WorldSizeError(f"needs {lay.world} ranks ({parts}), found {found}")


def check_out(plan, opts: RunOptions) -> None:
    """Refuse to mix a new run into an old one (every rank checks before any writes)."""
    old = [p for p in (opts.out / "metrics.jsonl", checkpoint_root(plan, opts) / checkpoint.LATEST) if p.exists()]
    if old and not opts.overwrite and opts.load is None:
        raise OutputExistsError(f"'{old[0]}' belongs to an earlier run (pass --overwrite to replace it, "
                                "or --load to resume it)")


@dataclass
class Session:
    plan: object
    opts: RunOptions
    chunks: list
    catalog: state.Catalog
    engine: object
    stage: object
    dataset: object
    data_prefix: str
    pipe: Pipe | None
    state: checkpoint.TrainState


def setup(plan, opts: RunOptions) -> Session:
    """Build everything a run needs, in the order that keeps loaded weights: model, initial
    weights, checkpoint weights, then DeepSpeed (whose fp32 masters copy the modules), then
    a training checkpoint's optimizer state through DeepSpeed's accessors."""
    problems = unsupported(plan)
    if problems:
        raise RuntimeLimitError("; ".join(problems))
    check_out(plan, opts)
    init_parallel(Grid.of(plan.layout), plan.spec.train.seed)
    chunks = build_model_chunks(plan)
    init_layout_independent(chunks, plan.spec.train.seed)
    cat = state.catalog(plan, chunks)
    source = load_source(opts.load)
    if source is not None and source.training is not None:
        checkpoint.check_resume(plan, source.training)
    if source is not None:
        checkpoint.load_weights(plan, cat, source.weights)
    replicas = grads.tp_replicas(chunks)
    if plan.layout.pp == 1:
        grads.register_tp_grad_hooks(replicas)
    grads.mark_pipe_replicated(chunks)
    engine, stage = build_engine(plan, chunks)
    prefix = dataset_prefix(plan, opts)
    dataset = open_dataset(plan, opts, prefix)
    position = checkpoint.TrainState(0, 0)
    if source is not None and source.training is not None:
        position = checkpoint.load(engine, plan, cat, source.training)
    start_at(engine, position)
    pipe = make_pipe(plan, engine, replicas)
    return Session(plan, opts, chunks, cat, engine, stage, dataset, prefix, pipe, position)


@dataclass(frozen=True)
class LoadSource:
    weights: Path  # a torch_dist folder of weights
    training: Path | None  # the training checkpoint folder, or None for bare weights (start at step 0)


def load_source(path: str | None) -> LoadSource | None:
    """--load: bare torch_dist weights (converted from Hugging Face, Megatron-LM) start at step
    0 from them; a training checkpoint continues where it stopped."""
    if path is None:
        return None
    weights = checkpoint.weights_only(path)
    if weights is not None:
        return LoadSource(weights, None)
    folder = checkpoint.resolve(path)
    return LoadSource(folder / checkpoint.MODEL, folder)


def start_at(engine, position: checkpoint.TrainState) -> None:
    """The learning rate of the next step from the spec's schedule at the position reached
    (megatron's scheduler counts samples), and DeepSpeed's counters."""
    engine.lr_scheduler.num_steps = position.consumed_samples
    engine.lr_scheduler.step(0)
    engine.global_steps, engine.global_samples = position.step, position.consumed_samples


def make_pipe(plan, engine, tp_replicas: list) -> Pipe | None:
    if plan.layout.pp == 1:
        return None
    lay, b = plan.layout, plan.batch
    seq = b.seq_len // lay.cp // (lay.tp if lay.sequence_parallel else 1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.spec.precision]
    return Pipe((seq, b.micro, plan.shape.hidden_size), dtype, engine.device, tp_replicas)


def dataset_prefix(plan, opts: RunOptions) -> str:
    """The --data prefix, else the spec's data_path; BUILTIN is prepared into OUT/data."""
    prefix = opts.data or plan.spec.train.data_path
    if prefix is None:
        raise SpecError("no training data: pass --data PREFIX (see `toolkit data prepare`) "
                        "or set train.data_path")
    if prefix != BUILTIN:
        return prefix
    built = opts.out / "data" / "tiny_corpus"
    if dist.get_rank() == 0 and not Path(f"{built}.idx").exists():
        data.prepare(CORPUS / "tiny_corpus.txt", CORPUS / "tokenizer", built)
    dist.barrier()
    return str(built)


def open_dataset(plan, opts: RunOptions, prefix: str):
    data.check_dataset(prefix, plan.shape.vocab_size)
    return data.build_dataset(prefix, plan.batch.seq_len, plan.spec.train.seed, plan.shape.vocab_size,
                              opts.out / "data_cache")


def micro_batches(sess: Session, step: int) -> list[dict]:
    from megatron.core import parallel_state as ps

    b = sess.plan.batch
    first = sess.state.consumed_samples + (step - sess.state.step) * b.global_
    ids = data.sample_ids(first, b.micro, b.global_, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
    batches = [data.collate(sess.dataset, i, sess.engine.device) for i in ids]
    if ps.get_context_parallel_world_size() == 1:
        return batches
    from megatron.core.utils import get_batch_on_this_cp_rank  # chunks r and 2cp-1-r of 2cp

    return [get_batch_on_this_cp_rank(mb) for mb in batches]


def mean_loss(losses: list[torch.Tensor], device) -> float:
    """The step's loss on every rank: mean over micro-batches and data-parallel ranks of
    the last stage, in one all-reduce over all ranks (each tp group contributes once)."""
    from megatron.core import parallel_state as ps

    t = torch.zeros(1, dtype=torch.float64, device=device)
    if losses and ps.get_tensor_model_parallel_rank() == 0:  # cp ranks: see engine.mean_token_loss
        dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
        t += torch.stack(losses).double().sum() / len(losses) / dp_cp
    dist.all_reduce(t)
    return float(t)


def mean_mtp_loss(chunks: list, micro_batches: int, device) -> list[float] | None:
    """Each MTP module's loss of the step, as megatron logs it ("mtp_K loss"): megatron's
    GPTModel adds every micro-batch's mean MTP loss to MTPLossLoggingHelper's tracker on the
    last stage; here its mean over micro-batches and data-parallel ranks, on every rank (one
    all-reduce over all ranks, as mean_loss). The tracker is emptied for the next step."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    n = chunks[0].config.mtp_num_layers
    if not n:
        return None
    t = torch.zeros(n, dtype=torch.float64, device=device)
    values = MTPLossLoggingHelper.tracker.pop("values", None)
    MTPLossLoggingHelper.tracker.clear()
    if values is not None and ps.get_tensor_model_parallel_rank() == 0:
        t += values.double() / micro_batches / ps.get_data_parallel_world_size()
    dist.all_reduce(t)
    return [float(v) for v in t]


def run_step(sess: Session, step: int) -> StepMetrics:
    """Optimizer step number `step` (0-based); returns its metrics (on every rank)."""
    engine, b = sess.engine, sess.plan.batch
    batches = micro_batches(sess, step)
    lr = float(engine.get_lr()[0])
    start = time.perf_counter()
    losses = train_step(engine, sess.stage, batches, b.global_, sess.pipe)
    loss = mean_loss(losses, engine.device)
    mtp = mean_mtp_loss(sess.chunks, len(batches), engine.device)
    elapsed = time.perf_counter() - start
    norm = engine.get_global_grad_norm()
    norm = float(norm) if norm is not None else None
    return StepMetrics(step + 1, loss, lr, norm, b.global_ * b.seq_len / elapsed, elapsed, mtp)


def save_checkpoint(sess: Session) -> Path:
    from .export import write_hf_side

    info = data.dataset_info(sess.data_prefix)
    side = lambda folder: write_hf_side(folder / "model", sess.plan.shape, info.tokenizer if info else None)  # noqa: E731
    return checkpoint.save(sess.engine, sess.plan, sess.catalog, checkpoint_root(sess.plan, sess.opts), sess.state,
                           side)


def checkpoint_root(plan, opts: RunOptions) -> Path:
    d = Path(plan.spec.train.save_dir)
    return d if d.is_absolute() else opts.out / d


def prepare_out(plan, opts: RunOptions, resumed_at: int) -> None:
    """Rank 0, after every rank checked: clear an old run when --overwrite says so, drop
    metrics of steps a resumed run will redo, and write the spec that runs (OUT/spec.yaml)."""
    if dist.get_rank() != 0:
        return
    opts.out.mkdir(parents=True, exist_ok=True)
    metrics = opts.out / "metrics.jsonl"
    if opts.overwrite and opts.load is None:
        metrics.unlink(missing_ok=True)
        shutil.rmtree(checkpoint_root(plan, opts), ignore_errors=True)
    if metrics.exists():
        kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= resumed_at]
        metrics.write_text("".join(f"{line}\n" for line in kept))
    (opts.out / "spec.yaml").write_text(plan.spec.to_yaml())


def train(plan, opts: RunOptions, on_step: Callable[[StepMetrics], None] | None = None) -> Session:
    """Train to spec.train.steps (or resume towards it); returns the finished session."""
    check_world(plan, int(os.environ.get("WORLD_SIZE", "1")))
    sess = setup(plan, opts)
    prepare_out(plan, opts, sess.state.step)
    dist.barrier()
    spec = plan.spec
    live = RunMonitor(spec, opts.out, dist.get_rank())  # train.monitor: TensorBoard / W&B / CSV
    for step in range(sess.state.step, spec.train.steps):
        m = run_step(sess, step)
        sess.state = checkpoint.TrainState(step + 1, (step + 1) * plan.batch.global_)
        if dist.get_rank() == 0 and (m.step % spec.train.log_interval == 0 or m.step == spec.train.steps):
            with (opts.out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({k: v for k, v in asdict(m).items() if k != "mtp_loss" or v is not None}) + "\n")
            live.write(m)
            if on_step:
                on_step(m)
        if m.step % spec.train.save_interval == 0 or m.step == spec.train.steps:
            save_checkpoint(sess)
    live.close()
    return sess


def close(sess: Session) -> None:
    """End a run: DeepSpeed's own teardown (``engine.destroy()``, which removes the
    optimizer's gradient hooks), megatron's groups out of DeepSpeed's module-level tables
    (``mpu.forget_grid``), then megatron's grid and its process groups (collective: every
    rank calls it). Without the teardown a ZeRO-1/2 run's model, fp32 masters and
    moments stayed alive after the session was dropped, with no root the garbage collector
    could see (tests/test_runtime_correctness.py::test_close_gives_the_run_back). With
    DeepSpeed's bf16 optimizer the parameters go at the second collection, not the first.
    A ZeRO-3 model stayed alive even so, held by process-wide state DeepSpeed's teardown
    leaves (``engine.drop_module_references`` removes it). The session must not be used
    afterwards."""
    sess.engine.destroy()
    drop_module_references(sess.engine)
    forget_grid(sess.engine)
    release_model_parallel()
