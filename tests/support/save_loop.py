"""Not a test module: one process (the tiny Llama recipe, one rank) continues from OUT's latest
checkpoint (the runtime's own --resume path: every file's CRC-32 checked, weights and optimizer
state loaded) or starts afresh, says ``ready``, then saves checkpoint after checkpoint through
the runtime's own save path, with one training step between saves, saying ``step N LOSS LR
GRAD_NORM`` (the floats' repr) after each step and ``latest N`` (what OUT/checkpoints/latest
names) after each save call, until it is killed.

    python tests/support/save_loop.py OUT sync|async

async: train.async_save (a save runs beside the next step and completes at the latest when the
next save starts). train.keep_checkpoints=2.
"""
import sys
from pathlib import Path

from runtime_worker import recipe_spec


def main(out: str, mode: str) -> None:
    from toolkit import quiet
    from toolkit.mcore.rendezvous import single_process_env

    single_process_env("")
    quiet.quiet_run(cpu=True, transformer_engine=False)
    from toolkit.mcore.cpu_compat import eager_fusers

    eager_fusers()  # as the command line does before megatron is imported
    from toolkit.mcore.distributed import init_process_group
    from toolkit.plan import make_plan
    from toolkit.runtime import trainer
    from toolkit.runtime.checkpoint_folder import LATEST, resume_point

    plan = make_plan(recipe_spec("llama8b", 1, {"train.steps": 10**6, "train.keep_checkpoints": 2,
                                                 "train.async_save": mode == "async"}))
    init_process_group()
    load = resume_point(Path(out) / "checkpoints")
    opts = trainer.RunOptions(out=Path(out), data="builtin", load=str(load) if load else None, resume=True,
                              overwrite=True)
    sess = trainer.setup(plan, opts)
    trainer.prepare_out(plan, opts, sess.state.step)
    latest = Path(out) / "checkpoints" / LATEST
    print("ready", sess.state.step, flush=True)
    while True:
        m = trainer.run_step(sess, sess.state.step)
        print("step", m.step, repr(m.loss), repr(m.lr), repr(m.grad_norm), flush=True)
        trainer.save_checkpoint(sess)
        print("latest", latest.read_text().removeprefix("global_step") if latest.is_file() else 0, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
