"""Train a spec with DeepSpeed + megatron-core on every rank of a launch.

`python -m toolkit.cli.train --spec spec.yaml` (what the generated launch scripts start)
and `recipes/NAME.py` (the same code with a spec-returning function). Command-line code:
parses, calls toolkit.runtime.trainer.train, prints on rank 0.

    deepspeed [--num_gpus N | --hostfile H] recipes/NAME.py [--flavor tiny] [--steps K] [--exit-interval N]
        [--out DIR] [--data PREFIX] [--load DIR | --resume | --resume-fallback]
        [--override-scheduler | --use-checkpoint-scheduler] [--export-hf DIR] [--export-peft DIR] [--dry-run]
        [--overwrite] [--set key=value ...]

Started without a launcher (no RANK in the environment), a run trains on this one process.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .. import quiet
from ..atomic import Interrupted
from ..errors import MissingInputError, SpecError, ToolkitError
from ..mcore.rendezvous import check_master_port, rank, single_process_env, world
from ..runtime import interrupt
from ..spec import TrainingSpec, parse_assignment
from ..startup import imports_uncollected

ERROR_GRACE_S = 10.0  # ranks other than 0 wait this long before exiting with an error rank 0 prints


def parser(recipe: str | None, description: str | None = None) -> argparse.ArgumentParser:
    """``recipe``: the recipe's name (its file's stem), None for the --spec entry point."""
    name = f"{recipe}-FLAVOR" if recipe else "SPEC_NAME"
    out_help = (f"run folder: spec.yaml, metrics.jsonl, checkpoints/ (with --dry-run: configs/) (default: "
                f"runs/{name}, plus one part per --set, e.g. runs/" + (f"{recipe}-tiny-tp2" if recipe else "NAME-tp2")
                + " with --set parallel.tp=2)")
    p = argparse.ArgumentParser(prog=Path(sys.argv[0]).name, description=description or __doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Without a launcher (RANK not set) a run trains on this one process; "
                                       "`deepspeed --num_gpus N ...` starts N ranks.")
    if recipe:
        p.add_argument("--flavor", choices=["full", "tiny"], default="full",
                       help="tiny: the same family at a tiny size, layout scaled to the ranks present")
    else:
        p.add_argument("--spec", required=True, type=Path, help="training spec (YAML)")
    p.add_argument("--steps", type=int, help="train this many optimizer steps (train.steps)")
    p.add_argument("--exit-interval", type=positive, metavar="N",
                   help="stop after the first step divisible by N, saving a checkpoint there (Megatron-LM's "
                        "--exit-interval): train part of a planned schedule, continue it later with --load")
    p.add_argument("--out", type=Path, help=out_help)
    p.add_argument("--data", help="Megatron indexed dataset prefix (PREFIX.bin/.idx; train.data_path)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--load", help="checkpoint to resume, or a torch_dist model to start from")
    start.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint of the run folder (--out) when there is "
                            "one, else start afresh: one command line for the first start and every restart (a "
                            f"requeued job). SIGTERM or SIGUSR1 stops a run after its step, saving: exit "
                            f"{interrupt.PREEMPTED}")
    start.add_argument("--resume-fallback", action="store_true",
                       help="as --resume, and when the latest checkpoint is incomplete or damaged (a file whose "
                            "size or CRC-32 differs from what was saved), continue from the newest whole one before "
                            "it instead of stopping")
    sched = p.add_mutually_exclusive_group()
    sched.add_argument("--override-scheduler", dest="scheduler", action="store_const", const="override",
                       help="resuming a checkpoint whose learning-rate schedule differs from this run's "
                            "(another --steps, lr, warm-up, global batch): use this run's (Megatron-LM's "
                            "--override-opt_param-scheduler)")
    sched.add_argument("--use-checkpoint-scheduler", dest="scheduler", action="store_const", const="checkpoint",
                       help="resuming a checkpoint whose learning-rate schedule differs from this run's: keep the "
                            "checkpoint's (Megatron-LM's --use-checkpoint-opt_param-scheduler)")
    p.add_argument("--export-hf", type=Path, help="write the final weights as a Hugging Face model here (LoRA: the "
                   "adapters merged into the base)")
    p.add_argument("--export-peft", type=Path, help="finetune.method lora: write the adapters here in peft's format "
                   "(adapter_config.json, adapter_model.safetensors), for peft.PeftModel.from_pretrained")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write the configs; train nothing")
    p.add_argument("--check", action="store_true", help="check the spec, its layout and its data; start nothing (the "
                   "generated launch scripts run this before the launcher: one line when something is missing)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run folder / export")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec key, e.g. --set parallel.tp=2 (repeatable)")
    p.add_argument("--verbose", action="store_true", help="also print what DeepSpeed, megatron-core and torch "
                   f"say about their own calls (or set {quiet.VERBOSE_ENV}=1)")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # added by the deepspeed launcher
    return p


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of steps, not {value}")
    return value


def default_run_dir(name: str, sets: list[str]) -> Path:
    """runs/NAME plus one part per --set (``parallel.tp=2`` -> ``tp2``), so that runs of
    different recipes, flavours and layouts never share a folder by default."""
    parts = [name]
    for text in sets:
        key, _, value = text.partition("=")
        value = re.sub(r"[^A-Za-z0-9.-]+", "", value.strip())
        leaf = key.strip().split(".")[-1]
        parts.append(f"{leaf}{value}" if re.fullmatch(r"[0-9.]+|true|false", value) else f"{leaf}-{value}")
    return Path("runs") / "-".join(parts)


def run_name(args, recipe: str | None) -> str:
    return f"{recipe}-{args.flavor}" if recipe else Path(args.spec).stem


def build_spec(args, make_spec: Callable[[], TrainingSpec] | None, tiny_model: str | None) -> TrainingSpec:
    from ..runtime.recipe import tiny_flavor

    spec = make_spec() if make_spec else TrainingSpec.from_yaml(args.spec)
    if getattr(args, "flavor", "full") == "tiny":
        spec = tiny_flavor(spec, tiny_model, world())
    over = dict(parse_assignment(s) for s in args.sets)
    if args.steps is not None:
        over["train.steps"] = args.steps
    if args.data is not None:  # the run's spec.yaml records the data it trained on
        over["train.data_path"] = args.data
    return spec.with_overrides(over) if over else spec


def print_step(m, progress: interrupt.Progress) -> None:
    progress.step, total = m.step, progress.total
    norm = f"{m.grad_norm:.3f}" if m.grad_norm is not None else "-"
    mtp = "".join(f" | mtp_{k + 1} loss {v:.4f}" for k, v in enumerate(m.mtp_loss or []))
    skipped = f" | skipped steps {m.skipped_steps}" if m.skipped_steps else ""
    mtp += f" | validation loss {m.valid_loss:.4f}" if m.valid_loss is not None else ""
    print(f"step {m.step:>5}/{total} | loss {m.loss:.4f}{mtp} | lr {m.lr:.3e} | grad norm {norm} | "
          f"{m.tokens_per_s:,.0f} tok/s | {m.step_time_s:.3f} s{skipped}", flush=True)


def dry_run(plan, out: Path, overwrite: bool) -> int:
    from rich.console import Console

    from ..emit import write_artifacts
    from ..emit.launch import launch_warnings
    from .plan import plan_table

    if rank() == 0:
        Console(highlight=False).print(plan_table(plan))
        if plan.valid:
            write_artifacts(plan, out / "configs", overwrite=overwrite)
            print(f"wrote the generated configs to {out / 'configs'} (dry run: nothing trained)")
            for warning in launch_warnings(plan):
                print(f"warning: {warning}", file=sys.stderr)
    return 0 if plan.valid else 2


def check_data(spec: TrainingSpec, tiny: bool) -> None:
    """Before a rank builds anything (and with --check before anything is imported): is there
    data (--data or train.data_path; the tiny flavour has a corpus of its own), and do its
    files exist?"""
    prefix = spec.train.data_path
    if prefix is None and not tiny:
        raise SpecError("no training data: pass --data PREFIX (`toolkit data prepare` makes one) or set "
                        "train.data_path")
    missing = [f"{prefix}{s}" for s in (".bin", ".idx") if prefix is not None and not Path(f"{prefix}{s}").is_file()]
    if missing:
        raise MissingInputError(f"dataset '{missing[0]}' does not exist (make it with `toolkit data prepare`)")


def start_communication() -> None:
    """The process group (a one-line error when another launch holds MASTER_PORT) and
    DeepSpeed's communication backend over it, whose CPU shared-memory op prints a line as
    it loads; DeepSpeed's own initialisation later finds both up."""
    import torch.distributed as dist

    from ..mcore.distributed import init_process_group, start_deepspeed_comm

    init_process_group()
    start_deepspeed_comm(dist.get_backend())


