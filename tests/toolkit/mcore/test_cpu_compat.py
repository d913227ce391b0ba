"""Each change toolkit.mcore.cpu_compat makes so megatron-core runs without CUDA."""
import pytest
import torch

from toolkit.mcore import cpu_compat

from tests.conftest import FakeGroup

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply only without a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def applied():
    assert cpu_compat.apply() is True
    assert cpu_compat.apply() is True  # idempotent


def test_current_device_and_synchronize():
    assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.synchronize() is None


def test_router_gemm_name():
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None


def _draws(n: int = 8) -> torch.Tensor:
    return torch.rand(n)


def test_rng_tracker_streams_are_megatrons_on_the_cpu_generator():
    """megatron's own seeding (model_parallel_cuda_manual_seed) on the CPU tracker: each stream
    draws what a generator seeded with megatron's seed for it draws; a fork leaves the default
    stream where it was; nested forks resume the outer stream (megatron's bookkeeping)."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from toolkit.mcore.cpu_rng import CpuRNGStatesTracker

    tracker = tensor_parallel.random.get_cuda_rng_tracker()
    assert isinstance(tracker, CpuRNGStatesTracker)
    seed = 1234
    for tp_rank in (0, 1):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=1, etp_rank=0)
        first = _draws(4)
        with tracker.fork():
            mp = _draws()
            with tracker.fork("expert-parallel-rng"):
                ep = _draws()
            mp2 = _draws()
        then = _draws(4)
        g = torch.Generator().manual_seed(seed + 2718 + tp_rank)
        assert torch.equal(torch.cat([mp, mp2]), torch.rand(16, generator=g))
        assert torch.equal(ep, torch.rand(8, generator=torch.Generator().manual_seed(seed + 1024 + 100 * 1 + 0)))
        assert torch.equal(torch.cat([first, then]), torch.rand(8, generator=torch.Generator().manual_seed(seed)))


def test_recompute_draws_the_forward_masks():
    """megatron's activation checkpointing restores the CPU generator and the tracker's streams
    before recomputing: dropout inside and outside a fork draws the forward's masks again, so
    the gradient of x * mask_a * 2 + x * mask_b * 2 (x = 1, p = 0.5) is the output itself."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    dropout = torch.nn.Dropout(0.5)

    def layer(x):
        with tensor_parallel.get_cuda_rng_tracker().fork():
            a = dropout(x)
        return a + dropout(x)

    x = torch.ones(64, requires_grad=True)
    y = tensor_parallel.checkpoint(layer, False, x)
    y.sum().backward()
    assert torch.equal(x.grad, y.detach()) and 0 < int((y == 0).sum()) < 64


def test_config_overrides_turn_fusions_off():
    over = cpu_compat.config_overrides()
    assert over["use_cpu_initialization"] is True
    assert not any(v for k, v in over.items() if k != "use_cpu_initialization")


def test_causal_mask():
    m = cpu_compat.causal_mask(3)
    assert m.shape == (1, 1, 3, 3) and m.dtype == torch.bool
    assert m[0, 0].tolist() == [[False, True, True], [False, False, True], [False, False, False]]


def test_tensor_cuda_is_a_no_op_only_inside_embedding_setup():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    seen = []
    fn = cpu_compat.tensors_stay_on_cpu(lambda t: seen.append(t.cuda()))
    t = torch.ones(2)
    fn(t)
    assert seen[0] is t
    with pytest.raises((AssertionError, RuntimeError)):
        torch.ones(1).cuda()  # restored outside
    assert LanguageModule.setup_embeddings_and_output_layer.__wrapped__ is not None


