"""Published layouts as specs, with the figure each source publishes (the source of each
is named in its entry: a recipe file, a benchmark page), to compare the planner with.

Each entry is the source's layout in our spec's terms. Megatron's distributed optimizer is
ZeRO-1 here and FSDP is ZeRO-3. Where a source reports throughput, ``tokens_per_gpu`` is the
tokens/s/GPU it publishes and ``comparable`` says whether our estimate (bf16, the registry's
h100-80gb) measures the same thing: FP8 runs and torchtitan's 500 W HBM2e H100s are not.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..spec import TrainingSpec
from . import Plan, make_plan
from .memory import GiB, usable_bytes
from .search import SearchResult, search

DGXC_70B = ("NVIDIA/dgxc-benchmarking llama3.1/README_70b.md: NeMo 24.09 BF16, TP4 PP4 CP2 VP5 MBS1 GA64, "
            "64 H100 GBS 128: 71,235 tokens/s (14.72 s/step), i.e. 1,113 tokens/s/GPU")


@dataclass(frozen=True)
class Published:
    name: str
    spec: dict
    source: str
    tokens_per_gpu: float | None = None  # published tokens/s/GPU
    comparable: bool = False  # does our estimate measure the same run (precision, hardware)?
    note: str = ""


def _spec(model: str, nodes: int, parallel: dict, *, seq: int, gbs: int, micro: int = 1, zero: int = 1,
          recompute: str = "none") -> dict:
    return {"model": model, "target": "megatron-lm", "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": "h100-80gb"},
            "parallel": parallel, "zero": {"stage": zero}, "recompute": recompute,
            "batch": {"micro": micro, "global": gbs, "seq_len": seq}}


PUBLISHED = (
    Published("Llama-3-70B, 32 H100 (Megatron-Bridge llama3_70b pretrain recipe)",
              _spec("llama3-70b", 4, {"tp": 4, "pp": 4, "vpp": 5, "cp": 2, "sequence_parallel": True},
                    seq=8192, gbs=512),
              "Megatron-Bridge recipes/llama/llama3_70b.py (TP4 PP4 VP5 CP2 SP, seq 8192, GBS 512, MBS 1, "
              "distributed optimizer, no recompute); no throughput published for 32 GPUs: the figure is "
              "the same per-GPU layout on 64 GPUs, " + DGXC_70B, 1113.0, True,
              "32 GPUs give dp=1 and 512 micro-batches per step, the 64-GPU run dp=2 and 64"),
    Published("Llama-3-70B, 64 H100 BF16 (DGXC benchmark, NeMo 24.09)",
              _spec("llama3-70b", 8, {"tp": 4, "pp": 4, "vpp": 5, "cp": 2, "sequence_parallel": True},
                    seq=8192, gbs=128),
              DGXC_70B, 1113.0, True),
    Published("Llama-3-70B, 64 H100 FP8 (Megatron-Bridge performance summary)",
              _spec("llama3-70b", 8, {"tp": 4, "pp": 8, "vpp": 5, "sequence_parallel": True}, seq=8192, gbs=128),
              "Megatron-Bridge docs/performance-summary.md, 25.11, DGX-H100 FP8-CS: TP4 PP8 VP5, GBS 128, MBS 1, "
              "seq 8192: 1,602 tokens/s/GPU, 719 model TFLOP/s/GPU", 1602.0, False,
              "FP8 run; we estimate bf16 (FP8 is not modelled)"),
    Published("Llama-3-70B, 256 H100 (torchtitan, FSDP32 x TP8)",
              _spec("llama3-70b", 32, {"tp": 8, "sequence_parallel": True}, seq=8192, gbs=512, micro=16, zero=3,
                    recompute="full"),
              "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4: FSDP 32 x TP 8, local "
              "batch 16, GBS 512, full activation checkpointing, torch.compile + Float8: 829 tokens/s/GPU, "
              "71.9 GiB", 829.0, False, "Float8 on 96 GB HBM2e H100s at 500 W; we estimate bf16 on h100-80gb"),
    Published("Qwen3-30B-A3B, 8 H100 (Megatron-Bridge qwen3_30b_a3b pretrain recipe)",
              _spec("qwen3-30b-a3b", 1, {"tp": 4, "pp": 2, "ep": 4, "etp": 1, "sequence_parallel": True},
                    seq=4096, gbs=32, micro=2, recompute="full"),
              "Megatron-Bridge recipes/qwen/qwen3_moe.py (TP4 PP2 EP4 ETP1 SP, full recompute) with "
              "recipes/common.py _pretrain_common batch defaults (GBS 32, MBS 2, seq 4096); no throughput published"),
    Published("Mixtral-8x7B, 64 H100 (NeMo 2 recipe)",
              _spec("mixtral-8x7b", 8, {"tp": 1, "pp": 4, "vpp": 8, "ep": 8}, seq=4096, gbs=512,
                    recompute="selective"),
              "NeMo 2 nemo/collections/llm/recipes/mixtral_8x7b.py performance layout (TP1 PP4 VPP8 EP8, "
              "GBS 512; its SP flag is a no-op at TP1) = examples/mixtral8x7b_ep.yaml; no throughput published"),
    Published("DeepSeek-V3, 1024 H100 (Megatron-Bridge recipe)",
              _spec("deepseek-v3", 128, {"tp": 2, "pp": 16, "ep": 64, "etp": 1, "sequence_parallel": True},
                    seq=4096, gbs=4096, recompute="selective"),
              "Megatron-Bridge recipes/deepseek/deepseek_v3.py: TP2 PP16 EP64 ETP1 SP, seq 4096, GBS 4096; it splits the 61 "
              "layers unevenly over 16 stages, which this toolkit's layouts cannot express; no throughput used"),
    Published("LLaMA-70B (seed), 1024 H100",
              _spec("llama3-70b", 128, {"tp": 8, "pp": 8, "sequence_parallel": True}, seq=4096, gbs=2048,
                    recompute="selective"),
              "seed document (TP8 PP8 DP16, MBS 1, GBS 2048) = examples/llama70b_1024gpu.yaml; no throughput"),
)


@dataclass(frozen=True)
class Comparison:
    case: Published
    plan: Plan  # our estimate of the published layout
    search: SearchResult  # our search for the same model, GPUs and batch
    why: str  # where our pick differs: which estimated costs (or memory) make the difference

    @property
    def pick(self) -> Plan | None:
        return self.search.candidates[0].plan if self.search.candidates else None

    @property
    def ratio(self) -> float | None:
        """Our tokens/s/GPU estimate of the published layout over the published figure."""
        if self.case.tokens_per_gpu is None or not self.plan.valid:
            return None
        return self.plan.time.tokens_per_s / self.plan.layout.world / self.case.tokens_per_gpu


def time_terms(plan: Plan) -> dict[str, float]:
    """Seconds per step by cause (the terms TimeEstimate.dominant compares)."""
    return plan.time.terms


def _same_layout(a: Plan, b: Plan) -> bool:
    return (a.layout, a.spec.zero, a.batch.micro, a.spec.recompute) == (b.layout, b.spec.zero, b.batch.micro,
                                                                       b.spec.recompute)


def explain_difference(published: Plan, pick: Plan | None, headroom: float) -> str:
    if pick is None:
        return "no layout fits"
    if not published.valid:
        return "the published layout is rejected: " + published.errors[0]
    if not published.memory.fits(headroom):
        return (f"the published layout needs {published.memory.worst.total / GiB:.1f} GiB per GPU, more than the "
                f"{usable_bytes(published.gpu.memory_gib, headroom) / GiB:.1f} GiB the search allows "
                f"({headroom:.0%} headroom); the pick needs {pick.memory.worst.total / GiB:.1f}")
    if _same_layout(published, pick):
        return "the pick is the published layout"
    ours, theirs = time_terms(pick), time_terms(published)
    saved = sorted(((theirs[k] - ours[k], k) for k in ours), reverse=True)
    gains = [f"{k} {d:.3g} s" for d, k in saved if d > 1e-3 * published.time.step_time_s][:3]
    costs = [f"{k} {-d:.3g} s" for d, k in saved if -d > 1e-3 * published.time.step_time_s][:2]
    mem = f"; memory {pick.memory.worst.total / GiB:.1f} vs {published.memory.worst.total / GiB:.1f} GiB"
    text = "the pick saves " + (", ".join(gains) or "nothing measurable")
    return text + (" and spends more on " + ", ".join(costs) if costs else "") + " per step" + mem


def compare(case: Published) -> Comparison:
    spec = TrainingSpec.from_dict(case.spec)
    plan = make_plan(spec)
    result = search(spec, top=1)
    pick = result.candidates[0].plan if result.candidates else None
    return Comparison(case, plan, result, explain_difference(plan, pick, result.headroom))
