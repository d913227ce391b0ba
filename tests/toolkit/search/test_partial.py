"""The machinery that lets the spine's rules run on partly chosen layouts (toolkit.search.partial)."""
import dataclasses
import itertools

import pytest

from toolkit.hardware import get_gpu
from toolkit.models import load_model
from toolkit.parallel.layout import BatchPlan, Layout, derive_batch, derive_layout
from toolkit.search.partial import (BATCH_FIELD_AXES, LAYOUT_FIELD_AXES, Choice, Undetermined, View, build_spec,
                                  judge, partial_context, zero_choices)
from toolkit.plan.rules import RULES
from toolkit.spec import TrainingSpec

from tests.conftest import spec_dict

DOMAIN = {"tp": (1, 2, 4), "sp": (False, True, None), "pp": (1, 2), "vpp": (1, 2), "cp": (1, 2), "ep": (1, 2),
          "etp": (None, 1, 2), "micro": (1, 2, 4)}


BASE = TrainingSpec.from_dict(spec_dict(**{"model": "mixtral-tiny", "batch.global": 16}))
SHAPE = load_model("mixtral-tiny")


def _derived(axes: dict):
    spec = build_spec(BASE, axes)
    layout = derive_layout(spec, SHAPE)
    return layout, derive_batch(spec, layout)


def test_dependency_tables_cover_every_field():
    assert set(LAYOUT_FIELD_AXES) == {f.name for f in dataclasses.fields(Layout)}
    assert set(BATCH_FIELD_AXES) == {f.name for f in dataclasses.fields(BatchPlan)}


def test_dependency_tables_match_derive_layout_and_batch():
    """Changing an axis a field is not listed under never changes the field."""
    names = list(DOMAIN)
    for axis in names:
        others = [a for a in names if a != axis]
        for values in itertools.product(*(DOMAIN[a] for a in others)):
            derived = [_derived({**dict(zip(others, values)), axis: v}) for v in DOMAIN[axis]]
            for table, i in ((LAYOUT_FIELD_AXES, 0), (BATCH_FIELD_AXES, 1)):
                for f, deps in table.items():
                    if axis not in deps:
                        assert len({getattr(d[i], f) for d in derived}) == 1, (f, axis, values)


def test_view_hides_fields_and_what_depends_on_them():
    lay = Layout(world=8, tp=2, pp=2, vpp=1, ep=1, etp=2, cp=2, sequence_parallel=True, gpus_per_node=8)
    view = View(lay, Choice({"tp": 2, "pp": 2}).hidden(LAYOUT_FIELD_AXES))
    assert view.tp == 2 and view.pp == 2 and view.world == 8
    with pytest.raises(Undetermined) as e:
        view.cp
    assert e.value.axes == {"cp"}
    with pytest.raises(Undetermined):
        view.model_parallel  # a property reading cp through the view
    with pytest.raises(Undetermined):
        view.as_dict()  # a method of an object with hidden fields may read anything
    assert View(lay).model_parallel == 8


def test_rule_decided_early_only_when_it_reads_chosen_values():
    base = TrainingSpec.from_dict(spec_dict(**{"model": "llama3-8b"}))
    shape, gpu = load_model("llama3-8b"), get_gpu("h100-80gb")
    placeholders = {"tp": 1, "sp": False, "pp": 1, "vpp": 1, "cp": 1, "ep": 1, "etp": None,
                    "zero": zero_choices(None)[0], "micro": 1, "recompute": "none"}
    ctx = partial_context(base, shape, gpu, Choice({"tp": 3}), placeholders)[0]
    verdict = judge(list(RULES), ctx)
    assert verdict.error == ("heads_divisible", "tp=3 does not divide num_attention_heads=32")
    ctx = partial_context(base, shape, gpu, Choice({"tp": 2}), placeholders)[0]
    verdict = judge(list(RULES), ctx)
    assert verdict.error is None
    pending = {r.__name__ for r in verdict.pending}
    assert {"world_divisible", "batch_invariant", "zero_with_pipeline"} <= pending
    assert "heads_divisible" not in pending and "tp_within_node" not in pending
    assert verdict.blocked[next(r for r in verdict.pending if r.__name__ == "batch_invariant")] <= {"micro", "pp", "cp"}


def test_zero_choices_offer_nvme_only_with_a_path():
    assert {z.offload_optimizer for z in zero_choices(None)} == {"none", "cpu"}
    assert len(zero_choices(None)) == 16 and len(zero_choices("/nvme")) == 36
    assert all(z.nvme_path == "/nvme" for z in zero_choices("/nvme"))


def test_given_keys_survive_overrides():
    s = TrainingSpec.from_dict({"model": "llama3-8b", "batch": {"global": 64, "seq_len": 4096}})
    assert s.given_keys() == {"model", "batch.global", "batch.seq_len"}
    t = s.with_overrides({"parallel.tp": 2})
    assert t.given_keys() == {"model", "batch.global", "batch.seq_len", "parallel.tp"}
    assert t.zero == s.zero and t.recompute == s.recompute  # defaults unchanged
