"""toolkit.parallel.pipeline.PipelineSplit against megatron-core's own placement
(get_num_layers_to_build, get_transformer_layer_offset) for even, uneven and
embedding/loss-accounted splits, with and without virtual pipeline chunks."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

from toolkit.parallel.pipeline import PipelineSplit


def megatron_placement(s: PipelineSplit) -> list[list[tuple[int, int]]]:
    """[stage][chunk] -> (offset, layers) as megatron-core 0.16 computes them."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = SimpleNamespace(num_layers=s.num_layers, pipeline_model_parallel_size=s.pp,
                          virtual_pipeline_model_parallel_size=s.vpp if s.vpp > 1 else None,
                          num_layers_in_first_pipeline_stage=s.first, num_layers_in_last_pipeline_stage=s.last,
                          account_for_embedding_in_pipeline_split=s.embedding,
                          account_for_loss_in_pipeline_split=s.loss, pipeline_model_parallel_layout=None)
    vps = [v if s.vpp > 1 else None for v in range(s.vpp)]
    return [[(get_transformer_layer_offset(cfg, vp, p), get_num_layers_to_build(cfg, vp, p)) for vp in vps]
            for p in range(s.pp)]


def cases():
    for L, pp, vpp in itertools.product((4, 6, 8, 12, 15, 23, 61, 126), (1, 2, 3, 4, 16), (1, 2, 3)):
        if vpp > 1 and pp == 1:
            continue
        yield PipelineSplit(L, pp, vpp)
        yield PipelineSplit(L, pp, vpp, embedding=True)
        yield PipelineSplit(L, pp, vpp, loss=True)
        yield PipelineSplit(L, pp, vpp, embedding=True, loss=True)
        for first, last in itertools.product((None, 1, 2, 3, 4, 6, 8), repeat=2):
            if first is not None or last is not None:
                yield PipelineSplit(L, pp, vpp, first, last)


VALID = [s for s in cases() if not s.problems()]


def test_the_case_grid_covers_each_kind():
    kinds = {(s.uneven, s.embedding, s.loss, s.vpp > 1) for s in VALID if s.pp > 1}
    assert len(kinds) == 10 and len(VALID) > 300  # even/uneven/accounted x vpp 1/ >1 (uneven x accounting refused)


def test_split_is_megatrons():
    for s in VALID:
        mine = [[(s.offset(p, v), s.layers(p, v)) for v in range(s.vpp)] for p in range(s.pp)]
        assert mine == megatron_placement(s), s
        ids = sorted(i for p in range(s.pp) for i in s.stage_layer_ids(p))
        assert ids == list(range(s.num_layers)), s  # every layer exactly once
        assert all(s.place(i)[0] == p for p in range(s.pp) for i in s.stage_layer_ids(p)), s


def test_megatron_cannot_build_what_is_refused():
    """Splits refused for megatron's arithmetic make megatron's own functions fail, build an
    empty chunk, or not build every layer exactly once (megatron silently drops layers when
    first + last leave layers but no middle stage): the rules refuse no sound split."""
    refused = [s for s in cases() if s.problems() and not (s.pp == 1 and s.uneven)]  # refused as meaningless; megatron ignores them at pp=1
    assert len(refused) > 100
    for s in refused:
        try:
            placed = megatron_placement(s)
        except (AssertionError, ZeroDivisionError):
            continue
        built = sorted(i for stage in placed for start, n in stage for i in range(start, start + n))
        assert any(n < 1 for stage in placed for _, n in stage) or built != list(range(s.num_layers)), s


def test_published_splits():
    llama405 = PipelineSplit(126, 16, embedding=True, loss=True)  # 128 "layers": 7 + 8 x 14 + 7
    assert not llama405.problems() and llama405.describe() == "7+8x14+7"
    deepseek_v3 = PipelineSplit(61, 16, first=4, last=2)  # 55 over 14 middle stages does not divide
    assert "not divisible by 14" in deepseek_v3.problems()[0]
    assert PipelineSplit(61, 16, last=1).describe() == "4+4x14+1"  # 60 layers over the first 15 stages


def test_embedding_and_loss_chunks_may_hold_no_transformer_layer():
    """megatron-core builds the embedding's (loss's) chunk without transformer layers when it is
    that accounted layer alone (get_num_layers_to_build asserts >= 0): Llama 3's 405B schedule,
    126 layers + embedding + loss over pp 16 x vpp 8, one per chunk (arXiv 2407.21783, 3.3.2)."""
    llama405 = PipelineSplit(126, 16, 8, embedding=True, loss=True)
    assert not llama405.problems() and llama405.describe() == "7+8x14+7"
    assert llama405.layers(0, 0) == 0 and llama405.layers(15, 7) == 0 and llama405.layers(0, 1) == 1
    assert megatron_placement(llama405)[0][0] == (0, 0) and megatron_placement(llama405)[15][7][1] == 0


def test_problems_name_the_numbers():
    assert PipelineSplit(61, 16).problems() == [
        "pp=16 does not divide num_layers=61; set parallel.first_stage_layers / last_stage_layers for an uneven split"]
    assert "vpp=2 does not divide first_stage_layers=3" in PipelineSplit(8, 2, 2, first=3, last=5).problems()
    assert "cannot be combined" in PipelineSplit(8, 2, first=4, embedding=True).problems()[0]
    assert "stage 0 would build no transformer layer" in PipelineSplit(8, 3, first=0).problems()[0]
    assert "pp=1099511627776 does not divide" in PipelineSplit(4, 1 << 40).problems()[0]
    assert "model chunks" in PipelineSplit(4, 1 << 40, first=4).problems()[-1]  # refused before anything is sized
