"""Pure arithmetic of the converters, no process group: fused layouts against the formulas
of ../shared/REFERENCE.md written out independently, layer placement against
megatron-core's own offset function, the args <-> ModelShape helper, progress."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import converters
from converters.dtypes import dtype_of
from converters.errors import ConversionSetupError
from converters.mapping import ModelMap
from converters.megatron_args import layout_from_args, megatron_args, shape_from_args
from converters.stream import Target, pieces
from toolkit.models import load_model, shape_from_hf
from toolkit.models.family import table_for
from toolkit.models.weights import expand
from toolkit.parallel.layout import Layout
from toolkit.regions import Copy, by_dst, compose, invert, whole

from tests.support.convert_models import ALL, hf_config, make_hf


class DictSource:
    """In-memory tensors as a stream.Source (rows of their 2-D views as bytes)."""

    def __init__(self, tensors):
        self.t = tensors

    def meta(self, name):
        return tuple(self.t[name].shape), dtype_of(self.t[name].dtype)

    def window(self, name, a, b):
        t = self.t[name]
        return memoryview(t.reshape(t.shape[0], -1)[a:b].contiguous().view(-1).view(torch.uint8).numpy())


def build(name, shape, copies, source, chunk_bytes=1 << 20):
    t = Target(name, shape, dtype_of(torch.float32), tuple(copies))
    data = b""
    for chunk in pieces(t, source, chunk_bytes):
        data += b"".join(bytes(v) for v in chunk.views)
        chunk.release()
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)


def test_qkv_and_gated_layouts_match_the_reference_formulas():
    shape = replace(load_model("qwen3-tiny"), num_attention_heads=8, num_query_groups=2, head_dim=8, hidden_size=32,
                    ffn_hidden_size=24)
    h, d, H, G, F = 32, 8, 8, 2, 24
    g = torch.Generator().manual_seed(0)
    src = {n: torch.randn(s, generator=g) for n, s in
           {"q": (H * d, h), "k": (G * d, h), "v": (G * d, h), "qb": (H * d,), "kb": (G * d,), "vb": (G * d,),
            "gate": (F, h), "up": (F, h)}.items()}
    entries = {e.name: e for e in expand(shape, table_for(shape)) if e.layer in (None, 0)}
    qkv = entries["decoder.layers.0.self_attention.linear_qkv.weight"].mapping
    fused = build("qkv", ((H + 2 * G) * d, h), qkv.to_global(shape, ["q", "k", "v"], "qkv", 0), DictSource(src))
    ref = torch.cat([src["q"].view(G, H // G * d, h), src["k"].view(G, d, h), src["v"].view(G, d, h)], 1)
    assert torch.equal(fused, ref.reshape(-1, h))
    bias = replace(qkv, hf=("qb", "kb", "vb"))
    fused_b = build("qkvb", ((H + 2 * G) * d,), bias.to_global(shape, ["qb", "kb", "vb"], "b", 0), DictSource(src))
    assert torch.equal(fused_b, torch.cat([src["qb"].view(G, -1), src["kb"].view(G, d), src["vb"].view(G, d)], 1)
                       .reshape(-1))
    # tp=2: rank r holds the r-th half of the groups; gated fc1 rank i = [gate chunk i; up chunk i]
    mm = ModelMap(shape, 512)
    layout = Layout(tp=2)
    ranks = {rt.key.tp: rt for rt in mm.rank_tensors(layout) if rt.key.name == "decoder.layers.0.mlp.linear_fc1.weight"}
    fc1 = ModelMap(shape, 512).hf_to_global
    for i in (0, 1):
        copies = compose(ranks[i].copies, {"decoder.layers.0.mlp.linear_fc1.weight": [
            c for c in fc1["decoder.layers.0.mlp.linear_fc1.weight"]]})
        copies = [replace(c, src={"model.layers.0.mlp.gate_proj.weight": "gate",
                                  "model.layers.0.mlp.up_proj.weight": "up"}[c.src]) for c in copies]
        got = build("fc1", (F, h), copies, DictSource(src))
        assert torch.equal(got, torch.cat([src["gate"].chunk(2)[i], src["up"].chunk(2)[i]]))


def test_layer_placement_matches_megatron_offsets():
    """Our (pp, vpp) -> layers arithmetic against megatron-core's get_transformer_layer_offset."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layers, pp, vpp = 12, 3, 2
    cfg = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32,
                            use_cpu_initialization=True)
    lay = Layout(pp=pp, vpp=vpp)
    for p in range(pp):
        for v in range(vpp):
            got = lay.chunk_layers(layers, p, v)
            assert got.start == get_transformer_layer_offset(cfg, vp_stage=v, pp_rank=p)
            assert all(lay.place_layer(layers, g) == (p, v, i) for i, g in enumerate(got))


