"""data_time.tensor_calls, the NCCL calls of DeepSpeed's whole-tensor buckets, against a tensor-by-tensor
replay of the two rules DeepSpeed's code follows (ZeRO-3's prefetch closes a bucket once it holds the size;
the gradient buckets are sent before the tensor that would overflow them). The rules themselves are checked
against DeepSpeed's own calls in tests/toolkit/estimate/test_zero3_prefetch.py."""
import itertools
import random

import pytest

from toolkit.estimate.data_time import BOTH, deepspeed_tail, first_bucket, megatron_buckets, tensor_calls
from toolkit.estimate.memory import stage_params
from toolkit.models import load_model
from toolkit.parallel.layout import Layout


def _replay(sizes: list[int], size: float, flush: bool) -> int:
    calls, held = 0, 0
    for n in sizes:
        if flush and held and held + n > size:
            calls, held = calls + 1, 0
        held += n
        if not flush and held >= size:
            calls, held = calls + 1, 0
    return calls + (held > 0)


def test_run_arithmetic_is_the_tensor_by_tensor_replay():
    rng = random.Random(0)
    for _ in range(3000):
        kinds = [(tuple((rng.choice([1, 3, 7, 50, 120, 400]), rng.randint(1, 6)) for _ in range(rng.randint(1, 5))),
                  rng.choice([1, 2, 3, 7, 60, 300])) for _ in range(rng.randint(1, 3))]
        size = rng.choice([1, 5, 64, 100, 333, 1000])
        tensors = tuple(((runs, ()), layers) for runs, layers in kinds)
        sizes = [n for runs, layers in kinds for _ in range(layers) for n, count in runs for _ in range(count)]
        for flush in (False, True):
            assert tensor_calls(tensors, False, size, flush) == _replay(sizes, size, flush), (kinds, size, flush)


def test_a_tensor_larger_than_the_bucket_is_a_call_of_its_own():
    """Llama-3-70B, one stage: at DeepSpeed's 5e7-element prefetch a layer is 4 gathers (linear_qkv,
    linear_proj, linear_fc1, linear_fc2, each with the norm before it), not 856M / 5e7 = 17."""
    p = stage_params(load_model("llama3-70b"), Layout(), 0)
    assert tensor_calls(p.tensors, False, 5e7) == 80 * 4 + 2  # and the embedding, the output layer
    assert round(p.dense / 5e7) == 1411
    assert tensor_calls(p.tensors, True, 5e7) == 0  # no experts


def _megatron_replay(entries: list[list[int]], shared: set[int], size: float) -> tuple[int, float]:
    """megatron-core's _ParamAndGradBuffer loop over the tensors in reverse, one at a time."""
    calls, held, last = 0, 0, 0
    for i in range(len(entries) - 1, -1, -1):
        for n in reversed(entries[i]):
            if i in shared and held:
                calls, last, held = calls + 1, held, 0
            held += n
            if held >= size or i in shared:
                calls, last, held = calls + 1, held, 0
    return (calls + 1, held) if held else (calls, last)


def test_megatron_run_arithmetic_is_the_tensor_by_tensor_replay():
    """megatron_buckets' runs and repeated layers against the buffer's loop tensor by tensor (the loop itself
    against megatron-core's buffer: tests/toolkit/estimate/test_megatron_buckets.py)."""
    rng = random.Random(1)
    for _ in range(3000):
        kinds = [((tuple((rng.choice([1, 3, 7, 50, 120, 400]), rng.randint(1, 6)) for _ in range(rng.randint(1, 4))),
                   tuple((rng.choice([5, 60, 300]), rng.randint(1, 4)) for _ in range(rng.randint(0, 2)))),
                  rng.choice([1, 2, 3, 7, 60, 300])) for _ in range(rng.randint(1, 4))]
        shared = set()
        for k in range(len(kinds)):  # an embedding: one dense tensor, a bucket of its own
            if rng.random() < 0.3:
                kinds[k], shared = ((((rng.choice([50, 400, 2000]), 1),), ()), 1), shared | {k}
        size = rng.choice([1, 5, 64, 100, 333, 1000])
        for group in (0, 1, BOTH):
            entries = [[n for _ in range(layers) for n, count in (runs[0] + runs[1] if group == BOTH else runs[group])
                        for _ in range(count)] for runs, layers in kinds]
            want = _megatron_replay(entries, shared if group != 1 else set(), size)
            got = megatron_buckets(tuple(kinds), group, size, tuple(sorted(shared)) if group != 1 else ())
            assert got == want, (kinds, shared, size, group)


def test_layers_beyond_any_model_are_counted_at_their_rate():
    """A kind of layer walked without its buckets repeating (tensors of 3 and 7 elements against buckets of
    999,983, a prime) past WALKED_LAYERS: the rest are counted as elements / size, so a spec of
    10**12 layers (the fuzz test draws such) is counted at once and in proportion."""
    runs = ((((3, 1), (7, 1)), ()), 10**12)
    one, two = (megatron_buckets((((((3, 1), (7, 1)), ()), n),), 0, 999983)[0] for n in (10**12, 2 * 10**12))
    assert two / one == pytest.approx(2, rel=1e-6) and one == pytest.approx(10**13 / 999983, rel=1e-3)
    assert tensor_calls((runs,), False, 999983) == pytest.approx(10**13 / 999983, rel=1e-3)


def test_first_and_last_buckets_are_the_replays():
    """data_time.first_bucket (ZeRO-3's first gather: tensors in order, closed at the size) and deepspeed_tail
    (DeepSpeed's last gradient bucket: tensors reversed, sent before overflow) against the replays."""
    rng = random.Random(2)
    for _ in range(3000):
        kinds = [(tuple((rng.choice([1, 3, 7, 50, 120, 400]), rng.randint(1, 6)) for _ in range(rng.randint(1, 5))),
                  rng.choice([1, 2, 3, 7, 60, 300])) for _ in range(rng.randint(1, 3))]
        size = rng.choice([1, 5, 64, 100, 333, 1000, 10**6])
        tensors = tuple(((runs, ()), layers) for runs, layers in kinds)
        sizes = [n for runs, layers in kinds for _ in range(layers) for n, count in runs for _ in range(count)]
        first = next((total for total in itertools.accumulate(sizes) if total >= size), sum(sizes))
        assert first_bucket(tensors, False, size) == first, (kinds, size)
        held = 0
        for n in reversed(sizes):
            held = n if held and held + n > size else held + n
        assert deepspeed_tail(tensors, False, size) == held, (kinds, size)
