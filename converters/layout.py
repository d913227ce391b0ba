"""A checkpoint's parallel layout, checked with the spine's rules, and where each layer lives.

Layers are placed exactly as megatron-core places them (toolkit.parallel.pipeline.PipelineSplit):
evenly (with pp stages and vpp virtual chunks, chunk v of stage p holds the n = L/(pp*vpp)
layers starting at (v*pp + p)*n), or unevenly (first / last stage layer counts, or the
embedding / loss counted as a layer), each chunk naming its layers ``decoder.layers.0..n-1``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from toolkit.errors import PlanError
from toolkit.models import ModelShape
from toolkit.parallel.pipeline import PipelineSplit


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None = tp
    first_stage_layers: int | None = None  # megatron's num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # megatron's num_layers_in_last_pipeline_stage
    embedding_in_split: bool = False  # account_for_embedding_in_pipeline_split
    loss_in_split: bool = False  # account_for_loss_in_pipeline_split

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def world(self) -> int:
        """The smallest world holding both grids: tp*pp (dense) and etp*ep*pp (experts)."""
        return self.pp * math.lcm(self.tp, self.expert_tp * self.ep)

    def split(self, num_layers: int) -> PipelineSplit:
        """megatron's placement of ``num_layers`` decoder layers over the stages and chunks."""
        return PipelineSplit(num_layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers,
                             self.embedding_in_split, self.loss_in_split)

    @property
    def uneven(self) -> bool:
        return (self.first_stage_layers, self.last_stage_layers) != (None, None) or self.embedding_in_split \
            or self.loss_in_split

    def describe(self) -> str:
        s = f"tp={self.tp} pp={self.pp} vpp={self.vpp}"
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None:
                s += f" {name}={getattr(self, name)}"
        s += " embedding_in_split" * self.embedding_in_split + " loss_in_split" * self.loss_in_split
        return s + (f" ep={self.ep} etp={self.expert_tp}" if self.ep > 1 or self.etp is not None else "")

    def chunk_layers(self, num_layers: int, pp_rank: int, vp: int) -> range:
        """Global layer numbers of virtual chunk ``vp`` on pipeline stage ``pp_rank``."""
        return self.split(num_layers).chunk_range(pp_rank, vp)

    def place_layer(self, num_layers: int, layer: int) -> tuple[int, int, int]:
        """(pp_rank, vp, index inside the chunk) of a global layer."""
        return _place(self.split(num_layers), layer)

    def place_expert(self, num_experts: int, expert: int) -> tuple[int, int]:
        """(ep_rank, local index): global expert = ep_rank * experts_per_rank + local."""
        return divmod(expert, num_experts // self.ep)


@lru_cache(maxsize=4096)
def _place(split: PipelineSplit, layer: int) -> tuple[int, int, int]:
    return split.place(layer)  # a search over the chunks; asked once per tensor of every layer


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
        "parallel": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "ep": layout.ep, "etp": layout.etp,
                     "first_stage_layers": layout.first_stage_layers, "last_stage_layers": layout.last_stage_layers,
                     "embedding_in_split": layout.embedding_in_split, "loss_in_split": layout.loss_in_split},
        "zero": {"stage": 0}, "precision": precision, "recompute": "none",
        "batch": {"micro": 1, "global": dp * layout.pp, "seq_len": seq_len},
        "moe": {"grouped_gemm": grouped_gemm, "token_dispatcher": token_dispatcher},
    })
    return make_plan(spec, shape=shape)


def _mla_problems(shape: ModelShape, tp: int) -> list[str]:
    """megatron's local spec splits MLA's latent down-projections over tp (ColumnParallelLinear)."""
    a = shape.mla
    if a is None:
        return []
    sizes = {"q_lora_rank": a.q_lora_rank or 0, "kv_lora_rank + qk_rope_head_dim": a.kv_lora_rank + a.qk_rope_head_dim}
    return [f"tp={tp} does not divide {name}={n} (megatron-core's local spec splits that down-projection over tp)"
            for name, n in sizes.items() if n % tp]


CHECKPOINT_SCOPES = ("layout", "model")  # toolkit.plan.rules.SCOPES that a checkpoint's layout answers to


def validate_layout(shape: ModelShape, layout: Layout) -> None:
    """Raise the spine's PlanError listing every rule the layout breaks for this model: the
    rules whose scope is a layout of a model (toolkit.plan.rules.SCOPES). Not properties of a
    checkpoint, so not checked: the run's (memory fit, MLA at tp > 1 on the local spec, which
    TransformerEngine's spec trains) and the target's (whether Megatron-LM's flags can express
    the model: the args written carry what they cannot)."""
    plan = conversion_plan(shape, layout)
    errors = [f.message for f in plan.findings if f.level == "error" and f.scope in CHECKPOINT_SCOPES]
    errors += _mla_problems(shape, layout.tp)
    if shape.moe is None and layout.etp not in (None, layout.tp):
        errors.append(f"etp={layout.etp} needs a MoE model; {shape.architecture} has no experts")
    if errors:
        raise PlanError(errors)