def run(args, spec: TrainingSpec, recipe: str | None, progress: interrupt.Progress) -> int:
    from ..kernels import CPU, spec_kernels
    from ..plan import make_plan

    plan = make_plan(spec)
    out = args.out or default_run_dir(run_name(args, recipe), args.sets)
    if args.dry_run:
        return dry_run(plan, out, args.overwrite)
    plan.require_valid()
    tiny = getattr(args, "flavor", None) == "tiny"
    if args.check:  # no launcher here: the world is the launcher's to make
        check_data(spec, tiny)
        return 0
    from ..runtime.world import WorldSizeError, check_world

    try:  # before the runtime's imports: a launch with the wrong number of ranks fails at once
        check_world(plan, world())
    except WorldSizeError as e:
        hint = "; use --flavor tiny" if recipe and getattr(args, "flavor", "") == "full" else ""
        raise WorldSizeError(f"{e}{hint}") from None
    check_master_port()  # before the imports below: the other ranks need seconds to reach the port
    quiet.quiet_run(cpu=spec.cluster.gpu == CPU, transformer_engine=spec_kernels(spec).transformer_engine)
    with imports_uncollected():  # the runtime's libraries: seconds of imports
        from ..mcore.cpu_compat import eager_fusers

        eager_fusers()  # before megatron is imported (CPU only)
        from ..runtime import trainer
    check_data(spec, tiny)  # before any model or process group is built
    script = f"recipes/{recipe}.py" if recipe else "--module toolkit.cli.train"
    note = single_process_env(f"deepspeed --num_gpus N {script} {args.command}".rstrip())
    if rank() == 0:
        print("\n".join(filter(None, [note, f"run folder: {out}"])), flush=True)
    from ..runtime.export import check_export, check_export_peft
    from ..runtime.monitor import check_monitor_packages

    check_export(plan, args.export_hf, args.overwrite)
    check_export_peft(plan, args.export_peft, args.overwrite)
    check_monitor_packages(spec)
    opts = trainer.RunOptions(out=out, data=spec.train.data_path or (trainer.BUILTIN if tiny else None),
                              load=args.load, overwrite=args.overwrite, exit_interval=args.exit_interval,
                              scheduler=args.scheduler, resume=args.resume or args.resume_fallback,
                              fallback=args.resume_fallback)
    if args.resume or args.resume_fallback:
        opts = resumed_options(plan, opts, args.resume_fallback)
    start_communication()
    progress.total, progress.out = spec.train.steps, out
    progress.checkpoints = trainer.checkpoint_root(plan, opts)
    sess = trainer.train(plan, opts, on_step=lambda m: print_step(m, progress),
                         on_resume=lambda r: print(r.line(), flush=True))
    if sess.preempted is not None:
        if rank() == 0:
            print(interrupt.preempted_message(sess.state.step, progress, sess.preempted, interrupt.preempt_signal()),
                  file=sys.stderr, flush=True)
        trainer.close(sess)
        return interrupt.PREEMPTED
    if rank() == 0 and sess.state.step < spec.train.steps:
        print(f"stopped after step {sess.state.step} of {spec.train.steps} (--exit-interval {args.exit_interval}); "
              f"continue with --load {out} --steps {spec.train.steps}", flush=True)
    if args.export_hf:
        from ..runtime.export import export_hf

        export_hf(sess, args.export_hf, overwrite=args.overwrite)
        if rank() == 0:
            print(f"exported the final weights to {args.export_hf}")
    if args.export_peft:
        from ..runtime.export import export_peft

        export_peft(sess, args.export_peft, overwrite=args.overwrite)
        if rank() == 0:
            print(f"exported the adapters in peft's format to {args.export_peft}")
    trainer.close(sess)
    return 0


