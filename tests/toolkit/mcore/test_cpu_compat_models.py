"""The CPU patches this area added to toolkit/runtime (one test each)."""
from __future__ import annotations

import pytest
import torch

from toolkit.mcore import cpu_compat

from tests.conftest import free_port


def test_tensors_stay_on_cpu_only_inside_the_wrapped_call():
    seen = {}

    def setup(t):
        seen["inside"] = t.cuda() is t  # megatron: weight.data = weight.data.cuda()
        return "done"

    assert cpu_compat.tensors_stay_on_cpu(setup)(torch.ones(2)) == "done" and seen["inside"]
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.ones(2).cuda()  # the real method is back


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply only without CUDA")
def test_apply_wraps_the_tied_embedding_setup():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    cpu_compat.apply()
    assert LanguageModule.setup_embeddings_and_output_layer.__wrapped__.__name__ == "setup_embeddings_and_output_layer"


def test_block_spec_follows_moe_layer_freq(monkeypatch):
    """toolkit.mcore.model.block_spec builds dense and MoE layers as config.moe_layer_freq
    says (megatron's get_gpt_decoder_block_spec), not one spec for every layer."""
    
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from converters.layout import conversion_plan
    from toolkit.mcore import distributed
    from toolkit.mcore.model import block_spec, transformer_config
    from toolkit.models import shape_from_hf
    from toolkit.parallel.layout import Layout

    from tests.support.convert_models import hf_config

    port = free_port()
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    plan = conversion_plan(shape_from_hf(hf_config("qwen2_moe")), Layout(), token_dispatcher="allgather")
    distributed.init_parallel(Layout())
    try:
        spec = block_spec(plan, transformer_config(plan), None)
    finally:
        distributed.destroy()
    assert [s.submodules.mlp.module for s in spec.layer_specs] == [MoELayer, MoELayer, MLP, MoELayer]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply only without CUDA")
def test_local_mla_drops_the_channels_only_where_that_is_exact(monkeypatch):
    """cpu_compat.local_mla: megatron's MLA hands k_channels / v_channels to the local
    DotProductAttention, which computes the same without them only when the softmax scale
    is given and v_channels = kv_channels (Megatron-LM issue #1589); TE's mock TELinear is no
    longer reached by MLA's isinstance check. (The parity tests build real MLA models.)"""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cpu_compat.apply()
    assert mla.HAVE_TE is False and not isinstance(mla.TELinear, type)
    init, seen = DotProductAttention.__init__, []
    monkeypatch.setattr(init, "original", lambda self, config, *a, **k: seen.append(k))
    config = type("Config", (), {"kv_channels": 16})()
    init(None, config, 1, "causal", "self", k_channels=24, v_channels=16, softmax_scale=0.2)
    assert seen == [{"softmax_scale": 0.2}]
    with pytest.raises(ValueError, match="cannot honour k_channels=24, v_channels=8"):
        init(None, config, 1, "causal", "self", k_channels=24, v_channels=8, softmax_scale=0.2)
    with pytest.raises(ValueError, match="softmax_scale=None"):
        init(None, config, 1, "causal", "self", k_channels=24, v_channels=16)
