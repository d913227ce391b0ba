"""The parallel layout: megatron-core's grid for a run or a checkpoint, and every size derived
from it, computed here and nowhere else.

megatron-core orders its grid tp-cp-ep-dp-pp (parallel_state.initialize_model_parallel): the
dense weights see world = tp x cp x dp x pp, the experts world = etp x ep x edp x pp.
DeepSpeed's data-parallel group is megatron's with context parallel (dp x cp ranks hold the
same dense weights: ZeRO shards over them and their gradients are reduced together).

A layout built for a run (``derive_layout``) knows its cluster (world, gpus_per_node) and its
model's layer count (so ``split`` says which layers each stage builds); a checkpoint's layout
(``Layout(tp=2, pp=2)``) has neither: its world is the smallest one holding both grids, and
``pipeline(num_layers)`` places a model's layers. Sizes that do not come out even are
floored here and reported by the planner's rules, so that one bad size does not hide the others.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from ..models import ModelShape
from .pipeline import PipelineSplit

if TYPE_CHECKING:  # annotations only: the converters import this module, and pydantic's spec
    from ..spec import TrainingSpec  # models would cost every conversion's start-up (issue 44)


LAYER_FIELDS = ("tp", "ep", "etp", "cp", "sequence_parallel", "cp_comm", "cp_a2a", "tp_comm_overlap",
                "gpus_per_node")  # what Layout.for_layers keeps


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None: tp (a run's layout always says it)
    cp: int = 1
    first_stage_layers: int | None = None  # megatron's num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # megatron's num_layers_in_last_pipeline_stage
    embedding_in_split: bool = False  # account_for_embedding_in_pipeline_split
    loss_in_split: bool = False  # account_for_loss_in_pipeline_split
    sequence_parallel: bool = False
    cp_comm: str = "p2p"  # megatron's cp_comm_type
    cp_a2a: int | None = None  # a2a+p2p: the all-to-all level's size
    tp_comm_overlap: bool = False  # TE's userbuffer overlap of tp communication (where it applies: tp > 1 with SP)
    ep_a2a_overlap: bool = False  # megatron's EP all-to-all overlap (where it applies: ep > 1, vpp > 1 when pp > 1)
    world: int | None = None  # the ranks; None: the smallest world holding both grids (a checkpoint's)
    gpus_per_node: int | None = None  # None: no cluster (a checkpoint's layout)
    num_layers: int | None = None  # the model's decoder layers that ``split`` places; None: no model

    def __post_init__(self) -> None:
        if self.world is None:
            object.__setattr__(self, "world", self.pp * math.lcm(self.tp * self.cp, self.expert_tp * self.ep))

    # Derived sizes are plain properties: the search's views (toolkit.search.partial.View) evaluate them
    # field by field, so that a rule reading one depends on the axes of the fields it reads.
    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def dp(self) -> int:
        """Data parallel: world / (tp x pp x cp)."""
        return max(1, self.world // (self.tp * self.pp * self.cp))

    @property
    def edp(self) -> int:
        """Expert data parallel: world / (etp x ep x pp), context parallel included."""
        return max(1, self.world // (self.expert_tp * self.ep * self.pp))

    @property
    def dp_cp(self) -> int:
        """DeepSpeed's data-parallel group (megatron's data-parallel group with context parallel):
        the ranks holding the same dense weights, over which ZeRO shards and gradients are reduced."""
        return self.dp * self.cp

    @property
    def model_parallel(self) -> int:
        """Ranks holding one copy of the dense weights: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage: world / pp."""
        return self.world // self.pp

    @property
    def seq_shards(self) -> int:
        """Ranks a layer's sequence-sharded activations are split over: tp under sequence parallelism."""
        return self.tp if self.sequence_parallel else 1

    def seq_per_rank(self, seq: int) -> int:
        """Positions of one sequence in this rank's hidden states between layers ([s, b, h]):
        its context-parallel shard, split again over tp under sequence parallelism."""
        return seq // self.cp // self.seq_shards

    @property
    def hierarchical_cp(self) -> list[int] | None:
        """megatron's hierarchical_context_parallel_sizes: [all-to-all level, ring] under a2a+p2p."""
        if self.cp > 1 and self.cp_comm == "a2a+p2p" and self.cp_a2a:
            return [self.cp_a2a, self.cp // self.cp_a2a]
        return None

    @property
    def split(self) -> PipelineSplit | None:
        """Which layers each pipeline stage builds (megatron's placement); None without a model."""
        n = self.num_layers
        if n is None:
            return None
        return _split(n, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers,
                      self.embedding_in_split, self.loss_in_split)

    def pipeline(self, num_layers: int) -> PipelineSplit:
        """megatron's placement of ``num_layers`` decoder layers over the stages and chunks."""
        return _split(num_layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers,
                      self.embedding_in_split, self.loss_in_split)

    def for_layers(self) -> Layout:
        """The part of the layout one transformer layer's work and communication depend on (tp,
        sequence parallel and its overlap, cp and its communication, ep, etp, the node size), with
        the pipeline and the data-parallel sizes left out: layouts that differ only there give equal
        ones, which the step-time model caches its layers' times by."""
        return Layout(**{f: getattr(self, f) for f in LAYER_FIELDS})

    @property
    def uneven(self) -> bool:
        """Placed otherwise than evenly: first/last stage counts, or embedding/loss counted as layers."""
        return (self.first_stage_layers, self.last_stage_layers) != (None, None) or self.embedding_in_split \
            or self.loss_in_split

    def as_dict(self) -> dict:
        """The run's layout as the plan's JSON and a checkpoint's state record it."""
        d = {"world": self.world, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep, "etp": self.etp,
             "cp": self.cp, "dp": self.dp, "edp": self.edp, "sequence_parallel": self.sequence_parallel}
        if self.cp != 1:
            d["cp_comm"] = self.cp_comm
        d.update({k: True for k in ("tp_comm_overlap", "ep_a2a_overlap") if getattr(self, k)})
        if self.cp_a2a is not None:
            d["cp_a2a"] = self.cp_a2a
        split = self.split
        if split is not None and split.megatron_fields():
            d["pipeline_split"] = split.describe()
        return d

    def describe(self) -> str:
        """A checkpoint's layout in words (the converters' messages)."""
        s = f"tp={self.tp} pp={self.pp} vpp={self.vpp}"
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None:
                s += f" {name}={getattr(self, name)}"
        s += " embedding_in_split" * self.embedding_in_split + " loss_in_split" * self.loss_in_split
        return s + (f" ep={self.ep} etp={self.expert_tp}" if self.ep > 1 or self.etp is not None else "")

    def chunk_layers(self, num_layers: int, pp_rank: int, vp: int) -> range:
        """Global layer numbers of virtual chunk ``vp`` on pipeline stage ``pp_rank``."""
        return self.pipeline(num_layers).chunk_range(pp_rank, vp)

    def place_layer(self, num_layers: int, layer: int) -> tuple[int, int, int]:
        """(pp_rank, vp, index inside the chunk) of a global layer."""
        return _place(self.pipeline(num_layers), layer)

    def place_expert(self, num_experts: int, expert: int) -> tuple[int, int]:
        """(ep_rank, local index): global expert = ep_rank * experts_per_rank + local."""
        return divmod(expert, num_experts // self.ep)


@lru_cache(maxsize=4096)
def _split(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None, embedding: bool,
           loss: bool) -> PipelineSplit:
    return PipelineSplit(num_layers, pp, vpp, first, last, embedding, loss)  # one object per split: its caches hold


@lru_cache(maxsize=4096)
def _place(split: PipelineSplit, layer: int) -> tuple[int, int, int]:
    return split.place(layer)  # a search over the chunks; asked once per tensor of every layer


@dataclass(frozen=True)
class BatchPlan:
    micro: int
    global_: int
    grad_accum: int  # = global / (micro * dp): the number of micro-batches per step
    seq_len: int

    def as_dict(self) -> dict:
        return {"micro": self.micro, "global": self.global_, "grad_accum": self.grad_accum,
                "seq_len": self.seq_len}

    @property
    def tokens(self) -> int:
        return self.global_ * self.seq_len


def derive_layout(spec: TrainingSpec, shape: ModelShape) -> Layout:
    """The spec's layout of this model on its cluster."""
    p = spec.parallel
    etp = p.etp if p.etp is not None else p.tp
    sp = p.sequence_parallel if p.sequence_parallel is not None else p.tp > 1
    return Layout(
        tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=etp, cp=p.cp, first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers, embedding_in_split=p.embedding_in_split, loss_in_split=p.loss_in_split,
        sequence_parallel=sp, cp_comm=p.cp_comm, cp_a2a=p.cp_a2a, tp_comm_overlap=p.tp_comm_overlap and p.tp > 1 and sp,
        ep_a2a_overlap=spec.moe.a2a_overlap and a2a_overlap_applies(p.ep, p.pp, p.vpp),
        world=spec.cluster.world_size, gpus_per_node=spec.cluster.gpus_per_node, num_layers=shape.num_layers,
    )


def a2a_overlap_applies(ep: int, pp: int, vpp: int) -> bool:
    """Where megatron-core 0.16 can overlap the expert-parallel all-to-alls: ep > 1, and with
    pipelining only in the interleaved schedule (TransformerConfig.__post_init__)."""
    return ep > 1 and (pp == 1 or vpp > 1)


def derive_batch(spec: TrainingSpec, layout: Layout) -> BatchPlan:
    b = spec.batch
    return BatchPlan(micro=b.micro, global_=b.global_, grad_accum=max(1, b.global_ // (b.micro * layout.dp)),
                     seq_len=b.seq_len)