def resumed_options(plan, opts, fallback: bool = False):
    """--resume: --load the run folder's latest complete checkpoint, or start afresh without
    one (a run stopped before its first save has nothing to continue); --resume-fallback: when
    the latest is incomplete or damaged, the newest whole one before it."""
    import dataclasses

    from ..runtime.checkpoint_folder import resume_point
    from ..runtime.trainer import checkpoint_root

    found = resume_point(checkpoint_root(plan, opts), fallback)
    return dataclasses.replace(opts, load=str(found) if found is not None else None)


def recipe_of(make_spec: Callable[[], TrainingSpec] | None) -> tuple[str | None, str | None]:
    """(name, docstring) of the recipe module that defines ``make_spec``."""
    if make_spec is None:
        return None, None
    module = sys.modules.get(make_spec.__module__)
    path = Path(getattr(module, "__file__", None) or sys.argv[0])
    return path.stem, getattr(module, "__doc__", None)


def main(argv: list[str] | None = None, make_spec: Callable[[], TrainingSpec] | None = None,
         tiny_model: str | None = None) -> int:
    """Returns the exit code; errors print one line (on rank 0) and exit non-zero, and so
    does Ctrl-C (SIGINT): 130 on every rank; SIGTERM or SIGUSR1 (a scheduler's preemption
    notice) ends the step, saves and exits 4 on every rank."""
    recipe, doc = recipe_of(make_spec)
    args = parser(recipe, doc).parse_args(argv)
    args.command = shlex.join(sys.argv[1:] if argv is None else argv)
    quiet.set_verbose(args.verbose)
    quiet.quiet_imports()
    interrupt.install()
    progress = interrupt.Progress()
    try:
        from ..mcore.rendezvous import check_master_port
        from ..runtime.checkpoint_folder import load_source

        check_master_port()  # rank 0, before any import of seconds: a port another launch holds
        load_source(args.load)  # a missing or incomplete checkpoint is said before torch is imported
        with imports_uncollected():  # torch, for the tiny flavour
            spec = build_spec(args, make_spec, tiny_model)
        code = run(args, spec, recipe, progress)
        leave_process_groups()  # every rank ended the run together (trainer.close): nothing in flight
        return code
    except BaseException as e:
        error = e
    try:
        return exit_code(error, progress)
    except Interrupted:  # a signal that arrived during a C call had its handler run only here (it raises once)
        return exit_code(error, progress)


