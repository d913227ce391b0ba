"""toolkit.mcore.gated_delta_net: megatron-core's own GatedDeltaNet runs on CPU with the shim (fla's
l2norm, megatron's torch chunk rule), on megatron's local layers, and computes what transformers'
Qwen3NextGatedDeltaNet computes once the HF weights are laid out as megatron's: in_proj = q, k, v,
z, b, a of all heads one after the other (HF groups them per key head), conv1d, A_log, dt_bias and
out_proj unchanged, out_norm = HF's norm weight - 1 (megatron applies (1 + w) there under
layernorm_zero_centered_gamma, transformers' gated norm w)."""
from __future__ import annotations

import pytest
import torch

from toolkit.models.registry import hf_config_object, load_model, named_models

TINY = "qwen3-next-tiny"


@pytest.fixture(scope="module")
def megatron_grid():
    from toolkit.mcore import distributed
    from toolkit.parallel.layout import Layout

    distributed.init_parallel(Layout())
    yield
    distributed.destroy()


def build_megatron_gdn(shape):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from toolkit.backends.megatron import load_transformer_config, model_fields
    from toolkit.mcore.cpu_compat import CPU_CONFIG
    from toolkit.mcore.gated_delta_net import install, local_spec
    from megatron.core.transformer.spec_utils import build_module

    assert install()
    config = load_transformer_config({**model_fields(shape), **CPU_CONFIG, "transformer_impl": "local"})
    return build_module(local_spec(config), config=config, layer_number=1,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def megatron_in_proj(shape, qkvz: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
    """HF's in_proj_qkvz ([q_g, k_g, v_g.., z_g..] per key head g) and in_proj_ba ([b_g.., a_g..])
    as megatron's in_proj rows [q; k; v; z; b; a], each over all heads in head order."""
    la = shape.linear_attention
    r = la.value_heads // la.key_heads
    h = qkvz.shape[-1]
    per = qkvz.view(la.key_heads, -1, h).split([la.key_head_dim, la.key_head_dim, r * la.value_head_dim,
                                                r * la.value_head_dim], dim=1)
    gates = ba.view(la.key_heads, -1, h).split([r, r], dim=1)
    return torch.cat([t.reshape(-1, h) for t in (*per, *gates)])


def test_shim_is_fla_l2norm_and_megatrons_own_rule():
    from megatron.core.ssm import gated_delta_net as gdn
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm

    from toolkit.mcore.gated_delta_net import fla_l2norm, install

    assert not torch.cuda.is_available() and install()
    assert gdn.chunk_gated_delta_rule is gdn.torch_chunk_gated_delta_rule and gdn.l2norm is fla_l2norm
    # megatron's jit_fuser (torch.compile) taken off the gated norm: inductor would build C++ at the first step
    assert not hasattr(gdn.GatedDeltaNet._apply_gated_norm, "_torchdynamo_orig_callable")
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fla_l2norm(x), l2norm(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seq", [20, 70])  # one chunk of 64, and two (the state carried over)
def test_megatron_gated_delta_net_is_transformers(megatron_grid, seq):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    shape = load_model(TINY)
    g = torch.Generator().manual_seed(seq)
    hf = Qwen3NextGatedDeltaNet(hf_config_object(named_models()[TINY]["config"]), 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
        hf.norm.weight.add_(1.0)  # around transformers' initial 1
    mg = build_megatron_gdn(shape)
    with torch.no_grad():
        mg.in_proj.weight.copy_(megatron_in_proj(shape, hf.in_proj_qkvz.weight, hf.in_proj_ba.weight))
        for name in ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight"):
            mg.get_parameter(name).copy_(hf.get_parameter(name))
        mg.out_norm.weight.copy_(hf.norm.weight - 1)
    x = torch.randn(2, seq, shape.hidden_size, generator=g)
    ref = hf(x)
    out, bias = mg(x.transpose(0, 1).contiguous(), None)
    assert bias is None
    diff = (out.transpose(0, 1) - ref).abs().max().item()
    assert diff <= 1e-5 * ref.abs().max().item(), diff  # fp32 noise of the chunked rule, relative
    with torch.no_grad():
        mg.out_norm.weight.add_(1)  # HF's weight copied unchanged: (1 + w) is another model
    wrong = (mg(x.transpose(0, 1).contiguous(), None)[0].transpose(0, 1) - ref).abs().max().item()
    assert wrong > 100 * diff


def test_tp_ranks_draw_their_share_of_each_part(megatron_grid):
    """toolkit.runtime.init draws a delta net's in_proj, conv1d and A_log whole and each tp rank
    keeps its share of every part (megatron's layout: rank r holds q_r, k_r, v_r, z_r, b_r, a_r):
    two tp ranks' tensors, put back part by part, are the one-rank draw (a contiguous split of the
    whole would give rank 0 all of q and k and no z, b or a)."""
    from toolkit.mcore.gated_delta_net import part_inits
    from toolkit.runtime.init import redraw_parts

    mg = build_megatron_gdn(load_model(TINY))
    found = part_inits(torch.nn.ModuleDict({"gdn": mg}))
    assert sorted(found) == ["gdn.A_log", "gdn.conv1d.weight", "gdn.in_proj.weight"]
    for name, (parts, init) in found.items():
        whole = mg.get_parameter(name[4:])
        assert sum(parts) == whole.shape[0]
        redraw_parts(whole, parts, init, 7, 0, 1)
        halves = []
        for rank in (0, 1):
            half = torch.empty(whole.shape[0] // 2, *whole.shape[1:])
            redraw_parts(half, parts, init, 7, rank, 2)
            halves.append(half.split([p // 2 for p in parts]))
        joined = torch.cat([torch.cat(pair) for pair in zip(*halves)])
        assert torch.equal(joined, whole.detach()), name
        contiguous = whole.detach().chunk(2)[0]
        assert torch.equal(torch.cat(halves[0]), contiguous) == (len(parts) == 1), name
    a_log = mg.A_log.detach()
    assert ((a_log.exp() >= 1) & (a_log.exp() <= 16)).all()  # GatedDeltaNet's A_init_range
