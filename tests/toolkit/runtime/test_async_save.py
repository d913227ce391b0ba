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


def _write_after_sigterm(path: str) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    with open(path, "w") as f:
        f.write("written")


def _writer(request, path: str) -> None:
    """A forked writer of a rank that has the runtime's handlers (a preemption signal ends a forked
    helper: toolkit.runtime.interrupt)."""
    request.async_fn(*request.async_fn_args)


@pytest.mark.parametrize("shield", [True, False])
def test_a_background_writer_outlives_the_preemption_signal(tmp_path, shield):
    """megatron's AsyncRequest, run in a forked process as its TemporalAsyncCaller runs it: the
    writer that `shielded` made finishes its file though SIGTERM came (the rank finalizes the save
    after its step); an unshielded one dies of it, as every forked helper of a rank does."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    path = str(tmp_path / "file")
    request = AsyncRequest(_write_after_sigterm, (path,), [])
    if shield:
        request = async_save.shielded(request)
    old, hook = {s: signal.getsignal(s) for s in (*interrupt.SIGNALS, *interrupt.PREEMPT_SIGNALS)}, sys.unraisablehook
    interrupt.install()
    try:
        p = multiprocessing.get_context("fork").Process(target=_writer, args=(request, path))
        p.start()
        p.join(60)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        sys.unraisablehook = hook
    if shield:
        assert p.exitcode == 0 and open(path).read() == "written"
    else:
        assert p.exitcode == -signal.SIGTERM and not os.path.exists(path)
