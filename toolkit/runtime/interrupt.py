"""Ctrl-C on a run: one line from rank 0 and exit 130 on every rank, no traceback.

A terminal's Ctrl-C sends SIGINT to every process of the launch at once (the launcher and
each rank); the deepspeed launcher then sends SIGTERM to the ranks, and torchrun's agent
does too. The first signal raises ``Interrupted`` in a rank's main thread (toolkit.atomic's
class: a BaseException, so no ``except Exception`` on the way up swallows it); later ones
are ignored, so the unwinding runs to its end. A rank blocked in a collective when a peer
left first gets that collective's error (gloo: "Connection closed by peer") before its own
handler has run (Python runs it at the next function call): ``seen()`` runs a pending handler
first, so that error counts as the interrupt it is (toolkit.cli.train.main calls it again
when the handler ran at the call itself).
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from ..atomic import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: int | None = None
_owner: int | None = None  # the process that installed the handler


def _handler(signum: int, frame) -> None:
    global _received
    if os.getpid() != _owner:  # a forked helper (dist_checkpointing's writers) got the terminal's signal too:
        signal.signal(signum, signal.SIG_DFL)  # it ends by it, quietly, as it would without this handler
        os.kill(os.getpid(), signum)
        return
    if _received is None:
        _received = signum
        raise Interrupted(signum)


def install() -> None:
    """From now on the first SIGINT/SIGTERM raises Interrupted in this process (later ones are
    ignored); a process forked from it (megatron's checkpoint writers) dies of it quietly."""
    global _owner
    _owner = os.getpid()
    for s in SIGNALS:
        signal.signal(s, _handler)


def _run_pending_handlers() -> None:
    """A Python call: the interpreter runs handlers of signals that arrived during a C call here."""


def seen() -> int | None:
    """The signal that interrupted this process, if any (after running a pending handler)."""
    try:
        _run_pending_handlers()
    except Interrupted:
        pass
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
