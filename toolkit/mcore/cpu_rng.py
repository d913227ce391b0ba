"""megatron-core's RNG tracker without CUDA (toolkit.mcore.cpu_compat installs it; never on a GPU).

megatron draws dropout masks from named random streams: the default generator (the same on
every tensor-parallel rank: dropout of activations every tp rank holds whole) and the
tracker's 'model-parallel-rng' (seed + 2718 + tp rank: attention-probability dropout, whose
heads differ per tp rank, and everything under sequence parallelism, whose tokens differ) and
'expert-parallel-rng' (seed + 1024 + 100 ep rank + etp rank), each entered with
``get_cuda_rng_tracker().fork(name)``. Its ``CudaRNGStatesTracker`` keeps CUDA generator
states and swaps the CUDA generator. On CPU the dropout kernels draw from torch's default
CPU generator, so this tracker keeps CPU generator states and swaps that one, with megatron's
bookkeeping (names, seeds, the stream current when forks nest); megatron's own
``model_parallel_cuda_manual_seed`` seeds it, and activation recompute saves and restores its
states through the inherited ``get_states`` / ``set_states`` (with torch's CPU state, which
megatron's checkpoint function saves too). megatron's inference tracker, installed here
before, forked nothing: every tp rank drew the same attention-dropout mask.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel import random as megatron_random

DEFAULT = "default-rng"  # megatron's name of the stream outside any fork


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """megatron's CudaRNGStatesTracker over torch's default CPU generator."""

    def add(self, name: str, seed: int) -> None:
        """Track a stream seeded with `seed`; the default generator is left as it is."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Draw from stream `name` inside the block; the stream left current before is resumed."""
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer, outer_name = torch.get_rng_state(), self._current_state_name
        if outer_name != DEFAULT:
            self.states_[outer_name] = outer
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current state name {self._current_state_name} is not the same as the desired "
                                f"state name {name}.")
            self.states_[name] = torch.get_rng_state()
            if outer_name != DEFAULT:
                outer = self.states_[outer_name]
            torch.set_rng_state(outer)
            self._current_state_name = outer_name


def install() -> None:
    """Make the tracker megatron's (``get_cuda_rng_tracker()`` returns it from now on); it is
    empty until ``model_parallel_cuda_manual_seed`` adds the streams."""
    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
