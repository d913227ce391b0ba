"""data_time.tensor_calls, the NCCL calls of DeepSpeed's whole-tensor buckets, against a tensor-by-tensor
replay of the two rules DeepSpeed's code follows (ZeRO-3's prefetch closes a bucket once it holds the size;
the gradient buckets are sent before the tensor that would overflow them). The rules themselves are checked
against DeepSpeed's own calls in tests/toolkit/estimate/test_zero3_prefetch.py."""
import random

from toolkit.estimate.data_time import tensor_calls
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
                  rng.randint(1, 7)) for _ in range(rng.randint(1, 3))]
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
