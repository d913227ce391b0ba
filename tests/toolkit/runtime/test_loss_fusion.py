"""The spec's cross_entropy_fusion reaches megatron-core: the runtime's GPTModel computes its loss with
megatron's fused cross entropy (native: its torch.compile'd functions) and it agrees with the unfused
one on the same weights, the output layer's gradient included."""
import torch

from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

SEQ, MICRO = 64, 2


def _plan(fusion: str):
    return make_plan(TrainingSpec.from_dict({
        "model": "llama-tiny", "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"}, "zero": {"stage": 1},
        "precision": "bf16", "recompute": "none", "cross_entropy_fusion": fusion,
        "batch": {"micro": MICRO, "global": MICRO, "seq_len": SEQ}, "train": {"steps": 1}}))


def test_native_fused_loss_agrees_with_the_unfused_one(megatron_one_rank):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    from toolkit.mcore import cpu_compat
    from toolkit.runtime.model import build_model_chunks

    plain, fused = _plan("none"), _plan("native")
    assert plain.valid and fused.valid, (plain.errors, fused.errors)
    a, b = build_model_chunks(plain)[0], build_model_chunks(fused)[0]
    assert not a.config.cross_entropy_loss_fusion
    assert b.config.cross_entropy_loss_fusion and b.config.cross_entropy_fusion_impl == "native"
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, a.vocab_size, (MICRO, SEQ))
    calls = []
    import megatron.core.models.common.language_module.language_module as lm

    real = lm.fused_vocab_parallel_cross_entropy
    lm.fused_vocab_parallel_cross_entropy = lambda *x: calls.append(1) or real(*x)
    try:
        losses = []
        for m in (a, b):
            loss = m(tokens, torch.arange(SEQ).expand(MICRO, SEQ), cpu_compat.causal_mask(SEQ), labels=tokens)
            loss.sum().backward()
            losses.append(loss.detach().float())
    finally:
        lm.fused_vocab_parallel_cross_entropy = real
    assert calls == [1] and real is fused_vocab_parallel_cross_entropy  # the fused one ran, once, for b only
    assert losses[0].shape == (MICRO, SEQ)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0.02)
    ga, gb = a.output_layer.weight.grad, b.output_layer.weight.grad
    assert ga is not None and gb is not None and ga.abs().max() > 0
    torch.testing.assert_close(gb.float(), ga.float(), rtol=0.02, atol=0.02 * ga.float().abs().max().item())
