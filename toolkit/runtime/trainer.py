"""Train a Plan: megatron-core model, DeepSpeed engine, indexed data, checkpoints, metrics.

``train(plan, options, on_step)`` is what ``python -m toolkit.cli.train`` and every
recipe run on each rank; ``close(session)`` ends a run (a process that trains again, or
does something else afterwards, gets the run's memory and process groups back). It reads
everything from the plan (layout, batch, optimizer, DeepSpeed config); nothing here
re-derives a size the plan knows. It never prints: rank 0 appends one JSON line per
logged step to OUT/metrics.jsonl and calls `on_step`. After every step all ranks agree, in
the step's one loss all-reduce (toolkit.runtime.step_check), whether a rank got a preemption
signal (then every rank saves that step and `train` returns with sess.preempted) and whether
the loss or the gradient norm went NaN or Inf (train.on_nan: stop raises, skip counts it).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import OutputExistsError, SpecError, ToolkitError
from ..mcore.distributed import init_parallel, release_model_parallel
from ..parallel.precision import PRECISION_DTYPES
from . import async_save, checkpoint, data, evaluate, grads, integrity, interrupt, resume, run_status, state, step_check
from .checkpoint_folder import load_source, saved_state
from .engine import build_engine, drop_module_references
from .init import init_layout_independent
from .model import build_model_chunks
from .monitor import RunMonitor
from .mpu import forget_grid
from .pipeline import Pipe
from .schedule import train_step
from .world import WorldSizeError, check_world  # noqa: F401 (WorldSizeError: the runtime's errors, in one place)

BUILTIN = "builtin"
CORPUS = Path(__file__).parent / "corpus"


class RuntimeLimitError(ToolkitError):
    """The plan is valid, but this runtime cannot run it (said before anything starts)."""

    exit_code = 2


@dataclass(frozen=True)
class RunOptions:
    out: Path
    data: str | None = None  # dataset prefix; BUILTIN: the small corpus shipped with the toolkit
    load: str | None = None  # checkpoint to resume, or a bare torch_dist model to start from
    overwrite: bool = False
    exit_interval: int | None = None  # stop after the first step divisible by it, saving there (Megatron-LM's)
    scheduler: str | None = None  # on resume, a schedule that differs: resume.OVERRIDE / resume.CHECKPOINT
    resume: bool = False  # --resume: `load` is the run's own latest checkpoint, or None to start it afresh
    fallback: bool = False  # --resume-fallback: a damaged `load` gives way to the newest whole one before it


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    step_time_s: float
    mtp_loss: list[float] | None = None  # per MTP module (megatron's "mtp_K loss"); None without MTP
    skipped_steps: int = 0  # steps of the run whose update was dropped (train.on_nan=skip), up to this one
    valid_loss: float | None = None  # after this step, with train.eval_interval (toolkit.runtime.evaluate)


def unsupported(plan, cuda: bool | None = None, te: bool | None = None, fla: bool | None = None) -> list[str]:
    """What stops this machine from running a valid plan: hardware and libraries only (the
    runtime's own limits are the plan's rules, toolkit.plan.runtime_rules). `cuda`, `te`, `fla`:
    whether the ranks have GPUs, TransformerEngine and flash-linear-attention (default: this
    machine). On GPUs megatron-core's GatedDeltaNet (Qwen3-Next) raises ImportError without fla;
    on a CPU the runtime runs it with megatron's torch rule (toolkit.mcore.gated_delta_net)."""
    from ..kernels import CPU, spec_kernels

    cuda = torch.cuda.is_available() if cuda is None else cuda
    gpu = plan.spec.cluster.gpu
    checks = [(gpu != CPU and not cuda, f"cluster.gpu={gpu} but this machine has no CUDA device (a CPU run "
                                        "needs cluster.gpu=cpu: use --flavor tiny)")]
    if spec_kernels(plan.spec).transformer_engine and cuda:
        te = _importable("transformer_engine") if te is None else te
        checks.append((not te, "attention.backend=flash builds megatron's TransformerEngine layer spec, and "
                               "transformer_engine is not importable here; install it or set "
                               "attention.backend=unfused"))
    if plan.shape.linear_attention is not None and cuda:
        fla = _importable("fla") if fla is None else fla
        checks.append((not fla, f"{plan.shape.architecture}'s gated delta net layers run megatron-core's "
                                "GatedDeltaNet, which needs flash-linear-attention's GPU kernels on CUDA, and the "
                                "fla package is not importable here; install flash-linear-attention"))
    return [msg for bad, msg in checks if bad]


