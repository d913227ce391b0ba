"""Which transformer layers each pipeline stage and virtual chunk builds: megatron-core's split.

megatron-core 0.16 places layers by these TransformerConfig fields (``get_num_layers_to_build``
and ``get_transformer_layer_offset``; tests/toolkit/parallel/test_pipeline.py checks every case here
against them):
  - even: each of the pp stages gets L / pp layers; with vpp chunks per stage, chunk v of
    stage p holds the n = L / (pp * vpp) layers from (v * pp + p) * n (interleaved order);
  - uneven (``num_layers_in_first_pipeline_stage`` / ``..._last_...``, Megatron-LM's
    ``--decoder-first/last-pipeline-num-layers``): the first and/or last stage get the given
    counts, the middle stages split the rest evenly; with vpp each stage's count is split
    evenly over its chunks, and round v of the interleaved order holds chunk v of every stage;
  - embedding / loss as a layer (``account_for_embedding/loss_in_pipeline_split``): the split
    is of L + 1 (+ 1) "layers" and the first (last) chunk builds one transformer layer fewer,
    none when that chunk is the accounted layer alone (Llama 3's 405B schedule).
Uneven counts and accounting cannot be combined (megatron asserts so). Nothing here imports
torch: the planner, the converters and the runtime read the same arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class PipelineSplit:
    num_layers: int
    pp: int = 1
    vpp: int = 1
    first: int | None = None  # layers on the first stage (None: as the middle stages)
    last: int | None = None  # layers on the last stage
    embedding: bool = False  # the embedding counts as a layer of the first chunk
    loss: bool = False  # the output layer and loss count as a layer of the last chunk

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def problems(self) -> list[str]:
        """Why megatron-core cannot build this split (every reason, with its numbers)."""
        if self.pp == 1:
            return ["first_stage_layers / last_stage_layers need pp > 1"] if self.uneven else []
        if self.uneven:
            return self._uneven_problems()
        n = self.num_layers + self.embedding + self.loss
        counted = f"num_layers={self.num_layers}" + (f" + {n - self.num_layers} (embedding/loss)" if n > self.num_layers else "")
        if n % self.pp:
            return [f"pp={self.pp} does not divide {counted}; set parallel.first_stage_layers / "
                    f"last_stage_layers for an uneven split"]
        if (n // self.pp) % self.vpp:
            return [f"vpp={self.vpp} does not divide the {n // self.pp} layers per pipeline stage ({counted} / "
                    f"pp={self.pp})"]
        return self._empty_chunks()

    def _uneven_problems(self) -> list[str]:
        out = []
        if self.embedding or self.loss:
            out.append("first/last stage layers cannot be combined with embedding/loss accounting (megatron-core "
                       "asserts so)")
        edges = [("first_stage_layers", self.first), ("last_stage_layers", self.last)]
        middle_layers = self.num_layers - sum(v or 0 for _, v in edges)
        middle = self.pp - sum(v is not None for _, v in edges)
        if middle_layers < 0 or (middle == 0 and middle_layers != 0):
            out.append(f"first_stage_layers + last_stage_layers = {self.num_layers - middle_layers} does not leave "
                       f"the right number of layers for the {middle} middle stages (num_layers={self.num_layers})")
        elif middle == 0 and self.vpp > 1:
            out.append(f"vpp={self.vpp} with both first_stage_layers and last_stage_layers at pp={self.pp} leaves no "
                       "middle stage, which megatron-core's interleaved placement divides by; use pp >= 3 or set one")
        elif middle and middle_layers % middle:
            out.append(f"the {middle_layers} layers left for the {middle} middle stages (num_layers={self.num_layers} "
                       f"minus first/last) are not divisible by {middle}")
        for name, v in edges:
            if v is not None and v % self.vpp:
                out.append(f"vpp={self.vpp} does not divide {name}={v}")
        if middle and middle_layers >= 0 and middle_layers % middle == 0 and (middle_layers // middle) % self.vpp:
            out.append(f"vpp={self.vpp} does not divide the {middle_layers // middle} layers per middle stage")
        return out or self._empty_chunks()

    def _empty_chunks(self) -> list[str]:
        """Every chunk builds a transformer layer, except the embedding's (loss's) chunk when it is
        one accounted "layer" alone: megatron-core builds that chunk without transformer layers
        (get_num_layers_to_build asserts >= 0 there), as Llama 3's schedule does (arXiv 2407.21783,
        section 3.3.2: its first chunk holds only the embedding, its last the output and loss)."""
        chunks = self.num_layers + (0 if self.uneven else self.embedding + self.loss)
        if self.pp * self.vpp > chunks:  # checked before counting chunk by chunk
            counted = "" if chunks == self.num_layers else f" + {chunks - self.num_layers} (embedding/loss)"
            return [f"pp x vpp = {self.pp} x {self.vpp} = {self.pp * self.vpp} model chunks for "
                    f"num_layers={self.num_layers}{counted}: every chunk needs at least one layer"]
        empty = [(p, v) for p in range(self.pp) for v in range(self.vpp)
                 if self.layers(p, v) < 1 and not (self._embedding_chunk(p, v) or self._loss_chunk(p, v))]
        if not empty:
            return []
        p, v = empty[0]
        return [f"pipeline stage {p}" + (f" chunk {v}" if self.vpp > 1 else "") + " would build no transformer "
                f"layer ({len(empty)} such chunk(s)); every stage needs at least one"]

    def _embedding_chunk(self, rank: int, vp: int) -> bool:
        """The chunk the embedding is accounted in as a layer: megatron's first."""
        return self.embedding and rank == 0 and vp == 0

    def _loss_chunk(self, rank: int, vp: int) -> bool:
        """The chunk the output layer and loss are accounted in as a layer: megatron's last."""
        return self.loss and rank == self.pp - 1 and vp == self.vpp - 1

    # --------------------------------------------------------------- megatron's arithmetic
    @cached_property
    def _middle(self) -> tuple[int, int]:
        """(middle stages, layers per middle stage) of an uneven split."""
        middle = self.pp - (self.first is not None) - (self.last is not None)
        rest = self.num_layers - (self.first or 0) - (self.last or 0)
        return middle, (rest // middle if middle > 0 else 0)

    def stage_count(self, rank: int) -> int:
        """Transformer layers built on pipeline stage `rank` (all its chunks)."""
        return sum(self.layers(rank, v) for v in range(self.vpp))

    def layers(self, rank: int, vp: int = 0) -> int:
        """Transformer layers built in chunk `vp` of stage `rank` (get_num_layers_to_build)."""
        if self.pp == 1:
            return self.num_layers
        if self.uneven:
            per = self._middle[1]
            if rank == 0 and self.first is not None:
                per = self.first
            if rank == self.pp - 1 and self.last is not None:
                per = self.last
            return per // self.vpp
        per = (self.num_layers + self.embedding + self.loss) // self.pp // self.vpp
        return per - self._embedding_chunk(rank, vp) - self._loss_chunk(rank, vp)

    def offset(self, rank: int, vp: int = 0) -> int:
        """Global index of the first layer of chunk `vp` on stage `rank` (get_transformer_layer_offset)."""
        if self.pp == 1:
            return 0
        if self.uneven:
            middle, per_middle = self._middle
            first, last = self.first or 0, self.last or 0
            chunk_first, chunk_middle = first // self.vpp, per_middle * middle // self.vpp
            round_size = chunk_first + chunk_middle + last // self.vpp
            if rank == 0:
                return vp * round_size
            middle_rank = rank if self.first is None else rank - 1
            return vp * round_size + chunk_first + middle_rank * (chunk_middle // middle if middle else 0)
        n = self.num_layers + self.embedding + self.loss
        per_chunk = n // self.pp // self.vpp
        offset = vp * (n // self.vpp) + rank * per_chunk
        return offset - (self.embedding and not self._embedding_chunk(rank, vp))

    def chunk_range(self, rank: int, vp: int = 0) -> range:
        start = self.offset(rank, vp)
        return range(start, start + self.layers(rank, vp))

    def stage_layer_ids(self, rank: int) -> list[int]:
        """Global indices of every layer on stage `rank`, chunk by chunk."""
        return [i for v in range(self.vpp) for i in self.chunk_range(rank, v)]

    def place(self, layer: int) -> tuple[int, int, int]:
        """(stage, chunk, index inside the chunk) of global layer `layer`."""
        for rank in range(self.pp):
            for v in range(self.vpp):
                r = self.chunk_range(rank, v)
                if layer in r:
                    return rank, v, layer - r.start
        raise IndexError(f"layer {layer} is not in a model of {self.num_layers} layers")

    def describe(self) -> str:
        """e.g. '8+8+...+8 (16 stages)' or '7+8x14+7'; per stage, chunks summed."""
        counts = [self.stage_count(r) for r in range(self.pp)]
        if len(set(counts)) == 1:
            return f"{counts[0]} x {self.pp}"
        inner = counts[1:-1]
        mid = f"{inner[0]}x{len(inner)}" if inner and len(set(inner)) == 1 else "+".join(map(str, inner))
        return "+".join(str(c) for c in [counts[0]] + ([mid] if mid else []) + [counts[-1]])

    def megatron_fields(self) -> dict:
        """TransformerConfig fields of this split (only those that differ from the defaults)."""
        d: dict = {}
        if self.first is not None:
            d["num_layers_in_first_pipeline_stage"] = self.first
        if self.last is not None:
            d["num_layers_in_last_pipeline_stage"] = self.last
        if self.embedding:
            d["account_for_embedding_in_pipeline_split"] = True
        if self.loss:
            d["account_for_loss_in_pipeline_split"] = True
        return d


def warmup_forwards(pp: int, vpp: int, stage: int, a2a_overlap: bool = False, micro_batches: int | None = None) -> int:
    """Forward passes (of one model chunk each) stage `stage` runs before its first backward:
    megatron-core's ``get_pp_rank_microbatches`` with the default micro-batch group of pp; its
    EP all-to-all overlap (``a2a_overlap``) runs one forward more first (interleaved), or
    without pipelining the next micro-batch's forward beside each backward
    (``combined_1f1b_schedule_for_no_pipelining``). With ``micro_batches`` given, at most all
    of them (every chunk of every micro-batch: a step too short to reach the steady state)."""
    if pp == 1:
        warmup = 1 if a2a_overlap else 0
    elif vpp == 1:
        warmup = pp - stage - 1
    else:
        warmup = 2 * (pp - stage - 1) + (vpp - 1) * pp + (1 if a2a_overlap else 0)
    return warmup if micro_batches is None else min(warmup, micro_batches * vpp)
