"""Published layouts against our estimates (benchmarks/plan_compare_published.py prints them all)."""
from toolkit.plan import make_plan
from toolkit.plan.published import PUBLISHED, compare, explain_difference
from toolkit.spec import TrainingSpec

LLAMA70B_32 = PUBLISHED[0]


def test_published_llama3_70b_32gpu_fits_and_throughput_within_25_percent():
    """Megatron-Bridge's Llama-3-70B recipe on 32 H100 (TP4 PP4 VPP5 CP2, seq 8192, GBS 512,
    MBS 1) against the published 1,113 tokens/s/GPU of the same per-GPU layout (NVIDIA DGXC
    benchmark, NeMo 24.09 BF16, 64 H100: 71,235 tokens/s)."""
    assert "32 H100" in LLAMA70B_32.name and LLAMA70B_32.tokens_per_gpu == 1113.0
    spec = TrainingSpec.from_dict(LLAMA70B_32.spec)
    lay = spec.parallel
    assert (lay.tp, lay.pp, lay.vpp, lay.cp, spec.batch.seq_len, spec.batch.global_, spec.batch.micro) == \
        (4, 4, 5, 2, 8192, 512, 1)
    plan = make_plan(spec)
    assert plan.valid and plan.memory.fits()
    per_gpu = plan.time.tokens_per_s / plan.layout.world
    assert abs(per_gpu / LLAMA70B_32.tokens_per_gpu - 1) < 0.25, per_gpu


def test_every_published_layout_has_an_estimate_and_a_source():
    for case in PUBLISHED:
        plan = make_plan(TrainingSpec.from_dict(case.spec))
        assert case.source
        if case.tokens_per_gpu is not None:
            assert plan.valid
    deepseek = next(c for c in PUBLISHED if c.name.startswith("DeepSeek"))
    assert "pp=16 does not divide num_layers=61" in make_plan(TrainingSpec.from_dict(deepseek.spec)).errors[0]


def test_comparison_says_why_the_pick_differs():
    case = next(c for c in PUBLISHED if c.name.startswith("Qwen3-30B"))
    c = compare(case)
    assert c.pick is not None and c.pick.time.step_time_s <= c.plan.time.step_time_s
    assert c.why.startswith("the pick saves ") and "GiB" in c.why
    assert explain_difference(c.plan, c.plan, 0.0) == "the pick is the published layout"
