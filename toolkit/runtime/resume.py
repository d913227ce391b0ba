"""What a resumed run takes from its checkpoint besides the tensors: the learning-rate
schedule, the sample position, where it stops, and the line that says what it did.

Schedule: Megatron-LM's rule. megatron-core's ``OptimizerParamScheduler.load_state_dict``
compares each value of the checkpoint's schedule with the run's (``_check_and_set``: peak and
minimum lr, warm-up and decay lengths in samples, decay style, weight decay) and stops on a
difference unless told to take the run's (Megatron-LM's ``--override-opt_param-scheduler``)
or to keep the checkpoint's (``--use-checkpoint-opt_param-scheduler``); the position
(``num_steps``, in samples) always comes from the checkpoint. Here the same with
``--override-scheduler`` / ``--use-checkpoint-scheduler``: the difference is found before
anything is built and said in one line with the numbers (exit 2), and the choice is applied
by megatron-core's own ``load_state_dict``. (Before, the spec silently decided: resuming a
10-step run with ``--steps 20`` stretched the cosine over 20 steps, the lr jumped from
3.66e-4 at step 10 to 1.65e-3 at step 11 and the loss rose 4.956 -> 5.028.) To train longer
on one schedule, plan the whole length and stop early: ``--exit-interval N`` (Megatron-LM's)
stops after the first step divisible by N, saving a checkpoint there.

Samples: the position is the samples consumed (Megatron-LM's ``consumed_train_samples``),
carried from step to step, so a resumed run with another global batch reads on from there
without a gap (8 -> 16 after step 2: samples 16..31, then 32..47). A sample is seq_len + 1
tokens of the shuffled epoch, so another seq_len would be another sequence of samples:
carry_over.data_problem refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ..errors import SpecError

OVERRIDE, CHECKPOINT = "override", "checkpoint"  # --override-scheduler, --use-checkpoint-scheduler
FLAGS = {OVERRIDE: "--override-scheduler", CHECKPOINT: "--use-checkpoint-scheduler"}
# megatron-core's _check_and_set fields, in load_state_dict's order -> how the difference reads
FIELDS = {
    "max_lr": "peaks at lr {c}, this run's at {m}",
    "min_lr": "ends at min_lr {c}, this run's at {m}",
    "lr_warmup_steps": "warms up over {c}, this run's over {m}",
    "lr_decay_steps": "decays over {c}, this run's over {m}",
    "lr_decay_style": "decays by {c}, this run's by {m}",
    "start_wd": "starts weight decay at {c}, this run's at {m}",
    "end_wd": "ends weight decay at {c}, this run's at {m}",
    "wd_incr_steps": "changes weight decay over {c}, this run's over {m}",
    "wd_incr_style": "changes weight decay by {c}, this run's by {m}",
}
SAMPLE_FIELDS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


class SchedulerMismatchError(SpecError):
    """The checkpoint's learning-rate schedule is not this run's, and no flag says which to use."""


@dataclass(frozen=True)
class Resumed:
    """What --load did, for the command line's one line (rank 0)."""

    folder: Path
    step: int  # optimizer steps done before this run
    consumed_samples: int
    schedule: str | None  # how the learning rate continues; None: bare weights, starting at step 0
    batch: str | None = None  # the global batch, when it differs from the checkpoint's
    skipped: list[str] = field(default_factory=list)  # newer checkpoints --resume-fallback passed over, and why

    def line(self) -> str:
        if self.schedule is None:
            return f"loaded the weights of '{self.folder}'; training starts at step 0"
        extra = f"; {self.batch}" if self.batch else ""
        skipped = f"; skipped {', '.join(self.skipped)}" if self.skipped else ""
        return (f"resumed '{self.folder}' at step {self.step} ({self.consumed_samples} samples consumed); "
                f"{self.schedule}{extra}{skipped}")


