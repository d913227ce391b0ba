"""`toolkit plan` over random specs (property-based): the shipped example with random keys
set to random values (wrong types, negatives, huge numbers, nulls, unknown keys). Every
spec ends in exit 0 (valid) or 2 (invalid) with one-line messages; nothing raises, and no
size is used before a rule has checked it (pp = 2**40 once allocated a list of 2**40 stages)."""
import contextlib
import io
import json

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from toolkit.cli import main
from toolkit.spec import TrainingSpec, set_dotted

from tests.conftest import ROOT

SEED = yaml.safe_load((ROOT / "examples/llama70b_1024gpu.yaml").read_text())


def leaf_keys(model: type, prefix: str = "") -> list[str]:
    """Every dotted key of the spec, from its pydantic model (defaults included)."""
    keys = []
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        sub = field.annotation
        keys += leaf_keys(sub, key + ".") if isinstance(sub, type) and hasattr(sub, "model_fields") else [key]
    return keys


KEYS = leaf_keys(TrainingSpec)
SIZES = st.sampled_from([0, -1, 1, 2, 3, 7, 8, 64, 1000, 2**31, 2**40, 2**63, 10**30])
VALUES = st.one_of(SIZES, st.integers(-10, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.none(),
                   st.booleans(), st.text(max_size=6), st.lists(st.integers(-2, 2**40), max_size=3),
                   st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
MUTATION = st.tuples(st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).map(lambda k: k + "x")), VALUES)


def run_plan(spec: dict, path) -> tuple[int, str, str]:
    path.write_text(yaml.safe_dump(spec))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", str(path), "--json"])
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=4))
@example(mutations=[("parallel.pp", 2**40)])
@example(mutations=[("parallel.tp", 2**40), ("parallel.ep", 2**40), ("parallel.cp", 2**40)])
@example(mutations=[("cluster.nodes", 2**40), ("parallel.pp", 2**39)])
@example(mutations=[("parallel.vpp", 2**40), ("batch.micro", 2**40)])
@example(mutations=[("mtp.layers", 631011)])  # a layer list that long: 4 s a spec
@example(mutations=[("mtp.layers", 2**31), ("batch.seq_len", 2**40)])  # 22 GB before a CI worker was killed
def test_plan_of_random_spec_exits_0_or_2_with_one_line_messages(tmp_path_factory, mutations):
    spec = json.loads(json.dumps(SEED))
    for key, value in mutations:
        try:
            set_dotted(spec, key, value)
        except Exception:  # noqa: BLE001  (a parent that is not a section: the mutation is dropped)
            continue
    code, out, err = run_plan(spec, tmp_path_factory.mktemp("fuzz") / "spec.yaml")
    assert code in (0, 2), (mutations, code, err[-2000:])
    if out:
        plan = json.loads(out)
        assert plan["valid"] == (code == 0)
        assert all("\n" not in e for e in plan["errors"])
        if not plan["valid"]:
            assert plan["errors"]
    else:
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
