"""train.async_save's pieces that need no process group (the saves themselves run on 2 ranks in
tests/toolkit/runtime/test_preemption.py, and killed at random moments in test_checkpoint.py)."""
import multiprocessing
import os
import signal
import sys

import pytest

from toolkit.errors import SpecError
from toolkit.runtime import async_save, interrupt

from tests.toolkit.runtime.test_units import tiny


def test_the_key_and_its_misspelling():
    assert tiny(train__async_save=True).spec.train.async_save is True
    assert tiny().spec.train.async_save is False
    with pytest.raises(SpecError, match=r"unknown key 'train.async_sav' \(did you mean 'async_save'\?\)"):
        tiny(train__async_sav=True)


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def _append_after_sigterm(path: str, text: str) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    _append(path, text)


def _run_writer(request) -> None:
    request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)


def _forked_writer(request) -> int:
    """Run `request`'s writer as megatron's TemporalAsyncCaller does (a forked process), in a
    process that has the runtime's signal handlers (toolkit.runtime.interrupt: a preemption
    signal ends a forked helper); its exit code."""
    old, hook = {s: signal.getsignal(s) for s in (*interrupt.SIGNALS, *interrupt.PREEMPT_SIGNALS)}, sys.unraisablehook
    interrupt.install()
    try:
        p = multiprocessing.get_context("fork").Process(target=_run_writer, args=(request,))
        p.start()
        p.join(60)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        sys.unraisablehook = hook
    return p.exitcode


def test_one_writer_for_the_parts_in_order_and_the_preemption_signal_outlived(tmp_path):
    """megatron's AsyncRequests of a save's parts become one: its writer writes them in order (megatron's writers
    share one results queue, whose first result each part's finalization takes), stages what a part stages before
    the fork (preload_fn), skips a part with nothing on this rank, and outlives SIGTERM (the rank finalizes the
    save after its step); its finalization is the parts' in order, then the checkpoint's completion. The part's
    own writer, forked the same way, dies of SIGTERM, as every forked helper of a rank does."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    path, done = str(tmp_path / "file"), []
    parts = [AsyncRequest(_append_after_sigterm, (path, None), [lambda: done.append("model")],
                          preload_fn=lambda: "weights;"),
             AsyncRequest(None, (), [lambda: done.append("nothing here")]),
             AsyncRequest(_append, (path, "optimizer;"), [lambda: done.append("optimizer")])]
    request = async_save.one_request(parts, lambda: done.append("complete"))
    assert request.preload_fn is None and request.async_fn_args[0][0][1] == (path, "weights;")
    assert _forked_writer(request) == 0
    assert open(path).read() == "weights;optimizer;"
    for f in request.finalize_fns:
        f()
    assert done == ["model", "nothing here", "optimizer", "complete"]
    assert _forked_writer(AsyncRequest(_append_after_sigterm, (path, "lost"), [])) == -signal.SIGTERM
    assert open(path).read() == "weights;optimizer;"
    assert async_save.one_request([parts[1]], lambda: None).async_fn is None  # nothing to write: no writer


def test_the_fork_settles_only_where_cpython_can_deadlock_the_writer(monkeypatch):
    """python/cpython#112275 (a child forked while another thread holds the runtime's thread-state
    lock waits for it forever) is fixed from 3.11.10 and in 3.12: only earlier 3.11 releases wait
    SETTLE_S before megatron forks the writer."""
    assert async_save.fork_deadlock_possible((3, 11, 7)) and async_save.fork_deadlock_possible((3, 11, 9))
    assert not async_save.fork_deadlock_possible((3, 11, 10)) and not async_save.fork_deadlock_possible((3, 12, 0))
    slept = []
    monkeypatch.setattr(async_save.time, "sleep", slept.append)
    monkeypatch.setattr(async_save, "fork_deadlock_possible", lambda: True)
    async_save.settle_before_fork()
    monkeypatch.setattr(async_save, "fork_deadlock_possible", lambda: False)
    async_save.settle_before_fork()
    assert slept == [async_save.SETTLE_S]
