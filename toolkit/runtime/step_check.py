"""What every rank must agree on after a step, in the one all-reduce the step already does.

Every step all-reduces the mean loss over all ranks (the last stage's losses; each
tensor-parallel group contributes once). The same reduction carries, in one float64 vector
summed over all ranks (`layout`):

  [0]           the loss contribution of this rank (its mean over micro-batches / dp x cp);
  [1]           1 when this rank received a preemption signal (SIGTERM, SIGUSR1);
  [2]           1 when the gradient norm DeepSpeed computed in its step is NaN or Inf;
  [3 + r]       1 when rank r's own micro-batch losses hold a NaN or Inf.

So every rank learns in the same step, from the same numbers, whether any rank was signalled
(Megatron-LM's DistributedSignalHandler all-gathers its flag once per iteration: here no
collective is added) and whether the step went bad and where: they stop, save or skip at the
same step, and a save (collective) cannot deadlock on a rank that went on. The flags are set
on the device from the losses (no host wait per micro-batch); the host reads the vector once,
where it read the loss before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ToolkitError
from . import interrupt

LOSS, PREEMPT, BAD_NORM, FIRST_RANK = 0, 1, 2, 3
STOP, SKIP = "stop", "skip"  # train.on_nan


class NonFiniteError(ToolkitError):
    """A step's loss or gradient norm was NaN or Inf and train.on_nan says stop (or the
    engine applied the update, which on_nan=skip cannot take back)."""

    exit_code = 5


@dataclass(frozen=True)
class Verdict:
    loss: float
    preempt: bool  # some rank received a preemption signal: stop after this step, saving
    bad_norm: bool  # the gradient norm is NaN or Inf
    bad_ranks: tuple[int, ...]  # ranks whose own losses hold a NaN or Inf

    @property
    def bad(self) -> bool:
        return self.bad_norm or bool(self.bad_ranks) or not math.isfinite(self.loss)


def size(world: int) -> int:
    return FIRST_RANK + world


def vector(losses: list[torch.Tensor], rank: int, world: int, contributes: bool, scale: float,
           preempt: bool, grad_norm: float | None, device) -> torch.Tensor:
    """This rank's part of the sum (see the module docstring). `contributes`: this rank adds
    its losses to the mean (tensor-parallel rank 0 of the last stage); `scale`: 1 / (dp x cp).
    The loss flags are computed on the device: nothing here waits for it."""
    t = torch.zeros(size(world), dtype=torch.float64, device=device)
    if losses:
        stacked = torch.stack(losses).double()
        t[FIRST_RANK + rank] = (~torch.isfinite(stacked)).any().double()
        if contributes:
            t[LOSS] = stacked.sum() / len(losses) * scale
    t[PREEMPT] = float(preempt)
    t[BAD_NORM] = float(grad_norm is not None and not math.isfinite(grad_norm))
    return t


def read(summed: list[float]) -> Verdict:
    """The all-reduced vector as every rank reads it."""
    ranks = tuple(r for r, v in enumerate(summed[FIRST_RANK:]) if v > 0)
    return Verdict(summed[LOSS], summed[PREEMPT] > 0, summed[BAD_NORM] > 0, ranks)


def agree(losses: list[torch.Tensor], grad_norm: float | None, device) -> Verdict:
    """The step's loss on every rank (mean over micro-batches and data-parallel ranks of the
    last stage; each tp group contributes once) and what every rank must know of the step:
    a preemption signal on any rank, a NaN or Inf loss or gradient norm. One all-reduce over
    all ranks, the one the loss needed anyway (the module docstring)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)  # cp ranks: see engine.mean_token_loss
    t = vector(losses, dist.get_rank(), dist.get_world_size(), ps.get_tensor_model_parallel_rank() == 0,
               1.0 / dp_cp, interrupt.preempt_signal() is not None, grad_norm, device)
    dist.all_reduce(t)
    # one copy to the host (on CUDA it waits for the device), as float(t) of the loss alone did; on
    # CPU tests/support/host_syncs.py cannot see it (no aten op runs): 6 reads per step there, 7 before
    return read(t.cpu().tolist())


def bad_step_message(step: int, v: Verdict, grad_norm: float | None, on_nan: str) -> str:
    """One line naming the step, what was not finite and on which rank."""
    what = []
    if v.bad_ranks:
        what.append(f"the loss is {v.loss} on rank{'s' if len(v.bad_ranks) > 1 else ''} "
                    f"{', '.join(map(str, v.bad_ranks))}")
    if v.bad_norm:
        what.append(f"the gradient norm is {grad_norm}")
    if not what:
        what.append(f"the loss is {v.loss}")
    if on_nan == STOP:
        return (f"step {step}: {' and '.join(what)} (train.on_nan=stop; train.on_nan=skip drops such a step's "
                "update and goes on)")
    return (f"step {step}: {' and '.join(what)}, and the engine applied the update (train.on_nan=skip needs "
            "DeepSpeed to drop it: bf16, fp16 or ZeRO)")
