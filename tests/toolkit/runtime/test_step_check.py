"""The step's agreement vector (toolkit.runtime.step_check): what each rank puts in the one
all-reduce of the step, what every rank reads from the sum, and the line of a bad step. The
2-rank run that uses it: tests/toolkit/runtime/test_preemption.py."""
import math

import torch

from toolkit.errors import EXIT_CODES
from toolkit.runtime import interrupt, step_check, trainer


def summed(*parts: torch.Tensor) -> list[float]:
    """What dist.all_reduce(SUM) makes of the ranks' vectors."""
    return torch.stack(parts).sum(0).tolist()


def test_every_rank_reads_the_same_loss_stop_and_bad_ranks():
    one, nan = [torch.tensor(2.0), torch.tensor(4.0)], [torch.tensor(2.0), torch.tensor(float("nan"))]
    r0 = step_check.vector(one, 0, 3, True, 0.5, False, 1.5, "cpu")
    r1 = step_check.vector([torch.tensor(1.0), torch.tensor(3.0)], 1, 3, True, 0.5, True, 1.5, "cpu")
    r2 = step_check.vector(one, 2, 3, False, 0.5, False, 1.5, "cpu")  # tp rank 1: flags, no loss
    v = step_check.read(summed(r0, r1, r2))
    assert v == step_check.Verdict(loss=2.5, preempt=True, bad_norm=False, bad_ranks=()) and not v.bad
    bad = step_check.read(summed(r0, step_check.vector(nan, 1, 3, True, 0.5, False, float("inf"), "cpu"), r2))
    assert math.isnan(bad.loss) and bad.bad_ranks == (1,) and bad.bad_norm and bad.bad and not bad.preempt
    norm_only = step_check.read(summed(step_check.vector(one, 0, 1, True, 1.0, False, float("nan"), "cpu")))
    assert norm_only.bad and norm_only.bad_ranks == () and norm_only.loss == 3.0
    assert step_check.vector([], 0, 2, True, 1.0, False, None, "cpu").tolist() == [0.0] * 5  # not the last stage


def test_bad_step_lines_and_exit_codes():
    v = step_check.Verdict(float("nan"), False, True, (1,))
    assert step_check.bad_step_message(7, v, float("inf"), "stop") == (
        "step 7: the loss is nan on rank 1 and the gradient norm is inf (train.on_nan=stop; train.on_nan=skip "
        "drops such a step's update and goes on)")
    assert step_check.bad_step_message(7, step_check.Verdict(1.0, False, True, ()), float("nan"), "skip") == (
        "step 7: the gradient norm is nan, and the engine applied the update (train.on_nan=skip needs DeepSpeed to "
        "drop it: bf16, fp16 or ZeRO)")
    assert step_check.NonFiniteError.exit_code == 5 and "NaN or Inf" in EXIT_CODES[5]
    assert interrupt.PREEMPTED == 4 and "--resume" in EXIT_CODES[4]


def test_metrics_lines_are_strict_json():
    m = trainer.StepMetrics(4, float("nan"), 1e-3, float("inf"), 10.0, 0.5, None, 1)
    assert trainer.metrics_line(m) == {"step": 4, "loss": None, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 10.0,
                                       "step_time_s": 0.5, "skipped_steps": 1}
    assert "skipped_steps" not in trainer.metrics_line(trainer.StepMetrics(1, 2.0, 1e-3, 1.0, 10.0, 0.5))
