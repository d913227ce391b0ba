"""Tensors whose megatron value is the HF value plus a constant (a weight table's ``shift``:
Qwen3-Next's gated delta net norm, applied by transformers as w and by megatron-core as
(1 + w) under layernorm_zero_centered_gamma, so megatron's = HF's - 1), seen through a source.

``Shifted`` shows a stream.Source with those tensors' rows computed: read, plus the shift in
fp32, cast back to the stored dtype; every other tensor passes through untouched (its bytes,
its file extent). HF -> megatron adds the table's shift to the HF tensors it names; megatron
-> HF subtracts it from the megatron rank tensors of those names. For the norm weights
transformers initialises at 1 (within [0.5, 2]) both directions are exact: w - 1 is exact
there (Sterbenz), and (w - 1) + 1 = w is representable.
"""
from __future__ import annotations

import re
from collections.abc import Hashable

import numpy as np


class Shifted:
    """A stream.Source over ``source`` where the tensors ``shift_of`` gives a non-zero shift for
    are computed (see module doc)."""

    def __init__(self, source, exact: dict[str, float], patterns: tuple[tuple[str, float], ...] = ()):
        self.source, self.exact, self.patterns = source, exact, tuple((re.compile(p), v) for p, v in patterns)

    def shift_of(self, name: Hashable) -> float:
        # a legacy rank tensor's Local key, a torch_dist chunk's DistChunk (its stored key), or an HF name
        text = name.name if hasattr(name, "name") else getattr(name, "key", name)
        if text in self.exact:
            return self.exact[text]
        return next((v for p, v in self.patterns if isinstance(text, str) and p.fullmatch(text)), 0.0)

    def meta(self, name):
        return self.source.meta(name)

    def window(self, name, start: int, stop: int):
        shift = self.shift_of(name)
        if not shift:
            return self.source.window(name, start, stop)
        if stop <= start:
            return None
        import torch

        _, dtype = self.source.meta(name)
        raw = np.frombuffer(self.source.window(name, start, stop), dtype=np.uint8).copy()
        values = torch.from_numpy(raw).view(dtype.torch)
        out = (values.float() + shift).to(dtype.torch)
        return memoryview(out.view(torch.uint8).numpy()).cast("B")

    def extent(self, name, start: int, stop: int):
        """Only unshifted tensors lie in a file as they are; shifted rows are computed (None)."""
        if self.shift_of(name) or not hasattr(self.source, "extent"):
            return None
        return self.source.extent(name, start, stop)

    def __getattr__(self, attr):  # tensors, queued, close, ... of the wrapped source
        return getattr(self.source, attr)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.source.close()


def hf_shifts(mm) -> dict[str, float]:
    """HF tensor name -> shift, for HF -> megatron (a shifted mapping reads one HF tensor)."""
    return {e.hf[0]: e.mapping.shift for e in (t.entry for t in mm.tensors) if e.mapping.shift}


def megatron_shift_patterns(mm) -> tuple[tuple[str, float], ...]:
    """Rank-tensor and torch_dist key patterns (any layer number) -> the shift to take off, for
    megatron -> HF."""
    found = {}
    for e in (t.entry for t in mm.tensors):
        if e.mapping.shift:
            m = re.match(r"decoder\.layers\.\d+\.(.*)$", e.name)
            found[r"decoder\.layers\.\d+\." + re.escape(m.group(1)) if m else re.escape(e.name)] = -e.mapping.shift
    return tuple(found.items())


def shifted(source, exact: dict[str, float], patterns: tuple[tuple[str, float], ...] = ()):
    """The source itself when nothing is shifted."""
    return Shifted(source, exact, patterns) if exact or patterns else source
