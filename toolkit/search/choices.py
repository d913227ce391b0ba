"""The search's composite axes and which of their values it does not try.

``split``: how the pipeline stages share the layers (megatron-core's placement,
toolkit.parallel.pipeline): even, the embedding and/or the loss counted as a layer
(``embedding_in_split`` / ``loss_in_split``), or the first and last stage ``a`` and ``b``
layers fewer than the middle ones (``first_stage_layers`` = n - a, ``last_stage_layers`` =
n - b with n = (L + a + b) / pp). ``cpc``: megatron's context-parallel communication
(``cp_comm``, and ``cp_a2a`` for a2a+p2p).

Not tried (``skipped``; --explain counts them as the search's own families, not rule errors):
uneven splits and embedding/loss accounting when pp divides the layers (the even split is
tried), "a/b fewer" splits whose middle count n is not whole, and any cp communication but
p2p when cp = 1 (the same layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_FEWER = 3  # a, b in 0..3: the layers an edge stage gives up for its embedding / output layer and loss


@dataclass(frozen=True)
class Split:
    kind: str = "even"  # even | embedding | loss | embedding+loss | fewer
    first_fewer: int = 0
    last_fewer: int = 0
    num_layers: int = 0

    def fields(self, pp: int) -> dict[str, Any]:
        """spec.parallel fields of this split for pp stages."""
        emb, loss = self.kind in ("embedding", "embedding+loss"), self.kind in ("loss", "embedding+loss")
        first = last = None
        if self.kind == "fewer":
            n = (self.num_layers + self.first_fewer + self.last_fewer) // pp
            first = n - self.first_fewer if self.first_fewer else None
            last = n - self.last_fewer if self.last_fewer else None
        return {"first_stage_layers": first, "last_stage_layers": last, "embedding_in_split": emb,
                "loss_in_split": loss}

    def __str__(self) -> str:
        return f"{self.first_fewer}/{self.last_fewer} fewer" if self.kind == "fewer" else self.kind


@dataclass(frozen=True)
class CPComm:
    kind: str = "p2p"  # p2p | all_gather | a2a | a2a+p2p
    a2a: int | None = None  # a2a+p2p: the all-to-all level

    def fields(self) -> dict[str, Any]:
        return {"cp_comm": self.kind, "cp_a2a": self.a2a}

    def __str__(self) -> str:
        return f"{self.kind}({self.a2a})" if self.a2a else self.kind


SPLIT_FIELDS = ("first_stage_layers", "last_stage_layers", "embedding_in_split", "loss_in_split")
CP_FIELDS = ("cp_comm", "cp_a2a")


def split_choices(num_layers: int) -> tuple[Split, ...]:
    fewer = [Split("fewer", a, b, num_layers) for a in range(MAX_FEWER + 1) for b in range(MAX_FEWER + 1) if a or b]
    return (Split(num_layers=num_layers), Split("embedding", num_layers=num_layers),
            Split("loss", num_layers=num_layers), Split("embedding+loss", num_layers=num_layers), *fewer)


def cp_choices() -> tuple[CPComm, ...]:
    return (CPComm(), CPComm("all_gather"), CPComm("a2a"), *(CPComm("a2a+p2p", n) for n in (2, 4, 8)))


_P2P = CPComm()
SKIPPED_AXES = ("split", "cpc")  # the axes some of whose values skipped() sets aside


def skipped(axis: str, values: dict[str, Any]) -> str | None:
    """Why the search does not try this value of ``axis`` under the chosen ``values`` (None: it does)."""
    v = values[axis]
    if axis == "cpc" and values["cp"] == 1 and v != _P2P:
        return "cp=1: the context-parallel communication kind does not apply (the p2p layout is tried)"
    if axis != "split" or v.kind == "even":
        return None
    pp, layers = values["pp"], v.num_layers
    if pp == 1 or layers % pp == 0:
        return "pp divides num_layers: only the even split is tried"
    if v.kind == "fewer" and (layers + v.first_fewer + v.last_fewer) % pp:
        return f"num_layers + the first/last stage's fewer layers is not a multiple of pp={pp}"
    return None
