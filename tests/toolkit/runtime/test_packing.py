"""Packing's pure parts: the greedy packer, the CPU attention mask and the THD parameters
(megatron-core's PackedSeqParams; the CUDA path itself never ran here), and the plan's rules."""
import numpy
import pytest
import torch

from toolkit.plan import make_plan
from toolkit.runtime.chat_dataset import pack
from toolkit.runtime.packing import cu_seqlens, segment_mask, thd_params
from toolkit.spec import TrainingSpec


def test_pack_keeps_order_and_fits():
    lengths = numpy.array([11, 31, 21, 41, 6, 65, 2])  # positions: length - 1
    packs = pack(lengths, numpy.arange(7), 64)
    assert packs == [[0, 1, 2], [3, 4], [5], [6]]
    assert all(sum(int(lengths[i]) - 1 for i in p) <= 64 for p in packs)


def test_segment_mask_is_causal_and_block_diagonal():
    seg = torch.tensor([[0, 0, 1, 1, 1, 2]])
    m = segment_mask(seg)[0, 0]
    allowed = [[j for j in range(6) if not m[i, j]] for i in range(6)]
    assert allowed == [[0], [0, 1], [2], [2, 3], [2, 3, 4], [5]]


def test_thd_params_follow_the_segments():
    from megatron.core.packed_seq_params import PackedSeqParams

    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    p = thd_params(seg)
    assert isinstance(p, PackedSeqParams) and p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == [0, 3, 5, 8] and p.cu_seqlens_q.dtype == torch.int32
    assert p.max_seqlen_q == p.max_seqlen_kv == 3
    assert cu_seqlens(torch.tensor([[0, 0, 1], [0, 1, 1]])).tolist() == [0, 2, 3, 4, 6], "rows never merge"
    with pytest.raises(ValueError, match="one packed sequence"):
        thd_params(torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("sets,found", [
    ({"parallel.cp": 2}, "data.packing with cp=2"),
    ({"mtp.layers": 1, "model": "deepseek-v3-tiny"}, "data.packing with mtp.layers=1"),
])
def test_plan_refuses_what_packing_cannot_run(sets, found):
    spec = TrainingSpec.from_dict({"model": "llama-tiny", "cluster": {"gpus_per_node": 2, "gpu": "cpu"},
                                   "batch": {"micro": 1, "global": 8, "seq_len": 64}, "precision": "fp32",
                                   "data": {"packing": True}, "moe": {"token_dispatcher": "allgather"}})
    assert not [e for e in make_plan(spec).errors if "packing" in e]
    errors = make_plan(spec.with_overrides(sets)).errors
    assert any(found in e for e in errors), errors


def test_unknown_data_key_names_the_closest():
    from toolkit.errors import SpecError

    with pytest.raises(SpecError, match=r"unknown key 'data.packin' \(did you mean 'packing'\?\)"):
        TrainingSpec.from_dict({"model": "llama-tiny", "batch": {"global": 8, "seq_len": 64},
                                "data": {"packin": True}})
