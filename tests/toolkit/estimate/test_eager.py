"""Eager PyTorch's elementwise traffic (target hf without compile): the planner's constants
against the count of transformers' own LlamaDecoderLayer, and the spec's ``compile`` input."""
import pytest

from tests.conftest import spec_dict
from toolkit.backends.megatron import padded_vocab
from toolkit.errors import SpecError
from toolkit.estimate import compute as C
from toolkit.estimate.compute import layer_work, memory_bandwidth, model_dims
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec


def test_eager_bytes_are_what_transformers_layer_moves():
    """benchmarks/eager_traffic.py's count (every non-GEMM, non-attention aten op's inputs and
    outputs, forward and backward) on a shape the constants were not read from."""
    from benchmarks.eager_traffic import measure

    shape = {"hidden": 384, "heads": 6, "groups": 2, "head_dim": 64, "ffn": 1024, "tokens": 64}
    fwd, bwd = measure(**shape)
    dm = C.Dims(h=384, heads=6, groups=2, d_qk=64, d_v=64, ffn=1024, vocab=1000, mla=None, experts=0, topk=0,
                expert_ffn=0, shared_ffn=0)
    ours = C.eager_bytes(dm, 64, 1, 2)
    assert ours[0] == pytest.approx(sum(fwd.values()), rel=0.01)
    assert ours[1] == pytest.approx(sum(bwd.values()), rel=0.01)


def test_eager_loss_bytes_are_what_transformers_loss_moves():
    """transformers' ForCausalLMLoss on bf16 logits, counted op by op (benchmarks/eager_traffic.py),
    less the nll_loss input the count takes whole where its kernels index one entry per token:
    forward 6 (cast) + 8 (log_softmax) = 14, backward 4 (nll's gradient written) + 12 + 6 = 22 bytes
    per logit; fused 6 and 12."""
    from benchmarks.eager_traffic import measure_loss

    tokens, vocab = 96, 1536
    fwd, bwd = measure_loss(tokens, vocab)
    n = tokens * vocab
    assert {k for k, v in fwd.items() if v > 0.05 * n} == {"_to_copy", "_log_softmax", "nll_loss_forward"}
    nll_input = 4 * n  # fp32 log-probs, counted whole, read at one entry per token
    assert C.loss_bytes(True, 2) == (14, 22)
    assert 14 * n == pytest.approx(sum(fwd.values()) - nll_input, rel=0.01)
    assert 22 * n == pytest.approx(sum(bwd.values()) - nll_input, rel=0.01)
    assert C.loss_bytes(False, 2) == (6, 12) and C.loss_bytes(True, 4) == (8, 16)


def _plan(**over):
    return make_plan(TrainingSpec.from_dict(spec_dict(**{"parallel.tp": 1, "zero.stage": 3, **over})))


def test_hf_target_times_eager_elementwise_kernels():
    """Same layout: target hf pays transformers' eager traffic per layer where recipes (megatron-core's
    fused kernels) pays the fused model's 3 x its forward bytes, and its fp32 loss's 36 bytes per
    logit where the fused cross entropy moves 18; nothing else moves."""
    hf, recipes = _plan(target="hf", recompute="none"), _plan(target="recipes", recompute="none")  # hf: no selective
    assert hf.valid and recipes.valid
    dm, t, m = model_dims(hf.shape), hf.batch.micro * hf.batch.seq_len, hf.batch.grad_accum
    fused = 3 * layer_work(dm, False, t, 1, 1, 1, False, 2).elementwise_bytes
    extra = hf.shape.num_layers * m * (sum(C.eager_bytes(dm, t, 1, 2)) - fused) / memory_bandwidth(hf.gpu)
    vocab = padded_vocab(hf.shape.vocab_size, 1)
    loss = m * t * vocab * ((14 + 22) - (6 + 12)) / memory_bandwidth(hf.gpu)  # fp32 loss: 36 bytes per logit, not 18
    assert extra > 0 and loss > 0
    extra += loss
    assert hf.time.seconds["memory"] - recipes.time.seconds["memory"] == pytest.approx(extra, rel=1e-9)
    others = {k: v for k, v in hf.time.seconds.items() if k not in ("memory", "dp")}
    assert others == pytest.approx({k: recipes.time.seconds[k] for k in others}, rel=1e-12)


@pytest.mark.parametrize("target, why", [("recipes", "never calls torch.compile"),
                                         ("megatron-lm", "do not compile the model"),
                                         ("hf", "does not set TrainingArguments.torch_compile")])
def test_compile_true_is_refused_with_the_targets_reason(target, why):
    p = _plan(target=target, compile=True, **({"zero.stage": 1} if target == "megatron-lm" else {}))
    assert not p.valid
    assert [e for e in p.errors if e.startswith(f"compile=true with target {target}: ") and why in e]


def test_a_misspelt_compile_names_it():
    with pytest.raises(SpecError, match="unknown key 'compiled' \\(did you mean 'compile'\\?\\)"):
        TrainingSpec.from_dict(spec_dict(compiled=False))
