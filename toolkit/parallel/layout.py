"""Derived parallel sizes and batch arithmetic: the numbers every output shares."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..models import ModelShape
from ..spec import TrainingSpec
from .pipeline import PipelineSplit


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    cp: int
    dp: int  # world / (tp * pp * cp)
    edp: int  # expert data parallel: world / (etp * ep * pp)
    sequence_parallel: bool
    gpus_per_node: int
    split: PipelineSplit = None  # which layers each pipeline stage builds (megatron's placement)
    cp_comm: str = "p2p"  # megatron's cp_comm_type
    cp_a2a: int | None = None  # a2a+p2p: the all-to-all level's size
    tp_comm_overlap: bool = False  # TE's userbuffer overlap of tp communication (where it applies: tp > 1 with SP)
    ep_a2a_overlap: bool = False  # megatron's EP all-to-all overlap (where it applies: ep > 1, vpp > 1 when pp > 1)

    def as_dict(self) -> dict:
        flags = ("tp_comm_overlap", "ep_a2a_overlap")
        d = {k: v for k, v in asdict(self).items() if k not in ("gpus_per_node", "split", "cp_a2a", *flags)}
        d.update({k: True for k in flags if getattr(self, k)})
        if self.cp == 1:
            d.pop("cp_comm")
        if self.cp_a2a is not None:
            d["cp_a2a"] = self.cp_a2a
        if self.split is not None and self.split.megatron_fields():
            d["pipeline_split"] = self.split.describe()
        return d

    def pipeline(self, num_layers: int) -> PipelineSplit:
        """The layer split (an even one for a Layout built without it, e.g. in tests)."""
        return self.split if self.split is not None else PipelineSplit(num_layers, self.pp, self.vpp)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp


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
    """Sizes from the spec; divisions that do not come out even are floored here and
    reported by the rules (so one bad size does not hide the others)."""
    p, world = spec.parallel, spec.cluster.world_size
    etp = p.etp if p.etp is not None else p.tp
    sp = p.sequence_parallel if p.sequence_parallel is not None else p.tp > 1
    return Layout(
        world=world, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=etp, cp=p.cp,
        dp=max(1, world // (p.tp * p.pp * p.cp)),
        edp=max(1, world // (etp * p.ep * p.pp)),
        sequence_parallel=sp, gpus_per_node=spec.cluster.gpus_per_node,
        split=PipelineSplit(shape.num_layers, p.pp, p.vpp, p.first_stage_layers, p.last_stage_layers,
                            p.embedding_in_split, p.loss_in_split),
        cp_comm=p.cp_comm, cp_a2a=p.cp_a2a, tp_comm_overlap=p.tp_comm_overlap and p.tp > 1 and sp,
        ep_a2a_overlap=spec.moe.a2a_overlap and a2a_overlap_applies(p.ep, p.pp, p.vpp),
    )


def a2a_overlap_applies(ep: int, pp: int, vpp: int) -> bool:
    """Where megatron-core 0.16 can overlap the expert-parallel all-to-alls: ep > 1, and with
    pipelining only in the interleaved schedule (TransformerConfig.__post_init__)."""
    return ep > 1 and (pp == 1 or vpp > 1)


def derive_batch(spec: TrainingSpec, layout: Layout) -> BatchPlan:
    b = spec.batch
    return BatchPlan(micro=b.micro, global_=b.global_, grad_accum=max(1, b.global_ // (b.micro * layout.dp)),
                     seq_len=b.seq_len)
