"""toolkit.bridge without process groups: what it accepts as a model, and what it refuses before
any collective."""
from __future__ import annotations

import pytest
import torch

from toolkit.bridge import BridgeError, load_hf
from toolkit.bridge.export import buckets
from toolkit.bridge.live import chunks_of, current_layout


class _Stage(torch.nn.Module):
    def __init__(self, chunks):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)


class _Engine:
    """What the runtime's DeepSpeed engine exposes that the bridge reads."""

    def __init__(self, module):
        self.module, self.optimizer = module, object()


def test_chunks_of_every_kind_of_model():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert chunks_of(a) == [a]
    assert chunks_of([a, b]) == [a, b]
    assert chunks_of(_Stage([a, b])) == [a, b]
    assert chunks_of(_Engine(_Stage([a, b]))) == [a, b]


def test_load_into_an_engine_is_refused(tmp_path):
    with pytest.raises(BridgeError, match="fp32 master copies"):
        load_hf(_Engine(_Stage([torch.nn.Linear(2, 2)])), tmp_path)


def test_layout_needs_parallel_state():
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(BridgeError, match="parallel_state is not initialised"):
        current_layout()


def test_buckets_group_consecutive_tensors_aligned():
    sizes = [10, 10, 100, 3]  # 16, 16, 104, 8 bytes once aligned to 8
    assert buckets(sizes, 0) == [[0], [1], [2], [3]]
    assert buckets(sizes, 24) == [[0], [1], [2], [3]]
    assert buckets(sizes, 40) == [[0, 1], [2], [3]]
    assert buckets(sizes, 1000) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("name, refused", [("gpt-oss-tiny", "packed in 3-D"),
                                           ("qwen3-next-tiny", "megatron's value minus a constant"),
                                           ("qwen3-moe-tiny", None)])
def test_families_whose_weights_it_cannot_move_are_named(name, refused):
    from converters.mapping import ModelMap
    from toolkit.bridge.live import family_problem
    from toolkit.models import load_model

    shape = load_model(name)
    problem = family_problem(shape, ModelMap(shape, shape.vocab_size))
    assert (problem is None) if refused is None else (refused in problem), problem