def test_regions_compose_and_invert():
    a = [whole("x", "mid", 4, 3, src_row=2), whole("y", "mid", 2, 3, dst_row=4)]  # mid = x[2:6]; y
    b = [Copy("mid", "out", 3, 1, 0, 0, 2, 2)]  # out = mid[3:5, 1:3]
    got = compose(b, by_dst(a))
    assert got == [Copy("x", "out", 5, 1, 0, 0, 1, 2), Copy("y", "out", 0, 1, 1, 0, 1, 2)]
    inv = invert(a + a)  # duplicates (replicas) are dropped
    assert inv == [whole("mid", "x", 4, 3, dst_row=2), whole("mid", "y", 2, 3, src_row=4)]


@pytest.mark.parametrize("name", list(ALL))
def test_args_round_trip(name):
    """Namespace fields from (shape, layout) and back; and from Megatron-LM's flags alone."""
    shape = shape_from_hf(hf_config(name))
    args = megatron_args(shape, Layout(tp=2, pp=2, vpp=2, ep=2 if shape.moe else 1), dtype=torch.bfloat16, fmt="torch")
    assert args.tensor_model_parallel_size == 2 and args.num_layers_per_virtual_pipeline_stage == 1
    assert args.padded_vocab_size == 512 and args.bf16 and args.normalization == "RMSNorm"
    assert args.swiglu == (shape.activation == "swiglu") and args.apply_layernorm_1p == shape.zero_centered_norm
    assert shape_from_args(args) == shape
    del args.hf_config, args.hf_architecture  # a checkpoint written by Megatron-LM itself
    if name == "gpt_oss":  # no family signature: the Megatron-LM flags do not express GPT-OSS
        with pytest.raises(ConversionSetupError, match="name no architecture without its HF config"):
            shape_from_args(args)
        return
    if shape.activation != "swiglu" or shape.zero_centered_norm:  # Gemma 3: Megatron-LM's flags cannot describe it
        with pytest.raises(ConversionSetupError, match="pass --hf-config"):
            shape_from_args(args)
        return
    flags = shape_from_args(args)
    expected = "LlamaForCausalLM" if name == "mistral" else shape.architecture  # Mistral looks like Llama
    assert layout_from_args(args) == Layout(tp=2, pp=2, vpp=2, ep=2 if shape.moe else 1)
    assert flags.architecture == expected
    for f in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim", "ffn_hidden_size",
              "rope_theta", "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm", "rope_scaling", "vocab_size", "moe"):
        assert getattr(flags, f) == getattr(shape, f), f
    if shape.moe is not None:  # router settings as megatron-core names them
        assert args.num_experts == shape.moe.num_experts and args.moe_router_topk == shape.moe.topk
        assert args.moe_router_pre_softmax == shape.moe.pre_softmax and args.moe_token_dispatcher_type == "alltoall"
        assert args.moe_layer_freq == [int(x) for x in shape.moe.layers] and args.moe_expert_capacity_factor is None


def test_progress_reports_every_byte(tmp_path):
    seen = []
    src = make_hf("qwen2", tmp_path / "hf")
    converters.hf_to_megatron(src, tmp_path / "mg", tp=2, pp=2, progress=lambda d, t: seen.append((d, t)))
    assert seen and all(b[0] >= a[0] for a, b in zip(seen, seen[1:])) and seen[-1][0] == seen[-1][1] > 0