def test_sequence_parallel_rmsnorm_and_spec_swap():
    import types

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = cpu_compat.SequenceParallelRMSNorm(types.SimpleNamespace(sequence_parallel=True), 8, eps=1e-6)
    x = torch.randn(3, 2, 8)
    assert norm.weight.sequence_parallel is True
    assert torch.allclose(norm(x), torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-6))
    spec = cpu_compat.swap_torch_norms(get_gpt_layer_local_spec(normalization="RMSNorm"),
                                       cpu_compat.SequenceParallelRMSNorm)
    text = repr(spec)
    assert "SequenceParallelRMSNorm" in text and WrappedTorchNorm.__name__ not in text


def test_rope_is_sliced_per_cp_rank_on_cpu():
    """megatron's get_pos_emb_on_this_cp_rank (pinned index, .cuda()) runs on the CPU: rank 1
    of 2 keeps chunks 1 and 2 of 4."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    emb = torch.arange(8.0).view(8, 1, 1, 1)
    out = rotary_pos_embedding.get_pos_emb_on_this_cp_rank(emb, 0, FakeGroup(2, 1))
    assert out.device.type == "cpu" and out.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]


def test_sliding_window_mask_is_built_on_cpu():
    from megatron.core.fusions import fused_softmax

    m = fused_softmax.get_sliding_window_causal_mask(4, 4, (1, 0))  # True = masked; keys i-1..i visible
    assert m.device.type == "cpu"
    assert m.tolist() == [[False, True, True, True], [False, False, True, True],
                          [True, False, False, True], [True, True, False, False]]


def test_synchronous_save_spawns_no_manager(tmp_path, monkeypatch):
    """Item 11: a torch_dist save writes through an in-process queue, not a spawned Manager,
    and megatron's own loader reads what it wrote."""
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from tests.support.megatron_save import save

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh process
    cpu_compat.in_process_save_queue()
    assert type(filesystem_async._results_queue) is queue.Queue
    before = set(multiprocessing.active_children())
    w = torch.arange(12.0).reshape(3, 4)
    save({"w": ShardedTensor.from_rank_offsets("w", w.clone())}, tmp_path)
    assert set(multiprocessing.active_children()) == before, "no Manager process was started"
    assert filesystem_async._results_queue.empty()
    loaded = megatron_load(tmp_path, w)
    assert torch.equal(loaded, w)


def megatron_load(folder, like):
    import tempfile

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        try:
            out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty_like(like))}, str(folder))
        finally:
            dist.destroy_process_group()
    return out["w"]


def test_local_size_from_torchrun(monkeypatch):
    """Item 12: torchrun's LOCAL_WORLD_SIZE becomes DeepSpeed's LOCAL_SIZE (so its CPU
    accelerator's device_count() reads it instead of running numactl); a launcher's own value stays."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert cpu_compat.local_size_from_torchrun() is True
    assert get_accelerator().device_count() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    assert cpu_compat.local_size_from_torchrun() is False and get_accelerator().device_count() == 3


def test_megatrons_fusions_run_eager_without_inductor():
    """Item 13: after eager_fusers, importing megatron-core wraps none of its jit_fuser functions in
    torch.compile (quick_gelu is one: GPT-OSS's clamped SwiGLU) and loads no inductor; a second
    call, megatron imported, changes nothing; a user's TORCHDYNAMO_DISABLE is kept. A fresh
    process: megatron's decorators run once, at its import."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    code = ("import os, sys; from toolkit.mcore import cpu_compat; first = cpu_compat.eager_fusers(); "
            "from megatron.core import activations; import megatron.core.models.gpt; "
            "print(first, hasattr(activations.quick_gelu, '_torchdynamo_orig_callable'), "
            "'torch._inductor.compile_fx' in sys.modules, cpu_compat.eager_fusers(), "
            "os.environ['TORCHDYNAMO_DISABLE'])")
    env = {k: v for k, v in subprocess_env().items() if k != "TORCHDYNAMO_DISABLE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.stdout.split() == ["True", "False", "False", "False", "1"], r.stdout + r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**env, "TORCHDYNAMO_DISABLE": "0"})
    assert r.stdout.split() == ["True", "True", "True", "False", "0"], r.stdout + r.stderr[-3000:]