def last_step(start: int, steps: int, exit_interval: int | None) -> int:
    """The step this run stops after: train.steps, or with --exit-interval N the first step
    after `start` divisible by N (Megatron-LM's ``iteration % exit_interval == 0``)."""
    if not exit_interval:
        return steps
    return min(steps, (start // exit_interval + 1) * exit_interval)


def save_steps(start: int, last: int, save_interval: int) -> list[int]:
    """The steps after which this run saves: every save_interval-th, and its last."""
    return [s for s in range(start + 1, last + 1) if s % save_interval == 0 or s == last]


def planned(plan):
    """megatron-core's OptimizerParamScheduler as the engine builds it for this plan (at sample
    0, on no parameters): its values are what this run's schedule is."""
    from .engine import lr_scheduler

    return lr_scheduler(plan)(SimpleNamespace(param_groups=[]))


def checkpoint_schedule(plan, saved: dict):
    """The checkpoint's schedule read by megatron-core's own load_state_dict (which knows its
    older key names) into a scheduler of this plan told to keep the checkpoint's values."""
    sched = planned(plan)
    sched.override_opt_param_scheduler, sched.use_checkpoint_opt_param_scheduler = False, True
    sched.load_state_dict(saved)
    return sched


def _amount(field: str, value, global_batch: int | None) -> str:
    if field in SAMPLE_FIELDS and global_batch and value % global_batch == 0:
        return f"{value // global_batch} steps ({value} samples)"
    return f"{value} samples" if field in SAMPLE_FIELDS else f"{value:g}" if isinstance(value, float) else str(value)


def differences(mine: dict, theirs: dict, my_batch: int, their_batch: int | None) -> list[str]:
    """How the checkpoint's schedule (`theirs`, a state_dict) differs from this run's, field by
    field; the weight-decay length is left out when the decay length says the same thing."""
    out = [(f, FIELDS[f].format(c=_amount(f, theirs[f], their_batch), m=_amount(f, mine[f], my_batch)))
           for f in FIELDS if theirs[f] != mine[f]]
    if len(out) > 1:
        out = [(f, text) for f, text in out if f != "wd_incr_steps"]
    return [text for _, text in out]


def schedule_problem(plan, saved: dict, choice: str | None) -> str | None:
    """The one line that stops a resume whose schedule differs and no flag decides it."""
    sched = saved.get("lr_scheduler")
    if sched is None:
        return (f"the checkpoint holds no learning-rate schedule: {FLAGS[CHECKPOINT]} has nothing to keep"
                if choice == CHECKPOINT else None)
    diff = differences(planned(plan).state_dict(), checkpoint_schedule(plan, sched).state_dict(),
                       plan.batch.global_, saved.get("global_batch"))
    if not diff or choice is not None:
        return None
    return (f"the checkpoint's schedule {'; '.join(diff)}: pass {FLAGS[OVERRIDE]} to use this run's, "
            f"or {FLAGS[CHECKPOINT]} to keep the checkpoint's")


def apply_schedule(scheduler, saved: dict, consumed_samples: int, choice: str | None) -> None:
    """Set the engine's megatron scheduler to the resumed position: megatron-core's
    load_state_dict with Megatron-LM's flags (schedule_problem has made sure that without a flag
    every value agrees), or, when the checkpoint holds no schedule, this run's at the samples
    consumed."""
    scheduler.num_steps = 0
    sched = saved.get("lr_scheduler")
    if sched is None:
        scheduler.step(consumed_samples)
        return
    scheduler.override_opt_param_scheduler = choice == OVERRIDE
    scheduler.use_checkpoint_opt_param_scheduler = choice == CHECKPOINT
    scheduler.load_state_dict(sched)


def summary(sched: dict, global_batch: int) -> str:
    warm = sched["lr_warmup_steps"]
    warmup = f"{_amount('lr_warmup_steps', warm, global_batch)} of warm-up, then " if warm else ""
    decay = _amount("lr_decay_steps", sched["lr_decay_steps"], global_batch)
    return f"{warmup}{sched['lr_decay_style']} decay over {decay}"


def describe_schedule(plan, saved: dict, choice: str | None) -> str:
    """How the learning rate continues, for Resumed.schedule."""
    sched = saved.get("lr_scheduler")
    if sched is None:
        return f"learning rate: this run's schedule from sample {saved['consumed_samples']} (the checkpoint holds none)"
    mine, theirs = planned(plan).state_dict(), checkpoint_schedule(plan, sched).state_dict()
    diff = differences(mine, theirs, plan.batch.global_, saved.get("global_batch"))
    if not diff:
        return f"learning rate: the checkpoint's schedule, the same as this run's ({summary(mine, plan.batch.global_)})"
    if choice == OVERRIDE:
        return f"learning rate: this run's schedule ({FLAGS[OVERRIDE]}; the checkpoint's {'; '.join(diff)})"
    return f"learning rate: the checkpoint's schedule ({FLAGS[CHECKPOINT]}; it {'; '.join(diff)})"


def describe_batch(plan, saved: dict) -> str | None:
    before = saved.get("global_batch")
    if before is None or before == plan.batch.global_:
        return None
    return (f"global batch {plan.batch.global_}, the checkpoint's {before}: the next step reads samples "
            f"{saved['consumed_samples']}..{saved['consumed_samples'] + plan.batch.global_ - 1}")