def test_crc32_combine_matches_zlib_on_concatenations():
    """converters.crc combines part CRCs exactly as zlib.crc32 of the whole (empty parts too)."""
    import random
    import zlib

    from converters.crc import crc32_combine, crc32_concat

    rng = random.Random(0)
    for _ in range(200):
        parts = [rng.randbytes(rng.choice([0, 1, 7, rng.randint(0, 5000)])) for _ in range(rng.randint(1, 5))]
        whole_crc = zlib.crc32(b"".join(parts))
        assert crc32_concat([(zlib.crc32(p), len(p)) for p in parts]) == whole_crc
        a, b = parts[0], b"".join(parts[1:])
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == whole_crc
    big = rng.randbytes(1 << 20)
    assert crc32_combine(zlib.crc32(big[:12345]), zlib.crc32(big[12345:]), len(big) - 12345) == zlib.crc32(big)


@pytest.mark.skipif(not hasattr(os, "copy_file_range"), reason="os.copy_file_range is Linux-only")
def test_kernel_copy_copies_file_extents_and_falls_back_when_refused(tmp_path, monkeypatch):
    """A chunk's parts that lie in a source file go through copy_file_range (checked by
    counting the real calls); a source the kernel cannot copy from (a pipe) switches the
    writer to pwritev for good, and the bytes are the same either way."""
    from converters import sink
    from converters.stream import Chunk

    src = tmp_path / "src.bin"
    src.write_bytes(b"0123456789" * 1000)
    calls = []
    real = os.copy_file_range

    def counted(*a):
        calls.append(a[2])
        return real(*a)

    monkeypatch.setattr(sink.os, "copy_file_range", counted)
    sfd = os.open(src, os.O_RDONLY)
    out = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT)
    r, w = os.pipe()
    try:
        body = memoryview(src.read_bytes())[10:5010]
        kc = sink.KernelCopy()
        kc.write(out, Chunk([memoryview(b"head"), body, memoryview(b"tail")], extents=[None, (sfd, 10), None]), 3)
        assert calls == [5000] and kc.enabled
        kc.write(out, Chunk([memoryview(b"PIPE")], extents=[(r, 0)]), 5011)
        assert not kc.enabled
        assert (tmp_path / "out.bin").read_bytes() == b"\0\0\0head" + bytes(body) + b"tailPIPE"
    finally:
        for fd in (sfd, out, r, w):
            os.close(fd)


def test_writer_error_returns_every_scratch_buffer(tmp_path):
    """A failing write (bad descriptor) is raised in the caller's thread, and every pool
    buffer comes back, so a later conversion in the same process does not wait forever."""
    from converters import sink, stream

    free = stream._POOL._free.qsize()
    with pytest.raises(OSError):
        with sink.FileWriter() as writer:
            for _ in range(2 * stream.RING):
                lease = stream._POOL.take(4, 16)
                writer.write(-1, stream.Chunk([memoryview(lease.buf).cast("B")], lease), 0)
    assert stream._POOL._free.qsize() == free


def test_convert_cli_keeps_torch_to_one_thread(monkeypatch):
    """`toolkit convert` runs its own writer threads: torch's intra-op pool is cut to one
    thread (env for a torch not loaded yet, set_num_threads for a loaded one), unless the
    user chose OMP_NUM_THREADS."""
    from toolkit.cli.convert import one_torch_thread

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        one_torch_thread()
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        one_torch_thread()
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_convert_cli_keeps_numpy_blas_to_one_thread():
    """`toolkit convert` asks numpy's OpenBLAS for one thread before numpy loads (its idle
    threads spin), unless the user chose a count or numpy is loaded already."""
    import subprocess
    import sys

    code = ("import os, sys; from toolkit.cli.convert import one_blas_thread; pre = 'numpy' in sys.modules; "
            "one_blas_thread(); import numpy; v = os.environ.get('OPENBLAS_NUM_THREADS'); "
            "os.environ.pop('OPENBLAS_NUM_THREADS', None); one_blas_thread(); "
            "print(pre, v, os.environ.get('OPENBLAS_NUM_THREADS'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "1", "None"]  # set before numpy; not once numpy is loaded
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, OMP_NUM_THREADS="3"), capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["False", "None", "None"]  # the user's choice is left alone
