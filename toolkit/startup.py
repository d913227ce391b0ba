"""A training process's start-up: the libraries' imports without the garbage collector.

Importing torch, megatron-core, DeepSpeed and transformers makes about a million objects
that live as long as the process. CPython's collector makes a full collection each time the
long-lived objects grow by a quarter: during a rank's imports that is several full
collections, each walking every object made so far, and none finds much (imports make
little garbage). ``imports_uncollected`` runs such imports with the collector off and then
freezes what they made (``gc.freeze``: the permanent generation, which later collections
skip; the pattern CPython's documentation gives for a process's long-lived start-up state),
so the collections during training walk only the objects training makes. What the imports
left as garbage cycles stays (a few kilobytes: no tensor is made there).
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def imports_uncollected() -> Iterator[None]:
    """The body (imports) with the collector off, then ``gc.freeze``. A caller that turned the
    collector off keeps it off and nothing is frozen."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
