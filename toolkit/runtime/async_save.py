"""Checkpoints written while training goes on (``train.async_save``), through megatron-core's
own asynchronous dist_checkpointing, the way Megatron-LM's training loop drives it
(megatron/training/async_utils.py: ``schedule_async_save``, ``maybe_finalize_async_save``
after every step, blocking at the end).

A save (toolkit.runtime.checkpoint.save with a queue) gathers what each rank writes as it
does synchronously, then hands megatron's ``dist_checkpointing.save(..., async_sharded_save=
True)`` requests, as one (``one_request``), to an ``AsyncCallsQueue``: megatron's
TemporalAsyncCaller forks its writer (on a GPU after copying the tensors to the host; on the CPU
the fork's copy-on-write pages are the snapshot) and the step that follows runs while it
writes. After each step ``poll`` asks, in one small all-reduce over the ranks and only while a save is pending, whether
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
SIGTERM and SIGUSR1 (``_write_all``), and the results queue's server ignores them
(``results_queue``), so the save in flight completes and the rank, which stops after its step,
finalizes it before it exits. Ctrl-C (SIGINT) still ends it: the save is abandoned and the
previous checkpoint stays latest.
"""
from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

from .interrupt import PREEMPT_SIGNALS

_manager = None  # the results queue's server process (results_queue)


def queue():
    """A queue of background saves: megatron-core's AsyncCallsQueue with its forked
    (TemporalAsyncCaller) writers, Megatron-LM's default, and the writers' results queue."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    results_queue()
    return AsyncCallsQueue(persistent=False)


def results_queue() -> None:
    """A forked writer hands its results back through ``filesystem_async._results_queue``, which
    megatron makes the queue of a spawned multiprocessing Manager (on the CPU a synchronous save
    uses an in-process one instead: toolkit.mcore.cpu_compat item 11, which cannot cross a fork).
    The same Manager here, once per process, its server ignoring the preemption signals: SLURM
    signals every process of the job step, and a server that died of the notice would fail the
    save in flight and the one the notice asks for."""
    global _manager
    if _manager is not None:
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    _manager.start(_ignore_preemption)
    filesystem_async._results_queue = _manager.Queue()


def _ignore_preemption() -> None:
    for s in PREEMPT_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def schedule(saves, requests: list, complete: Callable[[], None]) -> None:
    """Collective: start writing `requests` (megatron AsyncRequests, in order) in the background
    after any save still pending is complete; `complete` runs, on every rank, after the requests'
    own finalization, once every rank's writer is done."""
    finish(saves)
    settle_before_fork()
    saves.schedule_async_request(one_request(requests, complete))


FORK_SAFE = (3, 11, 10)  # the first 3.11 release after the fix of python/cpython#112275 (backport #112336)
SETTLE_S = 0.2


def fork_deadlock_possible(version: tuple = sys.version_info[:3]) -> bool:
    """CPython 3.11 before FORK_SAFE (python/cpython#112275): a forked child deletes the parent's
    other thread states under the runtime's thread-state lock before re-initialising that lock, so
    a child forked while another thread held it waits for it forever. A ProcessGroupGloo worker
    thread takes it without the GIL each time it frees a finished collective's tensors (pybind11's
    gil_scoped_acquire -> PyThreadState_New; gdb on a rank, 110 times in two minutes of the tiny
    recipe): a writer forked just after a collective hung (tests/toolkit/runtime/test_preemption.py,
    once in ten runs beside other multi-rank tests)."""
    return version[:2] == (3, 11) and tuple(version) < FORK_SAFE


def settle_before_fork() -> None:
    """Where that deadlock is possible, give the collective threads SETTLE_S to free the tensors of
    the collectives just finished before megatron forks the writer: it narrows the window, it does
    not close it (Python 3.11.10 or later does)."""
    if fork_deadlock_possible():
        time.sleep(SETTLE_S)


def one_request(requests: list, complete: Callable[[], None]):
    """One AsyncRequest that writes all of `requests` one after the other in one writer, its
    finalization theirs in order and then `complete`. One writer, because megatron's writers put
    their results in one process-wide queue and each request's finalization takes the first
    result there: two writers at once could hand the weights' metadata the optimizer's results.
    Megatron-LM, too, writes one request per save. What a request stages before its writer is
    forked (``preload_fn``: on a GPU the copy to the host, the snapshot) is staged now, as
    megatron's TemporalAsyncCaller does."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    calls = []
    for r in requests:
        if r.async_fn is None:  # nothing of this part on this rank
            continue
        args = list(r.async_fn_args)
        if r.preload_fn:
            args[1] = r.preload_fn()
        calls.append((r.async_fn, tuple(args), dict(r.async_fn_kwargs)))
    finalize = [f for r in requests for f in r.finalize_fns] + [complete]
    return AsyncRequest(_write_all if calls else None, (calls,), finalize)


def _write_all(calls: list) -> None:
    """The writer: blocks the preemption signals (its own forked writers inherit the mask), then
    writes each part in turn."""
    signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPT_SIGNALS)
    for fn, args, kwargs in calls:
        fn(*args, **kwargs)


def poll(saves) -> None:
    """Collective, between steps: complete the pending save if every rank has written its files
    (one all-reduce while one is pending; nothing otherwise)."""
    if saves is not None and saves.get_num_unfinalized_calls():
        saves.maybe_finalize_async_calls(blocking=False)


def finish(saves) -> None:
    """Collective: wait for the pending save's writers and complete it."""
    if saves is not None and saves.get_num_unfinalized_calls():
        saves.maybe_finalize_async_calls(blocking=True)
