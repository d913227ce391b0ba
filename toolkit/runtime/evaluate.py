"""Validation loss, as Megatron-LM computes it (train.eval_interval, train.eval_iters,
train.valid_data_path).

After step s, when s is a multiple of eval_interval (and after the run's last step), the model
runs forward only, in eval mode (no dropout), over eval_iters global batches of the validation
dataset. Evaluation k (k = ceil(s / eval_interval)) reads the validation samples
[(k - 1) x eval_iters x global, k x eval_iters x global): each evaluation sees the next
batches, as Megatron-LM's validation iterator, whose position it also derives from the
iteration on a resume. Each rank takes its part of a batch with the training sampler
(data.sample_ids). The loss is per token over everything evaluated: the token losses summed
over all micro-batches and data-parallel (and cp) ranks over their count, as Megatron-LM's
evaluate() reduces its (loss sum, token count) pairs. With pp > 1 the stages run one
micro-batch after another (forward only, megatron's exchanges through toolkit.runtime.pipeline.P2P).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def due(step: int, interval: int | None, last: int) -> bool:
    return interval is not None and (step % interval == 0 or step == last)


def first_sample(step: int, interval: int, iters: int, global_batch: int) -> int:
    return (math.ceil(step / interval) - 1) * iters * global_batch


def evaluate(sess, step: int, micro_batches_of) -> float:
    """The validation loss after `step`, on every rank. `micro_batches_of(dataset, first)`
    gives this rank's micro-batches of the global batch starting at sample `first`
    (toolkit.runtime.trainer.batches_at)."""
    from megatron.core import parallel_state as ps

    t, b = sess.plan.spec.train, sess.plan.batch
    start = first_sample(step, t.eval_interval, t.eval_iters, b.global_)
    totals = torch.zeros(2, dtype=torch.float64, device=sess.engine.device)
    contributes = ps.get_tensor_model_parallel_rank() == 0
    one = torch.ones((), device=sess.engine.device)
    modes = [c.training for c in sess.chunks]
    for c in sess.chunks:
        c.eval()
    try:
        with torch.no_grad():
            for i in range(t.eval_iters):
                for mb in micro_batches_of(sess.valid_dataset, start + i * b.global_):
                    loss_sum = forward_only(sess, {**mb, "loss_denominator": one})
                    if loss_sum is not None and contributes:
                        totals += torch.stack([loss_sum.double(), mb["loss_mask"].sum(dtype=torch.float64)])
    finally:
        for c, mode in zip(sess.chunks, modes):
            c.train(mode)
        forget_mtp_values()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1].clamp(min=1))


def forward_only(sess, mb: dict) -> torch.Tensor | None:
    """One micro-batch through every virtual stage of this rank; its loss sum on the last one."""
    if sess.pipe is None:
        return sess.engine(**mb)
    from .pipeline import P2P

    p2p, pipe, out = P2P(sess.pipe), sess.pipe, None
    for c, chunk in enumerate(sess.stage.chunks):
        x = None if (c == 0 and pipe.stage == 0) else p2p(recv_prev=True)[0]
        y = sess.engine(**mb, hidden=x, chunk=c)
        if chunk.post_process:
            out = y
        else:
            p2p(send_next=y)
    return out


def forget_mtp_values() -> None:
    """megatron's GPTModel logs MTP losses in forward; evaluation's must not reach the next
    training step's mtp_loss (trainer.mean_mtp_loss)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def open_valid(plan, opts, open_dataset):
    """The validation dataset, or None without train.eval_interval."""
    t = plan.spec.train
    if t.eval_interval is None:
        return None
    return open_dataset(plan, opts, t.valid_data_path, cache="valid_data_cache")

