"""Not a test module: runs a recipe's command line (``toolkit.cli.train.main`` through the
recipe file, as `python recipes/NAME.py ...` does) with test-only events at given steps, set
by patching the runtime from outside as tests/support/runtime_worker.py's Nudge does (the
runtime itself reads no test switch):

    python tests/support/preempt_recipe.py [--signal STEP:RANK:SIGNAL ...] [--signal-in-save STEP:RANK:SIGNAL ...] \\
        [--nan STEP:RANK ...] recipes/NAME.py ARGS...

--signal: rank RANK sends itself SIGNAL (SIGTERM, SIGUSR1) as step STEP (1-based) starts, a
real signal through the runtime's own handler; --signal-in-save: the same in the middle of the
save of step STEP (after its weights, before its optimizer state), to the rank and every process
it started (as SLURM signals every process of a job step: with train.async_save, the writers'
results queue's server); --nan: rank RANK's loss of every micro-batch of
step STEP is multiplied by NaN before its backward (so its gradients are NaN too).
Each rank is started by the test itself (RANK, WORLD_SIZE, MASTER_ADDR/PORT set), as srun
starts the tasks of a job, so each rank's own exit code is seen.
"""
import argparse
import os
import runpy
import signal
import sys


def at(text: str) -> tuple:
    parts = text.split(":")
    return (int(parts[0]), int(parts[1]), *parts[2:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--signal", type=at, action="append", default=[])
    p.add_argument("--signal-in-save", type=at, action="append", default=[])
    p.add_argument("--nan", type=at, action="append", default=[])
    p.add_argument("recipe")
    args, rest = p.parse_known_args()
    me = int(os.environ.get("RANK", "0"))
    signals = {step: getattr(signal, name) for step, rank, name in args.signal if rank == me}
    in_save = {step: getattr(signal, name) for step, rank, name in args.signal_in_save if rank == me}
    nans = {step for step, rank in args.nan if rank == me}
    current = [0]

    from toolkit import quiet

    quiet.quiet_run(cpu=True, transformer_engine=False)  # what the command line says before its imports
    from toolkit.mcore.cpu_compat import eager_fusers

    eager_fusers()  # and does
    from toolkit.runtime import checkpoint, engine, trainer

    real_batches, real_loss, real_save_part = trainer.micro_batches, engine.mean_token_loss, checkpoint._save_part

    def micro_batches(sess, step):
        current[0] = step + 1
        if current[0] in signals:
            os.kill(os.getpid(), signals[current[0]])
        return real_batches(sess, step)

    def mean_token_loss(*args, **kwargs):  # the runtime's own arguments, whatever they are
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if current[0] in nans else loss

    def save_part(folder, *args, **kwargs):
        step = int(folder.parent.name.split(".partial-")[0].removeprefix(".global_step"))
        if folder.name == checkpoint.OPTIMIZER and step in in_save:
            import psutil

            for child in psutil.Process().children(recursive=True):
                os.kill(child.pid, in_save[step])
            os.kill(os.getpid(), in_save[step])
        return real_save_part(folder, *args, **kwargs)

    trainer.micro_batches, engine.mean_token_loss, checkpoint._save_part = micro_batches, mean_token_loss, save_part
    sys.argv = [args.recipe, *rest]
    runpy.run_path(args.recipe, run_name="__main__")


if __name__ == "__main__":
    main()
