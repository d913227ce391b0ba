"""Ctrl-C on a run: one line from rank 0 and exit 130 on every rank, no traceback; a
preemption signal (SIGTERM, SIGUSR1): the run finishes its step, saves and stops.

A terminal's Ctrl-C sends SIGINT to every process of the launch at once (the launcher and
each rank); the deepspeed launcher then sends SIGTERM to the ranks, and torchrun's agent
does too. The first signal raises ``Interrupted`` in a rank's main thread (toolkit.atomic's
class: a BaseException, so no ``except Exception`` on the way up swallows it); later ones
are ignored, so the unwinding runs to its end. A rank blocked in a collective when a peer
left first gets that collective's error (gloo: "Connection closed by peer") before its own
handler has run (Python runs it at the next function call): ``seen()`` runs a pending handler
first, so that error counts as the interrupt it is (toolkit.cli.train.main calls it again
when the handler ran at the call itself).

SIGTERM and SIGUSR1 are what a scheduler sends before it ends a job (SLURM's ``--signal``,
its time limit, a preemption; torchrun's agent forwards the one it got). Before the run's
first step (``training()``) there is nothing to save: they end the rank at once, as Ctrl-C
does (exit 128 + signal). From then on they only record the signal (``preempt_signal()``),
as Megatron-LM's ``--exit-signal-handler`` (megatron/training/dist_signal_handler.py) does,
and the train loop stops every rank at the same step, saves there and exits with
``PREEMPTED`` (toolkit.runtime.trainer: the flag rides on the step's one loss all-reduce). A
save in progress is not disturbed by them; Ctrl-C (SIGINT) still interrupts at once (a save it
cuts short leaves only its temporary folder). A SIGTERM after SIGINT (the deepspeed launcher's,
after the terminal's Ctrl-C) is ignored.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ..atomic import Interrupted, hold_across_forks

SIGNALS = (signal.SIGINT,)
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED = 4  # toolkit.errors.EXIT_CODES: stopped by a preemption signal, after saving
_received: int | None = None
_preempt: int | None = None  # the first preemption signal
_owner: int | None = None  # the process that installed the handler


def _forked(signum: int) -> bool:
    """A forked helper (dist_checkpointing's writers, a pool's workers) got the signal too: it ends
    by it, quietly, as it would without these handlers (a pool's terminate() sends SIGTERM)."""
    if os.getpid() == _owner:
        return False
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return True


def _handler(signum: int, frame) -> None:
    global _received
    if _forked(signum):
        return
    if _received is None:
        _received = signum
        raise Interrupted(signum)


def _preempt_handler(signum: int, frame) -> None:
    """Record it, nothing else: the train loop stops at the end of the step."""
    global _preempt
    if not _forked(signum) and _preempt is None:
        _preempt = signum


def _unraisable(u) -> None:
    """Python runs a signal's handler at the next bytecode, which may be where an exception
    cannot propagate: a ``__del__``, a weakref callback, a fork hook. Python would print it
    there ("Exception ignored in ...") and go on as if no signal came: the rank would keep
    training alone, or wait for writers that died of the same Ctrl-C, until the launcher kills
    it 30 s later, silently. Such an Interrupted is sent again a moment later (from a timer
    thread: sent from here, its handler would run here again), to be raised at a safe point.
    Forks, where this was seen (megatron's checkpoint writers), hold SIGINT back instead
    (toolkit.atomic.hold_across_forks), so that it is raised right after os.fork returns."""
    global _received
    if isinstance(u.exc_value, Interrupted) and os.getpid() == _owner:
        _received = None
        threading.Timer(RESEND_S, os.kill, (os.getpid(), u.exc_value.signum)).start()
        return
    _default_unraisable(u)


_default_unraisable = sys.unraisablehook
RESEND_S = 0.05
def install() -> None:
    """From now on the first SIGINT raises Interrupted in this process (later ones and SIGTERM
    after it are ignored; one raised where Python cannot propagate it is raised again at a safe
    point: _unraisable, toolkit.atomic.hold_across_forks); until ``training()`` SIGTERM/SIGUSR1
    do the same, and from then on they are recorded for the train loop. A process forked from it
    (megatron's checkpoint writers) dies of any of them quietly."""
    global _owner, _preempt
    _owner, _preempt = os.getpid(), None
    for s in (*SIGNALS, *PREEMPT_SIGNALS):
        signal.signal(s, _handler)
    sys.unraisablehook = _unraisable
    hold_across_forks((*SIGNALS, *PREEMPT_SIGNALS))


def training() -> None:
    """The run has its state and steps next: a preemption signal is recorded from now on (the
    loop saves and stops every rank at the step's end). Before, while the rank starts up, there
    is nothing to save and it ends the rank at once, as an interrupt: a launcher's SIGTERM after
    another rank failed (rank 0's one-line error) held a starting rank until the launcher's
    SIGKILL 30 s later. Nothing when ``install`` was not called in this process."""
    if _owner != os.getpid():
        return
    for s in PREEMPT_SIGNALS:
        signal.signal(s, _preempt_handler)


def preempt_signal() -> int | None:
    """The preemption signal this process received (SIGTERM or SIGUSR1), if any."""
    return _preempt


def _run_pending_handlers() -> None:
    """A Python call: the interpreter runs handlers of signals that arrived during a C call here."""


def seen() -> int | None:
    """The signal that interrupted this process, if any (after running a pending handler)."""
    with contextlib.suppress(Interrupted):  # asked, not acted on: the caller decides what an interrupt means
        _run_pending_handlers()
    return _received


@dataclass
class Progress:
    """What rank 0 says when interrupted: where the run stood."""

    total: int = 0
    step: int | None = None  # the last step whose metrics were printed
    out: Path | None = None  # the run folder
    checkpoints: Path | None = None  # the checkpoint root (its `latest` names the last checkpoint)


def message(signum: int, p: Progress) -> str:
    name = signal.Signals(signum).name
    if p.step is None:
        return f"interrupted by {name} before the first step"
    head = f"interrupted by {name} after step {p.step}/{p.total}"
    from .checkpoint_folder import LATEST

    latest = p.checkpoints / LATEST if p.checkpoints is not None else None
    if latest is None or not latest.is_file():
        return f"{head}; no checkpoint was written yet"
    return f"{head}; the last checkpoint is {latest.read_text().strip()}: continue with --load {p.out}"


def preempted_message(step: int, p: Progress, checkpoint: Path, signum: int | None) -> str:
    """Rank 0's line when a preemption signal stopped the run after saving `checkpoint`."""
    got = f"{signal.Signals(signum).name} here" if signum is not None else "SIGTERM or SIGUSR1 on another rank"
    return (f"preempted ({got}): stopped after step {step}/{p.total} and saved {checkpoint}; "
            f"run the same command with --resume to continue (exit {PREEMPTED})")
