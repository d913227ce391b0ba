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
    per logit; the HF Trainer's compiled model 6 and 12."""
    from benchmarks.eager_traffic import measure_loss

    tokens, vocab = 96, 1536
    fwd, bwd = measure_loss(tokens, vocab)
    n = tokens * vocab
    assert {k for k, v in fwd.items() if v > 0.05 * n} == {"_to_copy", "_log_softmax", "nll_loss_forward"}
    nll_input = 4 * n  # fp32 log-probs, counted whole, read at one entry per token
    assert C.loss_bytes("eager", 2) == (14, 22)
    assert 14 * n == pytest.approx(sum(fwd.values()) - nll_input, rel=0.01)
    assert 22 * n == pytest.approx(sum(bwd.values()) - nll_input, rel=0.01)
    assert C.loss_bytes("compiled", 2) == (6, 12) and C.loss_bytes("eager", 4) == (8, 16)


@pytest.mark.parametrize("tokens, vocab", [(96, 1536), (40, 4000)])
def test_megatron_loss_bytes_are_what_megatron_cores_loss_moves(megatron_one_rank, tokens, vocab):
    """megatron-core's own vocab_parallel_cross_entropy (the loss of target recipes and megatron-lm with
    cross_entropy_fusion none) on bf16 logits, counted op by op (benchmarks/eager_traffic.py
    --megatron-loss): forward the fp32 copy 6, max 4, sub_ 8, exp 8, sum 4, div_ 8 = 38 bytes per logit,
    backward mul_ 8 and autograd's cast of the fp32 gradient back to bf16 6 = 14, less the target-logit
    gather (forward and backward) and scatter (backward) the count takes whole where their kernels
    touch one entry per token. In fp32 the copy and the cast are the tensor itself: 32 and 8."""
    from benchmarks.eager_traffic import measure_megatron_loss

    fwd, bwd = measure_megatron_loss(tokens, vocab)
    n = tokens * vocab
    assert {k for k, v in fwd.items() if v > 0.05 * n} == {"_to_copy", "max", "sub_", "index", "exp", "sum", "div_"}
    assert {k for k, v in bwd.items() if v > 0.05 * n} == {"_to_copy", "index", "index_put_", "mul_"}
    whole_index = 4 * n  # the fp32 logits an index op reads (or index_put_ reads and writes) at one entry a token
    assert C.loss_bytes("none", 2) == (38, 14) and C.loss_bytes("none", 4) == (32, 8)
    assert 38 * n == pytest.approx(sum(fwd.values()) - whole_index, rel=0.01)
    assert 14 * n == pytest.approx(sum(bwd.values()) - 3 * whole_index, rel=0.01)


def test_loss_kinds():
    """The fused losses move less than megatron-core's unfused one (bf16: 52 bytes per logit): its
    torch.compile'd functions 32, TransformerEngine's kernel 6; an unknown kind fails."""
    assert [sum(C.loss_bytes(k, 2)) for k in ("none", "native", "te", "eager", "compiled")] == [52, 32, 6, 36, 18]
    with pytest.raises(ValueError, match="loss kind 'fused'"):
        C.loss_bytes("fused", 2)


def test_the_loss_fusion_moves_the_step_time_and_memory_by_its_bytes():
    """Same layout, megatron-core's three losses: the memory-bound seconds differ by the bytes per logit
    (none 52, native 32, te 6 in bf16) over the micro-batches' logits; TransformerEngine's keeps no fp32
    softmax (4 bytes a logit less on the last stage); nothing else moves."""
    plans = {k: _plan(cross_entropy_fusion=k) for k in ("none", "native", "te")}
    assert all(p.valid for p in plans.values()), {k: p.errors for k, p in plans.items()}
    p = plans["none"]
    per_micro = p.batch.micro * p.batch.seq_len * padded_vocab(p.shape.vocab_size, 1)  # tp 1
    logits = p.batch.grad_accum * per_micro
    for kind, saved in (("native", 52 - 32), ("te", 52 - 6)):
        q = plans[kind]
        assert p.time.seconds["memory"] - q.time.seconds["memory"] == pytest.approx(
            logits * saved / memory_bandwidth(p.gpu), rel=1e-9)
        others = {k: v for k, v in q.time.seconds.items() if k != "memory"}
        assert others == pytest.approx({k: p.time.seconds[k] for k in others}, rel=1e-12)
    assert p.memory.worst.activations - plans["te"].memory.worst.activations == pytest.approx(4 * per_micro)
    assert plans["native"].memory.worst.activations == p.memory.worst.activations


def _plan(**over):
    return make_plan(TrainingSpec.from_dict(spec_dict(**{"parallel.tp": 1, "zero.stage": 3, **over})))


def test_hf_target_times_eager_elementwise_kernels():
    """Same layout: target hf pays transformers' eager traffic per layer where recipes (megatron-core's
    fused kernels) pays the fused model's 3 x its forward bytes, and its fp32 loss's 36 bytes per
    logit where megatron-core's unfused cross entropy moves 52; nothing else moves."""
    hf, recipes = _plan(target="hf", recompute="none"), _plan(target="recipes", recompute="none")  # hf: no selective
    assert hf.valid and recipes.valid
    dm, t, m = model_dims(hf.shape), hf.batch.micro * hf.batch.seq_len, hf.batch.grad_accum
    fused = 3 * layer_work(dm, False, t, 1, 1, 1, False, 2).elementwise_bytes
    extra = hf.shape.num_layers * m * (sum(C.eager_bytes(dm, t, 1, 2)) - fused) / memory_bandwidth(hf.gpu)
    vocab = padded_vocab(hf.shape.vocab_size, 1)
    loss = m * t * vocab * ((14 + 22) - (38 + 14)) / memory_bandwidth(hf.gpu)  # transformers' 36 bytes a logit, not 52
    assert extra > 0 and loss < 0
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
