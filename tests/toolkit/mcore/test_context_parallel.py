"""Context-parallel core attention without TransformerEngine (toolkit/mcore/context_parallel.py).

Unit checks in this process (no process group): the comm-type names, the token layout against
megatron's get_batch_on_this_cp_rank, the spec swap, the window mask against megatron's, and
the ring's hand-written backward (gradcheck, fp64) and output against torch's SDPA.
One 4-rank launch (tests/support/context_parallel_worker.py) checks every cp_comm_type against
megatron-core's DotProductAttention and GPTModel at cp = 1, and that a step reads no tensor on the
host (tests/support/host_syncs.py); its largest differences print with
`pytest -s`, or run the worker directly (its docstring has the command).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from toolkit.errors import SpecError
from toolkit.mcore.context_parallel import ContextParallelAttention, Visibility, comm_type, context_parallel_spec
from toolkit.mcore.cp_comm import local_positions
from toolkit.mcore.cp_ring import RingPlan, every_pair, pair_schedule, ring_attention

from tests.conftest import SUPPORT, FakeGroup, free_port, subprocess_env
from tests.support.host_syncs import HostSyncs

WORKER = SUPPORT / "context_parallel_worker.py"
FP32_TOL = 1e-5  # fp32 round-off: values are O(1)-O(6), measured differences up to ~3e-6
BF16_RATIO = 2.0  # bf16: error vs the fp32 reference at most 2x megatron's own bf16 error (measured <= 1.5x)


OneRank = FakeGroup  # a ring of one rank: the ring code needs only size() and rank() then


# ------------------------------------------------------------------------------- unit checks
def test_comm_type_names():
    assert comm_type(None) == "p2p"
    assert comm_type("allgather") == "all_gather"  # Megatron-LM's help spells it so; TE reads all_gather
    assert [comm_type(k) for k in ("p2p", "all_gather", "a2a", "a2a+p2p")] == ["p2p", "all_gather", "a2a", "a2a+p2p"]
    with pytest.raises(SpecError, match=r"'a2a\+p2' is not one of .*did you mean 'a2a\+p2p'"):
        comm_type("a2a+p2")


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_positions_are_megatrons_split(cp, monkeypatch):
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # megatron reads the group then
    s = 8 * cp
    for r in range(cp):
        theirs = get_batch_on_this_cp_rank({"x": torch.arange(s)[None]}, cp_group=FakeGroup(cp, r))["x"][0]
        assert torch.equal(local_positions(cp, r, s // cp, "cpu"), theirs)


def test_spec_swap_replaces_only_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from toolkit.mcore.spec_swap import swap_module

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    swapped = context_parallel_spec(spec)
    assert swapped.submodules.self_attention.submodules.core_attention is ContextParallelAttention
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention  # not mutated
    assert swap_module(swapped, ContextParallelAttention, DotProductAttention) == spec


def test_window_mask_is_megatrons(monkeypatch):
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    real = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *a, device=None, **k: real(*a, **k))  # megatron allocates on "cuda"
    pos = torch.arange(12)
    for window in [(3, 0), (5, 2), (0, 0)]:
        mine = Visibility(pos, None, True, window).masked(slice(None), pos)[0, 0]
        assert torch.equal(mine, get_sliding_window_causal_mask(12, 12, window))


def sdpa_reference(q, k, v, masked):
    """torch's scaled_dot_product_attention in megatron's [s, b, heads, d] layout."""
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=~masked, enable_gqa=True)
    return out.permute(2, 0, 1, 3)


@pytest.mark.parametrize("rows", [False, True], ids=["causal from positions", "given mask rows"])
def test_ring_matches_sdpa_and_its_backward_is_exact(rows):
    """A ring of one rank holding cp rank 0's tokens of cp = 2 (positions 0-3 and 12-15): the
    chunk pair (0-3, 12-15) is all masked and skipped unless the mask is given as rows."""
    g = torch.Generator().manual_seed(0)
    s, b, heads, groups, d = 8, 2, 4, 2, 3
    q = torch.randn(s, b, heads, d, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(s, b, groups, d, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    pos = local_positions(2, 0, s, "cpu")
    masked = pos[None, :] > pos[:, None]
    given = torch.arange(2 * s)[None, :] > pos[:, None]  # megatron's cp form: local rows, global columns
    vis = Visibility(pos, given[None, None] if rows else None, True, None)
    schedule = every_pair(s, [s], s // 2) if rows else pair_schedule(s, (pos,), s // 2, vis.masked)
    assert len(schedule[0]) == (4 if rows else 3)
    plan = RingPlan(OneRank(), d ** -0.5, (pos,), vis.masked, schedule)
    with HostSyncs() as syncs:
        out = ring_attention(q, k, v, plan)
        out.sum().backward()
    assert syncs.reads == 0  # the schedule decided what to skip: no host read in forward or backward
    torch.testing.assert_close(out, sdpa_reference(q, k, v, masked), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: ring_attention(*t, plan), (q, k, v), atol=1e-9, rtol=1e-6)


# ------------------------------------------------------------------------- 4 ranks, megatron
@pytest.fixture(scope="module")
def checks() -> list[dict]:
    for _ in range(3):  # a free port can be taken before torchrun binds it: then try another
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
               str(free_port()), str(WORKER)]
        r = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=900)
        if "EADDRINUSE" not in r.stdout + r.stderr:
            break
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    records = [json.loads(line[6:]) for line in r.stdout.splitlines() if line.startswith("CHECK ")]
    for rec in records:
        print(json.dumps(rec))
    return records


def test_every_layout_and_comm_type_was_checked(checks):
    module = {(c["layout"], c["kind"]) for c in checks if c["check"] == "module"}
    kinds = ("p2p", "all_gather", "a2a")
    assert module == ({("tp1 cp2 dp2", k) for k in kinds} | {("tp2 cp2", k) for k in kinds}
                      | {("tp1 cp4 hcp[2,2]", k) for k in (*kinds, "a2a+p2p")})
    assert sum(c["check"] == "module" for c in checks) == 47
    model = {(c["layout"], c["kind"], c["mask"]) for c in checks if c["check"] == "model"}
    assert {("tp1 cp2", k, "cp") for k in kinds} | {("tp1 cp2", "p2p", None), ("tp1 cp4 hcp[2, 2]", "a2a+p2p", "cp"),
                                                    ("tp2 cp2", "p2p", "cp"), ("tp2 cp2", "all_gather", "cp")} <= model


def test_no_host_read_in_a_step(checks):
    """The ring decides which chunk pairs to skip once per sequence length: a later forward and
    backward reads no tensor on the host (before: two reads per chunk pair and pass, 26 per
    layer at cp2 p2p with causal masks, 100 at cp4 a2a+p2p; each a wait for the GPU on CUDA)."""
    for c in checks:
        if c["check"] == "module":
            assert c["host_reads"] == 0, c


def test_module_fp32_equals_megatron_on_the_whole_sequence(checks):
    for c in checks:
        if c["check"] == "module" and c["dtype"] == "float32":
            assert max(c[k] for k in ("out", "dq", "dk", "dv")) <= FP32_TOL, c


def test_module_bf16_is_as_close_as_megatrons_own_bf16(checks):
    bf16 = [c for c in checks if c["check"] == "module" and c["dtype"] == "bfloat16"]
    assert len(bf16) == 10
    for c in bf16:
        for k in ("out", "dq", "dk", "dv"):
            assert c[k] <= BF16_RATIO * c[k + "_megatron_bfloat16"], (k, c)


def test_gpt_model_at_cp_equals_cp1(checks):
    for c in checks:
        if c["check"] == "model":
            assert c["logits"] <= FP32_TOL and c["grads"] <= 2 * FP32_TOL, c
            if c["kind"] == "swapped spec":
                assert c["logits"] == 0 and c["grads"] == 0, c


def test_refusals_name_the_numbers(checks):
    said = {c["case"]: c["message"] for c in checks if c["check"] == "refusal"}
    assert said["a2a_heads"].startswith("SpecError") and "query groups per tp rank 1" in said["a2a_heads"]
    assert said["p2p_dropout"].startswith("SpecError") and "attention_dropout=0.1" in said["p2p_dropout"]
    assert said["no_hierarchy"].startswith("SpecError") and "hierarchical_context_parallel_sizes" in said["no_hierarchy"]
    assert said["local_mask"].startswith("ValueError") and "s/cp=16, s=32" in said["local_mask"]
