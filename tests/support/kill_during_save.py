"""Not a test module: one process trains the tiny Llama recipe for 2 steps, saving after each,
and kills itself (SIGKILL: nothing of Python's runs after it) in the middle of the step-2 save,
after the weights are written and before the optimizer state.

    python tests/support/kill_during_save.py OUT
"""
import os
import signal
import sys
from pathlib import Path

from runtime_worker import recipe_spec

SETS = {"train.steps": 2, "train.save_interval": 1}


def main(out: str) -> None:
    from toolkit import quiet
    from toolkit.mcore.rendezvous import single_process_env

    single_process_env("")
    quiet.quiet_run(cpu=True, transformer_engine=False)
    from toolkit.mcore.cpu_compat import eager_fusers

    eager_fusers()  # as the command line does before megatron is imported
    from toolkit.plan import make_plan
    from toolkit.runtime import checkpoint, trainer

    plan = make_plan(recipe_spec("llama8b", 1, SETS))
    real = checkpoint._save_part

    def save_part(folder: Path, *args, **kwargs):
        if folder.name == checkpoint.OPTIMIZER and "global_step2" in folder.parent.name:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(folder, *args, **kwargs)

    checkpoint._save_part = save_part
    trainer.train(plan, trainer.RunOptions(out=Path(out), data="builtin"))


if __name__ == "__main__":
    main(sys.argv[1])