def exit_code(e: BaseException, progress: interrupt.Progress) -> int:
    """The exit code of a run that raised ``e``, after rank 0 said why in one line; an
    interrupt wins over the error it caused (a collective whose peer rank left first). A
    launcher's SIGTERM (or SIGUSR1) that came while the rank was already leaving with an error
    does not: the error is the exit code (every rank finds the same error; rank 0 exits first,
    and a rank slower to leave got the launcher's SIGTERM a second later, exit 143 instead of
    the error's, in a loaded CI run)."""
    signum = interrupt.seen()
    error = error_before_signal(e) if signum in interrupt.PREEMPT_SIGNALS else None
    if signum is not None and error is None and not isinstance(e, SystemExit):
        if rank() == 0:
            print(interrupt.message(signum, progress), file=sys.stderr, flush=True)
        return 128 + signum
    e = error or e
    if not isinstance(e, ToolkitError):
        raise e
    if rank() == 0:
        print(f"error: {e}", file=sys.stderr, flush=True)
        leave_process_groups()
        return e.exit_code
    # every rank finds the same error; the launcher ends the others (SIGTERM) when the first exits, so
    # the rest leave rank 0 the time to print it (it exits first); the launcher's SIGTERM (recorded as a
    # preemption notice: it interrupts nothing) or an interrupt ends the wait, or came already
    if signum is None:
        wait_for_rank_0()
    leave_process_groups()
    return e.exit_code


def error_before_signal(e: BaseException) -> ToolkitError | None:
    """The ToolkitError a rank was leaving with when a signal came: ``e`` itself (the signal's
    handler ran after it was raised) or the error an Interrupted interrupted (its context). None
    when the signal came first: an Interrupted in the error's own context, the error it caused."""
    error = e.__context__ if isinstance(e, Interrupted) else e
    if not isinstance(error, ToolkitError):
        return None
    cause = error.__context__
    while cause is not None:
        if isinstance(cause, Interrupted):
            return None
        cause = cause.__context__
    return error


def wait_for_rank_0(poll_s: float = 0.05) -> None:
    """Up to ERROR_GRACE_S, until a SIGTERM/SIGUSR1 (the launcher's, once rank 0 has exited) or
    an interrupt. Sleeping through the launcher's SIGTERM held every failed launch 10 s longer."""
    deadline = time.monotonic() + ERROR_GRACE_S
    with contextlib.suppress(Interrupted):
        while time.monotonic() < deadline and interrupt.preempt_signal() is None:
            time.sleep(poll_s)


def leave_process_groups() -> None:
    """Destroy this rank's process groups before it exits after a run or an error that every rank
    reached (no collective in flight; not after an interrupt, where one may be). A rank that exited
    with its gloo groups alive while another rank still held their connections aborted now and then
    in the C++ teardown ("terminate called without an active exception", exit -6 instead of the
    error's code: 2 of 15 two-rank exits after one all_gather_object, 0 of 20 with the groups
    destroyed first)."""
    if "torch.distributed" not in sys.modules:  # errors found before torch was imported
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from ..mcore.distributed import destroy

        destroy()


if __name__ == "__main__":
    sys.exit(main())
