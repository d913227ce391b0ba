"""toolkit.mcore.layers: the modules megatron-core's GPT specs lack, put into megatron's own spec.
That they compute transformers' Gemma 3 is checked by the conversion parity tests
(tests/converters/test_parity.py, "gemma3"); here: which modules the rewritten spec builds."""
from dataclasses import replace

import torch

from toolkit.models import load_model


def test_gemma3_spec_swaps_exactly_megatrons_modules():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from toolkit.mcore.layers import LocalRopeSelfAttention, ZeroCenteredRMSNorm, model_spec, post_normed

    shape = load_model("gemma3-tiny")
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    got = model_spec(spec, shape, te=False)
    sub, attn = got.submodules, got.submodules.self_attention
    post = post_normed(RowParallelLinear, ZeroCenteredRMSNorm)
    assert attn.module is LocalRopeSelfAttention and issubclass(LocalRopeSelfAttention, SelfAttention)
    assert attn.params["local_rope_base"] == 10000.0 and attn.params["local_layers"] == (True, True, False, True)
    assert attn.submodules.linear_proj is post and sub.mlp.submodules.linear_fc2 is post
    assert {sub.input_layernorm, sub.pre_mlp_layernorm, attn.submodules.q_layernorm,
            attn.submodules.k_layernorm} == {ZeroCenteredRMSNorm}
    assert spec.submodules.self_attention.module is SelfAttention  # megatron's spec is not changed
    assert spec.submodules.input_layernorm is WrappedTorchNorm
    plain = model_spec(spec, replace(shape, zero_centered_norm=False, local_rope_theta=None), te=False)
    assert plain.submodules.input_layernorm is WrappedTorchNorm and plain.submodules.self_attention.module is SelfAttention


def test_zero_centered_norm_is_transformers_gemma_norm():
    from types import SimpleNamespace

    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from toolkit.mcore.layers import ZeroCenteredRMSNorm

    ours = ZeroCenteredRMSNorm(SimpleNamespace(sequence_parallel=False), 64, eps=1e-6)
    theirs = Gemma3RMSNorm(64, eps=1e-6)
    assert not ours.weight.any()  # (1 + 0) = the identity scale, as transformers initialises it
    g = torch.Generator().manual_seed(0)
    w = 0.1 * torch.randn(64, generator=g)
    with torch.no_grad():
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 64, generator=g).to(dtype)
        assert ours(x).dtype == dtype
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6 if dtype == torch.float32 else 0)
