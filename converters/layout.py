"""A checkpoint's parallel layout, checked with the spine's rules, and where each layer lives.

Megatron numbers pipeline chunks the interleaved way: with pp stages and vpp virtual
chunks, chunk v of stage p holds the n = L/(pp*vpp) layers starting at (v*pp + p)*n,
named ``decoder.layers.0..n-1`` inside that chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.errors import PlanError
from toolkit.models import ModelShape


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None = tp

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def world(self) -> int:
        """The smallest world holding both grids: tp*pp (dense) and etp*ep*pp (experts)."""
        return self.pp * math.lcm(self.tp, self.expert_tp * self.ep)

    def describe(self) -> str:
        s = f"tp={self.tp} pp={self.pp} vpp={self.vpp}"
        return s + (f" ep={self.ep} etp={self.expert_tp}" if self.ep > 1 or self.etp is not None else "")

    def chunk_layers(self, num_layers: int, pp_rank: int, vp: int) -> range:
        """Global layer numbers of virtual chunk ``vp`` on pipeline stage ``pp_rank``."""
        n = num_layers // (self.pp * self.vpp)
        start = (vp * self.pp + pp_rank) * n
        return range(start, start + n)

    def place_layer(self, num_layers: int, layer: int) -> tuple[int, int, int]:
        """(pp_rank, vp, index inside the chunk) of a global layer."""
        n = num_layers // (self.pp * self.vpp)
        chunk, index = divmod(layer, n)
        vp, pp_rank = divmod(chunk, self.pp)
        return pp_rank, vp, index

    def place_expert(self, num_experts: int, expert: int) -> tuple[int, int]:
        """(ep_rank, local index): global expert = ep_rank * experts_per_rank + local."""
        return divmod(expert, num_experts // self.ep)


def conversion_plan(shape: ModelShape, layout: Layout, *, precision: str = "fp32", seq_len: int = 64,
                    grouped_gemm: bool = False, token_dispatcher: str = "alltoall"):
    """The spine's Plan for this model at this layout on CPU ranks (one micro-batch per
    pipeline stage so the interleaved-schedule rule holds)."""
    from toolkit.plan import make_plan
    from toolkit.spec import TrainingSpec

    world = layout.world
    dp = world // (layout.tp * layout.pp)
    spec = TrainingSpec.from_dict({
        "model": shape.architecture, "target": "megatron-lm", "attention": {"backend": "unfused"},
        "cluster": {"nodes": 1, "gpus_per_node": world, "gpu": "cpu"},
        "parallel": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "ep": layout.ep, "etp": layout.etp},
        "zero": {"stage": 0}, "precision": precision, "recompute": "none",
        "batch": {"micro": 1, "global": dp * layout.pp, "seq_len": seq_len},
        "moe": {"grouped_gemm": grouped_gemm, "token_dispatcher": token_dispatcher},
    })
    return make_plan(spec, shape=shape)


def validate_layout(shape: ModelShape, layout: Layout) -> None:
    """Raise the spine's PlanError listing every rule the layout breaks for this model
    (memory fit is not a property of a checkpoint and is not checked)."""
    from toolkit.plan import memory_finding

    plan = conversion_plan(shape, layout)
    mem = memory_finding(plan.memory, plan.gpu, plan.spec.estimate.headroom)
    errors = [e for e in plan.errors if mem is None or e != mem.message]
    if shape.moe is None and layout.etp not in (None, layout.tp):
        errors.append(f"etp={layout.etp} needs a MoE model; {shape.architecture} has no experts")
    if errors:
        raise PlanError(errors)