def _importable(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def check_out(plan, opts: RunOptions, start: int = 0) -> None:
    """Refuse to mix a new run into an old one, or to save over a checkpoint this run (from
    step `start`) would write again, e.g. resumed from an older one into the same folder
    (every rank checks before any writes; --overwrite replaces them, each once its successor
    is complete)."""
    run_status.check_not_running(opts.out)
    root = checkpoint_root(plan, opts)
    old = [p for p in (opts.out / "metrics.jsonl", root / checkpoint.LATEST) if p.exists()]
    if old and not opts.overwrite and opts.load is None and not opts.resume:
        raise OutputExistsError(f"'{old[0]}' belongs to an earlier run (pass --overwrite to replace it, "
                                "or --load to resume it)")
    t = plan.spec.train
    last = resume.last_step(start, t.steps, opts.exit_interval)
    again = [root / checkpoint.tag(s) for s in resume.save_steps(start, last, t.save_interval)]
    again = [p for p in again if p.exists()]
    if again and not opts.overwrite:
        raise OutputExistsError(f"'{again[0]}' exists and this run (from step {start}) would save that step again: "
                                "pass --overwrite to replace it once the new one is complete, or --out another folder")


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
    resumed: resume.Resumed | None = None  # what --load did
    preempted: Path | None = None  # the checkpoint saved when a preemption signal stopped the run
    valid_dataset: object = None  # train.valid_data_path, with train.eval_interval
    saves: object = None  # train.async_save: the queue of background saves (toolkit.runtime.async_save)


def setup(plan, opts: RunOptions) -> Session:
    """Build everything a run needs, in the order that keeps loaded weights: model, initial
    weights, checkpoint weights, then DeepSpeed (whose fp32 masters copy the modules), then
    a training checkpoint's optimizer state through DeepSpeed's accessors."""
    problems = unsupported(plan)
    if problems:
        raise RuntimeLimitError("; ".join(problems))
    checked = integrity.verified(load_source(opts.load), opts.fallback)  # every file's size and CRC-32
    source = checked.source
    saved = saved_state(source.training) if source is not None and source.training is not None else None
    check_out(plan, opts, saved["step"] if saved else 0)
    if saved is not None:
        checkpoint.check_resume(plan, saved, opts.scheduler)
    init_parallel(plan.layout, plan.spec.train.seed)
    chunks = build_model_chunks(plan)
    init_layout_independent(chunks, plan.spec.train.seed)
    cat = state.catalog(plan, chunks)
    if source is not None:
        checkpoint.load_weights(plan, cat, source.weights)
    replicas = grads.tp_replicas(chunks)
    if plan.layout.pp == 1:
        grads.register_tp_grad_hooks(replicas)
    grads.mark_pipe_replicated(chunks)
    engine, stage = build_engine(plan, chunks)
    prefix = dataset_prefix(plan, opts)
    dataset = open_dataset(plan, opts, prefix)
    position, resumed = checkpoint.TrainState(0, 0), None
    if saved is not None:
        position = checkpoint.load(engine, plan, cat, source.training)
        resume.apply_schedule(engine.lr_scheduler, saved, position.consumed_samples, opts.scheduler)
        resumed = resume.Resumed(source.training, position.step, position.consumed_samples,
                                 resume.describe_schedule(plan, saved, opts.scheduler),
                                 resume.describe_batch(plan, saved), checked.skipped)
    elif source is not None:
        resumed = resume.Resumed(source.weights, 0, 0, None)
    engine.global_steps, engine.global_samples = position.step, position.consumed_samples  # DeepSpeed's counters
    pipe = make_pipe(plan, engine, replicas)
    valid = evaluate.open_valid(plan, opts, open_dataset)
    saves = async_save.queue() if plan.spec.train.async_save else None
    return Session(plan, opts, chunks, cat, engine, stage, dataset, prefix, pipe, position, resumed,
                   valid_dataset=valid, saves=saves)


def make_pipe(plan, engine, tp_replicas: list) -> Pipe | None:
    if plan.layout.pp == 1:
        return None
    lay, b = plan.layout, plan.batch
    seq = lay.seq_per_rank(b.seq_len)
    dtype = getattr(torch, PRECISION_DTYPES[plan.spec.precision])
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
        # tokenised once, shipped beside it (tests/toolkit/runtime/test_data.py keeps it prepare's output):
        # preparing it in every run imported transformers and loaded the tokenizer, 1.2-1.7 s of rank 0's
        # start-up while the other ranks waited at the barrier
        data.copy_prepared(CORPUS / "tiny_corpus", CORPUS / "tokenizer", built)
    dist.barrier()
    return str(built)


def open_dataset(plan, opts: RunOptions, prefix: str, cache: str = "data_cache"):
    data.check_dataset(prefix, plan.shape.vocab_size)
    info, spec = data.dataset_info(prefix), plan.spec
    if info is not None and info.kind == data.CHAT:
        from .chat_dataset import ChatDataset

        return ChatDataset(prefix, plan.batch.seq_len, spec.train.seed, spec.data.packing, info.eod)
    if spec.data.packing:
        raise SpecError(f"data.packing packs conversations, and '{prefix}' holds text documents (prepare a "
                        "JSONL of conversations with `toolkit data prepare`)")
    return data.build_dataset(prefix, plan.batch.seq_len, spec.train.seed, plan.shape.vocab_size,
                              opts.out / cache)


def micro_batches(sess: Session, step: int) -> list[dict]:
    b = sess.plan.batch
    return batches_at(sess, sess.dataset, sess.state.consumed_samples + (step - sess.state.step) * b.global_)


def batches_at(sess: Session, dataset, first: int, train: bool = True) -> list[dict]:
    """This rank's micro-batches of the global batch that starts at sample `first` of
    `dataset`; for training, with chat data's per-token loss denominator."""
    from megatron.core import parallel_state as ps

    b = sess.plan.batch
    ids = data.sample_ids(first, b.micro, b.global_, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
    batches = [data.collate(dataset, i, sess.engine.device) for i in ids]
    per_token = data.per_token_denominator(batches) if train and getattr(dataset, "per_token_loss", False) else None
    if ps.get_context_parallel_world_size() > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank  # chunks r and 2cp-1-r of 2cp

        batches = [get_batch_on_this_cp_rank(mb) for mb in batches]
    return batches if per_token is None else [{**mb, "loss_denominator": per_token} for mb in batches]


def mean_mtp_loss(chunks: list, micro_batches: int, device) -> list[float] | None:
    """Each MTP module's loss of the step, as megatron logs it ("mtp_K loss"): megatron's
    GPTModel adds every micro-batch's mean MTP loss to MTPLossLoggingHelper's tracker on the
    last stage; here its mean over micro-batches and data-parallel ranks, on every rank (one
    all-reduce over all ranks, as step_check.agree). The tracker is emptied for the next step."""
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
    """Optimizer step number `step` (0-based); returns its metrics (on every rank) and moves
    sess.state past it."""
    return checked_step(sess, step)[0]


def checked_step(sess: Session, step: int) -> tuple[StepMetrics, step_check.Verdict]:
    """run_step, and what every rank agreed on after it (step_check.Verdict). A bad step
    (NaN or Inf) raises step_check.NonFiniteError under train.on_nan=stop, and under skip when
    DeepSpeed applied its update after all. sess.state moves past the step (a skipped one
    counted in its skipped_steps)."""
    engine, b = sess.engine, sess.plan.batch
    batches = micro_batches(sess, step)
    lr = float(engine.get_lr()[0])
    skipped_before = engine.skipped_steps
    start = time.perf_counter()
    losses = train_step(engine, sess.stage, batches, b.global_, sess.pipe)
    norm = engine.get_global_grad_norm()
    norm = float(norm) if norm is not None else None
    # fp16: an overflowing norm with a finite loss is DeepSpeed's loss scaler at work (it skips the
    # step and lowers the scale, as it must in the first steps), not a bad step
    verdict = step_check.agree(losses, None if engine.fp16_enabled() else norm, engine.device)
    mtp = mean_mtp_loss(sess.chunks, len(batches), engine.device)
    elapsed = time.perf_counter() - start
    if verdict.bad:
        on_nan = sess.plan.spec.train.on_nan
        if on_nan == step_check.STOP or engine.skipped_steps == skipped_before:
            raise step_check.NonFiniteError(step_check.bad_step_message(step + 1, verdict, norm, on_nan))
    s = sess.state
    sess.state = checkpoint.TrainState(step + 1, s.consumed_samples + b.global_, s.skipped_steps + verdict.bad)
    return (StepMetrics(step + 1, verdict.loss, lr, norm, step_tokens(sess.dataset, s.consumed_samples, b) / elapsed,
                        elapsed, mtp, sess.state.skipped_steps), verdict)


def step_tokens(dataset, first: int, b) -> int:
    """The tokens a step trains on: every position of its sequences, or with chat data those
    holding a conversation (its padding left out: what packing fills)."""
    counted = getattr(dataset, "tokens_in", None)
    return counted(first, b.global_) if counted else b.global_ * b.seq_len


def save_checkpoint(sess: Session) -> Path:
    from .export import write_hf_side

    info = data.dataset_info(sess.data_prefix)
    side = lambda folder: write_hf_side(folder / "model", sess.plan.shape, info.tokenizer if info else None)  # noqa: E731
    return checkpoint.save(sess.engine, sess.plan, sess.catalog, checkpoint_root(sess.plan, sess.opts), sess.state,
                           side, replace=sess.opts.overwrite, saves=sess.saves)


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


def train(plan, opts: RunOptions, on_step: Callable[[StepMetrics], None] | None = None,
          on_resume: Callable[[resume.Resumed], None] | None = None) -> Session:
    """Train to spec.train.steps (or resume towards it; with opts.exit_interval stop early,
    saving); returns the finished session. Rank 0 calls `on_resume` once, before the first
    step, when --load gave the run a checkpoint or weights. A preemption signal on any rank
    (toolkit.runtime.interrupt) stops every rank after the step in which it was seen, saving
    there: sess.preempted names that checkpoint."""
    check_world(plan, int(os.environ.get("WORLD_SIZE", "1")))
    sess = setup(plan, opts)
    prepare_out(plan, opts, sess.state.step)
    if dist.get_rank() == 0:
        run_status.hold(opts.out)  # `toolkit status` tells a live run by this lock
    dist.barrier()
    interrupt.training()  # every rank is set up: a preemption signal now saves at the step's end
    spec = plan.spec
    if on_resume and sess.resumed is not None and dist.get_rank() == 0:
        on_resume(sess.resumed)
    live = RunMonitor(spec, opts.out, dist.get_rank())  # train.monitor: TensorBoard / W&B / CSV
    last = resume.last_step(sess.state.step, spec.train.steps, opts.exit_interval)
    saves = set(resume.save_steps(sess.state.step, last, spec.train.save_interval))
    try:
        train_steps(sess, last, saves, live, on_step)
    except step_check.NonFiniteError:  # agreed by every rank at the same step: a pending save still completes
        async_save.finish(sess.saves)
        raise
    async_save.finish(sess.saves)  # before the run returns, its last checkpoint is complete
    live.close()
    run_status.release(opts.out)
    return sess


def train_steps(sess: Session, last: int, saves: set[int], live: RunMonitor,
                on_step: Callable[[StepMetrics], None] | None) -> None:
    """The steps from sess.state.step to `last`, saving at the steps in `saves` (and where a
    preemption signal stops the run: sess.preempted, complete when this returns)."""
    spec, opts = sess.plan.spec, sess.opts
    for step in range(sess.state.step, last):
        m, verdict = checked_step(sess, step)
        async_save.poll(sess.saves)  # a background save that every rank has written completes
        stop = verdict.preempt and m.step < last
        if evaluate.due(m.step, spec.train.eval_interval, spec.train.steps) and not stop:
            m = replace(m, valid_loss=evaluate.evaluate(sess, m.step, lambda ds, first: batches_at(sess, ds, first,
                                                                                                  train=False)))
        logged = m.step % spec.train.log_interval == 0 or m.step == last or stop or m.valid_loss is not None
        if dist.get_rank() == 0 and logged:
            with (opts.out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(metrics_line(m)) + "\n")
            live.write(m)
            if on_step:
                on_step(m)
        if m.step in saves or stop:
            folder = save_checkpoint(sess)
        if stop:
            async_save.finish(sess.saves)
            sess.preempted = folder
            break


def metrics_line(m: StepMetrics) -> dict:
    """metrics.jsonl's record of a step: strict JSON (a NaN or Inf of a skipped step is null),
    mtp_loss only with MTP, skipped_steps once a step was skipped, valid_loss after an evaluation."""
    line = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in asdict(m).items()}
    return {k: v for k, v in line.items() if (k not in ("mtp_loss", "valid_loss") or v is not None)
            and (k != "skipped_steps" or v)}


def close(sess: Session) -> None:
    """End a run: DeepSpeed's own teardown (``engine.destroy()``, which removes the
    optimizer's gradient hooks), megatron's groups out of DeepSpeed's module-level tables
    (``mpu.forget_grid``), then megatron's grid and its process groups (collective: every
    rank calls it). Without the teardown a ZeRO-1/2 run's model, fp32 masters and
    moments stayed alive after the session was dropped, with no root the garbage collector
    could see (tests/toolkit/runtime/test_correctness.py::test_close_gives_the_run_back). With
    DeepSpeed's bf16 optimizer the parameters go at the second collection, not the first.
    A ZeRO-3 model stayed alive even so, held by process-wide state DeepSpeed's teardown
    leaves (``engine.drop_module_references`` removes it). The session must not be used
    afterwards. A background save still pending is completed first (train.async_save)."""
    async_save.finish(sess.saves)
    sess.engine.destroy()
    drop_module_references(sess.engine)
    forget_grid(sess.engine)
    release_model_parallel()
