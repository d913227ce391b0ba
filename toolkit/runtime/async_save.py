"""Checkpoints written while training goes on (``train.async_save``), through megatron-core's
own asynchronous dist_checkpointing, the way Megatron-LM's training loop drives it
(megatron/training/async_utils.py: ``schedule_async_save``, ``maybe_finalize_async_save``
after every step, blocking at the end).

A save (toolkit.runtime.checkpoint.save with a queue) gathers what each rank writes as it
does synchronously, then hands megatron's ``dist_checkpointing.save(..., async_sharded_save=
True)`` requests to an ``AsyncCallsQueue``: megatron's TemporalAsyncCaller forks a writer per
request (on a GPU after copying the tensors to the host; on the CPU the fork's copy-on-write
pages are the snapshot) and the step that follows runs while it writes. After each step
``poll`` asks, in one small all-reduce over the ranks and only while a save is pending, whether
every rank's writer is done; when they are, the requests' finalize functions run on every rank
in order: megatron's (the torch_dist ``.metadata`` and ``metadata.json``), then the
checkpoint's own (checkpoint._complete: CRC-32 of every file, train_state.json last, the
rename, ``latest``, train.keep_checkpoints). So a checkpoint is "latest" only once every rank's
files are complete, exactly as with a synchronous save, and a kill at any moment leaves the
previous one latest. One save is in flight at a time (a new one first waits for the one
before), and ``finish`` completes a pending one before the run returns: at the last step, at a
preemption (whose checkpoint must be complete before the process exits) and after an agreed
NaN stop.

A writer forked from a rank would die of the preemption signal the scheduler sends to every
process of the job (toolkit.runtime.interrupt: forked helpers end by it): the writer blocks
SIGTERM and SIGUSR1 (``shielded``), so the save in flight completes and the rank, which
stops after its step, finalizes it before it exits. Ctrl-C (SIGINT) still ends it: the save
is abandoned and the previous checkpoint stays latest.
"""
from __future__ import annotations

import functools
import signal
from collections.abc import Callable

from .interrupt import PREEMPT_SIGNALS


def queue():
    """A queue of background saves: megatron-core's AsyncCallsQueue with its forked
    (TemporalAsyncCaller) writers, Megatron-LM's default. On the CPU, megatron's own results
    queue comes back (toolkit.mcore.cpu_compat item 11): a forked writer's results must reach
    the rank through it."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from ..mcore import cpu_compat

    cpu_compat.cross_process_save_queue()
    return AsyncCallsQueue(persistent=False)


def schedule(saves, requests: list, complete: Callable[[], None]) -> None:
    """Collective: start writing `requests` (megatron AsyncRequests, in order) in the background
    after any save still pending is complete; `complete` runs, on every rank, after the last
    request's own finalization, once every rank's writers are done."""
    finish(saves)
    requests[-1].add_finalize_fn(complete)
    for r in requests:
        saves.schedule_async_request(shielded(r))


def poll(saves) -> None:
    """Collective, between steps: complete the pending save if every rank has written its files
    (one all-reduce while one is pending; nothing otherwise)."""
    if saves is not None and saves.get_num_unfinalized_calls():
        saves.maybe_finalize_async_calls(blocking=False)


def finish(saves) -> None:
    """Collective: wait for the pending save's writers and complete it."""
    if saves is not None and saves.get_num_unfinalized_calls():
        saves.maybe_finalize_async_calls(blocking=True)


def shielded(request):
    """`request` whose writer blocks the preemption signals (its own forked writers inherit the
    mask) before writing."""
    if request.async_fn is None:
        return request
    return request._replace(async_fn=functools.partial(_without_preemption, request.async_fn))


def _without_preemption(fn: Callable, *args, **kwargs) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPT_SIGNALS)
    fn(*args, **kwargs)
