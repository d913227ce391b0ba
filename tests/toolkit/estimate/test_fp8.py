"""TransformerEngine FP8 (the spec's fp8 section, target megatron-lm) in the estimates: the linear
layers' GEMMs at the GPU's FP8 peak and TE's casts at memory bandwidth; attention and the output
layer untouched; FP8 weight copies and FP8-saved linear inputs in memory; megatron's
first/last bf16 layers left out of all of it."""
import pytest

from tests.conftest import spec_dict
from toolkit.errors import SpecError
from toolkit.estimate import compute as C
from toolkit.estimate.activations import layer_activation_bytes
from toolkit.estimate.stage_time import bf16_setting, edge_piece, layer_piece
from toolkit.estimate.time import spec_setting
from toolkit.kernels import spec_kernels
from toolkit.models import total_params
from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec

LLAMA70_FP8_CS = {"model": "llama3-70b", "target": "megatron-lm", "recompute": "none", "cluster.nodes": 8,
                  "parallel.tp": 4, "parallel.pp": 8, "parallel.vpp": 5, "batch.global": 128, "batch.seq_len": 8192}


def _plan(fp8=None, **over):
    return make_plan(TrainingSpec.from_dict(spec_dict(**{**LLAMA70_FP8_CS, **over, **({"fp8": fp8} if fp8 else {})})))


@pytest.mark.parametrize("recipe, cast", [("delayed", 2 + 2), ("tensorwise", 2 * 2 + 2)])
def test_linear_gemms_run_at_the_fp8_peak_and_pay_the_casts(recipe, cast):
    """One layer: the linear GEMMs take 989/1979 of their bf16 time (the same fraction of the FP8
    peak), attention's core is unchanged, and the memory-bound time grows by the cast bytes of
    every linear input (forward) and output gradient (backward)."""
    p = _plan({"format": "hybrid", "recipe": recipe})
    s = spec_setting(p.spec, p.layout, p.gpu)
    dm, t = C.model_dims(p.shape), p.batch.seq_len
    fp8, bf16 = layer_piece(dm, False, t, t, s), layer_piece(dm, False, t, t, bf16_setting(s))
    assert s.fp8 == recipe and s.fp8_peak == 1979e12
    assert fp8.gemm_f / bf16.gemm_f == pytest.approx(989 / 1979, rel=1e-12)
    assert (fp8.attn_f, fp8.attn_b) == (bf16.attn_f, bf16.attn_b)
    h, ffn, tp = dm.h, dm.ffn, p.layout.tp
    qkv = (dm.heads + 2 * dm.groups) * dm.d_qk / tp
    fwd = t * (h + dm.heads * dm.d_v / tp + h + ffn / tp)  # inputs of qkv, proj, fc1, fc2
    bwd = t * (qkv + h + 2 * ffn / tp + h)  # their output gradients
    bw = p.gpu.memory_gbps * 1e9
    assert fp8.mem_f - bf16.mem_f == pytest.approx(cast * fwd / bw, rel=1e-9)
    assert fp8.mem_b - 2 * bf16.mem_f == pytest.approx(cast * bwd / bw, rel=1e-9)
    vocab = p.padded_vocab
    assert edge_piece(dm, True, True, t, vocab, s) == edge_piece(dm, True, True, t, vocab, bf16_setting(s))


def test_fp8_speeds_up_the_step_and_bf16_layers_give_some_back():
    bf16 = _plan().time.tokens_per_s
    fp8 = _plan({"format": "hybrid", "recipe": "tensorwise"}).time.tokens_per_s
    ends = _plan({"format": "hybrid", "recipe": "tensorwise", "bf16_layers": 1}).time.tokens_per_s
    assert bf16 < ends < fp8 < 2 * bf16


def test_fp8_weight_copies_in_memory():
    """Without fp8.param every GPU holds 2 bytes (TE's row-wise and transposed FP8 copies) per
    linear weight it holds; fp8.param stores the weights in FP8 instead: no copy besides."""
    over = {"model": "llama3-8b", "parallel.tp": 2, "parallel.pp": 1, "parallel.vpp": 1, "cluster.nodes": 1,
            "batch.global": 64}
    bf16, fp8 = _plan(**over), _plan({"format": "hybrid"}, **over)
    shape = bf16.shape
    layers = total_params(shape) - 2 * shape.vocab_size * shape.hidden_size  # untied embedding and output layer
    copies = fp8.memory.stages[0].params - bf16.memory.stages[0].params
    assert copies == pytest.approx(2 * layers / 2, rel=1e-3)  # norms are not split over tp: within 0.1%
    param = _plan({"format": "hybrid", "param": True}, **over)
    assert param.memory.stages[0].params == bf16.memory.stages[0].params


def test_fp8_keeps_linear_inputs_in_one_byte():
    """Per token of a layer: the inputs of linear_qkv and linear_fc1 (h each) and of linear_fc2
    (ffn/tp) kept in FP8 instead of bf16, and an FP8 copy of the attention output (heads x d / tp)."""
    p = _plan()
    kw = dict(tokens=1.0, seq=p.batch.seq_len, layout=p.layout, recompute="none", kernels=spec_kernels(p.spec),
              act_bytes=2)
    bf16 = layer_activation_bytes(p.shape, 3, **kw)
    fp8 = layer_activation_bytes(p.shape, 3, fp8=True, **kw)
    s, tp = p.shape, p.layout.tp
    saved = 2 * s.hidden_size / p.layout.seq_shards + s.ffn_hidden_size / tp - s.num_attention_heads * s.head_dim / tp
    assert bf16 - fp8 == pytest.approx(saved, rel=1e-12)


def test_bf16_layers_keep_their_activations_in_bf16():
    """The first stage holds layer 0: with bf16_layers 1 its activations are the bf16 ones."""
    cs = {"format": "hybrid", "recipe": "tensorwise"}
    every, ends = _plan(cs).memory.stages, _plan({**cs, "bf16_layers": 1}).memory.stages
    assert ends[0].activations > every[0].activations and ends[3].activations == every[3].activations


def test_a_misspelt_fp8_key_names_the_closest():
    with pytest.raises(SpecError, match="unknown key 'fp8.recipie' \\(did you mean 'recipe'\\?\\)"):
        TrainingSpec.from_dict(spec_dict(fp8={"format": "hybrid", "recipie": "delayed"}))
