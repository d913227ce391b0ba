"""``toolkit plan --auto``: every layout of a model on a cluster, ranked by estimated step time.

Fixed: the model, cluster, sequence length, global batch, precision and every other spec
key. Searched (AXES), each over a domain that does not depend on the others:
  tp, pp, cp        every divisor of the world size
  split             even; embedding and/or loss counted as a layer; first/last stage 0-3 layers
                    fewer than the middle ones (tried only where pp does not divide num_layers;
                    choices.py)
  vpp               every divisor of num_layers, num_layers + 1, num_layers + 2, and 1..8
  cpc               cp communication: p2p, all_gather, a2a, a2a+p2p over 2/4/8 (cp > 1 only)
  sequence parallel off, on
  ep, etp           every divisor of the world size for MoE models (a dense model has no
                    experts: ep = 1, etp = tp)
  zero              stage 0-3 x optimizer offload x parameter offload (none, cpu; nvme
                    too when the spec gives zero.nvme_path)
  micro batch       every divisor of the global batch up to MAX_MICRO
  recompute         none, selective, full
Validity is decided by the spine's RULES only, run on partly chosen layouts (partial.py)
so that one failing rule rejects a whole family at once (which --explain lists). The
layouts that pass every rule get the memory and step-time estimates of make_plan, computed
from the same functions (toolkit.estimate's memory.py and time.py) with what depends only on
the parallel grid computed once per grid. Layouts whose worst pipeline stage fits in (1 - headroom) of GPU
memory (headroom: estimate.headroom if the spec sets it, else AUTO_HEADROOM = 5%) are
ranked by step time; a layout is not listed when a listed one of the same parallel grid
(or with the same step time, to 6 digits) is at least as fast and needs no more memory
(a variant made worse: more recompute, a smaller micro batch, ...); ``hidden`` counts them. Only the
fitting layouts that can be listed are timed: a lower bound of a layout's step time from its compute
alone (time.layer_floor, time.step_floor) leaves the others untimed (walk.py), and the counts,
hidden variants and faster_than come out as if every one were timed. Every returned candidate is rebuilt by
make_plan from a validated spec and must agree with the search (valid, fits, same
estimates); a disagreement is reported in ``mismatches`` and the layout is dropped.
"""
from __future__ import annotations

import math
import os
from bisect import bisect_left, insort
from operator import itemgetter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..estimate.memory import GiB
from ..models import ModelShape
from ..plan import Plan, make_plan, spec_shape
from ..spec import TrainingSpec
from .choices import CP_FIELDS, SPLIT_FIELDS, cp_choices, split_choices
from .partial import AXES, PARALLEL_FIELDS, ZERO_FIELDS, spec_overrides, zero_choices
from .walk import INNER_AXES, Walk, collect_rarely, grid_label, inner_label

SEARCHED_KEYS = tuple(f"parallel.{f}" for f in (*PARALLEL_FIELDS, *SPLIT_FIELDS, *CP_FIELDS)) + tuple(
    f"zero.{f}" for f in ZERO_FIELDS) + (
    "batch.micro", "recompute")  # the spec keys --auto chooses
MAX_MICRO = 32
MAX_SMALL_VPP = 8
AUTO_HEADROOM = 0.05
PARALLEL_LAYOUTS = 10**8  # smaller spaces take well under a second in one process
MAX_WORKERS = 8
SPARE = 8  # candidates ranked beyond ``top``, in case make_plan disagrees with one
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Family:
    """Layouts set aside for one reason: a rule's error, a rule's warning (kept), or memory."""

    kind: str  # "error" | "warning" | "memory" | "skipped" (not tried by the search: choices.py)
    rule: str  # rule name, or "memory"
    message: str
    layouts: int


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    hidden: int  # slower-or-equal variants needing no less memory (same grid or same step time), not shown

    def as_dict(self) -> dict:
        t = self.plan.time
        return {**self.plan.as_dict(), "step_time_s": t.step_time_s, "tokens_per_s": t.tokens_per_s,
                "mfu": t.mfu, "hidden_variants": self.hidden}


@dataclass(frozen=True)
class SearchResult:
    candidates: tuple[Candidate, ...]
    space: int  # layouts in the search space (product of the domains)
    valid: int  # layouts every rule accepts
    fitting: int  # valid layouts whose memory estimate fits with the headroom
    headroom: float
    families: tuple[Family, ...]  # most layouts first
    times: FittingTimes = field(repr=False, compare=False)
    mismatches: tuple[str, ...] = ()

    @property
    def fitting_times(self) -> tuple[float, ...]:
        """Step times of all fitting layouts, sorted (times the ones the search did not need)."""
        return self.times.below(math.inf)

    @property
    def rejected(self) -> int:
        """Layouts rejected by a rule or not tried (``skipped``)."""
        return self.space - self.valid

    @property
    def skipped(self) -> int:
        """Layouts the search does not try (choices.skipped): the same as one it tries, or not a split."""
        return sum(f.layouts for f in self.families if f.kind == "skipped")

    def faster_than(self, step_time_s: float) -> int:
        """How many fitting layouts are estimated faster than this step time."""
        below = step_time_s * (1 - 1e-9)
        return bisect_left(self.times.below(below), below)


class FittingTimes:
    """The step times of a walk's fitting layouts, sorted; the ones it did not time (Walk.pruned)
    are timed when a question needs them: below(x) times every one whose floor is under x."""

    def __init__(self, walk: Walk, untimed: list[tuple[float, int]]):
        self.untimed = sorted(untimed, reverse=True)  # largest floor first: pop() the smallest
        self.walk = walk if untimed else None  # (its caches are kept only while they can be needed)
        self.times = sorted(leaf[0] for leaf in walk.leaves if leaf[0] != math.inf)

    def below(self, x: float) -> tuple[float, ...]:
        """The sorted step times, complete under x (every fitting layout faster than x is in)."""
        walk, untimed = self.walk, self.untimed
        while untimed and untimed[-1][0] < x:
            _, k = untimed.pop()
            insort(self.times, walk.leaf_step(*walk.leaves[k][2:]))
        return tuple(self.times)


def domains(spec: TrainingSpec, shape: ModelShape) -> dict[str, tuple]:
    world = spec.cluster.world_size
    div = tuple(d for d in range(1, world + 1) if world % d == 0)
    moe = shape.moe is not None
    return {"tp": div, "sp": (False, True), "pp": div, "split": split_choices(shape.num_layers),
            "vpp": vpp_choices(shape.num_layers), "cp": div, "cpc": cp_choices(),
            "ep": div if moe else (1,), "etp": div if moe else (None,), "zero": zero_choices(spec.zero.nvme_path),
            "micro": tuple(d for d in _divisors(spec.batch.global_) if d <= MAX_MICRO), "recompute": RECOMPUTE}


def vpp_choices(num_layers: int) -> tuple[int, ...]:
    """Divisors of num_layers and of num_layers + 1, + 2 (embedding/loss counted as layers), and
    1..MAX_SMALL_VPP (the chunks of an uneven split's stages)."""
    n = num_layers
    return tuple(sorted({*_divisors(n), *_divisors(n + 1), *_divisors(n + 2), *range(1, min(n, MAX_SMALL_VPP) + 1)}))


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def search_headroom(spec: TrainingSpec) -> float:
    """The memory fraction --auto keeps free: estimate.headroom when the spec sets it, else
    AUTO_HEADROOM (the fastest layouts sit just under the limit, so the search keeps a margin
    that ``toolkit plan`` on a hand-written layout does not impose)."""
    return spec.estimate.headroom if "estimate.headroom" in spec.given_keys() else AUTO_HEADROOM


def search(spec: TrainingSpec, shape: ModelShape | None = None, *, top: int = 5, headroom: float | None = None,
           axes: dict[str, tuple] | None = None, progress: Callable[[int, int], None] | None = None,
           workers: int | None = None, prune: bool = True) -> SearchResult:
    """Rank every layout of ``spec``'s model, cluster and batch. ``headroom`` defaults to
    search_headroom(spec); ``axes`` replaces the domains of some axes (values as in AXES: zero
    takes spec Zero sections); ``progress(done, total)`` is called per pipeline-parallel size.
    ``workers``: processes walking the pipeline-parallel sizes (default: one per CPU, up to
    MAX_WORKERS, for spaces of at least PARALLEL_LAYOUTS layouts; the result is the same).
    ``prune``: leave untimed the fitting layouts that cannot be among the ``top`` (Walk's ``keep``;
    they are timed if a question needs them: SearchResult.faster_than, fitting_times); False times
    every fitting layout. The result is the same. The search proposes what the targets run: with
    ``zero.engine: fsdp`` (a planning input) it ranks DeepSpeed's layouts."""
    shape = spec_shape(spec, shape)
    h = search_headroom(spec) if headroom is None else headroom
    base = spec.with_overrides({"estimate.headroom": h, "zero.engine": "deepspeed"})
    unknown = set(axes or {}) - set(AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; axes are {AXES}")
    dom = {**domains(base, shape), **{a: tuple(v) for a, v in (axes or {}).items()}}
    walk = Walk(base, shape, dom, progress, keep=top + SPARE if prune else None)
    if workers is None:
        workers = min(os.cpu_count() or 1, MAX_WORKERS) if walk.size(AXES) >= PARALLEL_LAYOUTS else 1
    with collect_rarely():
        return _rank(walk.run(workers), top)




def _rank(walk: Walk, top: int) -> SearchResult:
    """Fitting layouts by step time; the first ``top`` shown ones rebuilt by make_plan. A layout
    is not shown (but counted in ``hidden``) when a shown, faster-or-equal layout of the same
    parallel grid or with the same step time needs no more memory: under the model it is the
    same choice made worse. The layouts the walk did not time (Walk.pruned) count by their grid
    and memory alone once the shown ones are found and each is slower than the last shown (not
    the same step time either); until then the ones that could be faster are timed."""
    untimed = walk.pruned
    while True:
        shown, by_grid = _shown(walk.leaves, top)
        last = shown[-1][0][0] * (1 + 2e-6) if len(shown) == top + SPARE else math.inf
        needed = [(floor, k) for floor, k in untimed if floor <= last]
        if not needed:
            break
        for _, k in needed:
            step, mem, gid, inner = walk.leaves[k]
            walk.leaves[k] = (walk.leaf_step(gid, inner), mem, gid, inner)
        untimed = [(floor, k) for floor, k in untimed if floor > last]
    for _, k in untimed:  # each slower than the last shown: hidden by its grid's shown one, or not listed
        _, mem, gid, _ = walk.leaves[k]
        if gid in by_grid and mem >= by_grid[gid][0][1]:
            by_grid[gid][1] += 1
    candidates, mismatches = [], []
    for leaf, hidden in shown:
        if len(candidates) == top:
            break
        plan, problem = _rebuild(walk, leaf)
        if problem:
            mismatches.append(problem)
        else:
            candidates.append(Candidate(plan, hidden))
    return SearchResult(tuple(candidates), walk.size(AXES), walk.valid, len(walk.leaves), walk.base.estimate.headroom,
                        _families(walk), FittingTimes(walk, untimed), tuple(mismatches))


def _shown(leaves: list[tuple], top: int) -> tuple[list[list], dict[int, list]]:
    """The listed layouts ([leaf, hidden count]; up to top + SPARE) among the timed ``leaves``, in
    step-time order (ties: memory, then the walk's order), and each grid's shown entry needing least
    memory. An untimed leaf (step inf) sorts last and is not looked at."""
    shown: list[list] = []
    by_grid: dict[int, list] = {}
    for leaf in sorted(leaves, key=itemgetter(0, 1)):
        step, mem, gid, _ = leaf
        if step == math.inf:
            break
        same_time = shown and math.isclose(step, shown[-1][0][0], rel_tol=1e-6) and mem >= shown[-1][0][1]
        owner = shown[-1] if same_time else by_grid.get(gid) if gid in by_grid and mem >= by_grid[gid][0][1] else None
        if owner is not None:
            owner[1] += 1
        elif len(shown) < top + SPARE:
            shown.append([leaf, 0])
            by_grid[gid] = shown[-1]
    return shown, by_grid


def _families(walk: Walk) -> tuple[Family, ...]:
    fams = [Family(kind, rule, msg, n) for (kind, rule, msg), n in walk.families.items()]
    usable = walk.limit / GiB
    fams += [Family("memory", "memory", f"{key}: needs at least {mem / GiB:.1f} GiB per GPU ({example}) > "
                    f"{usable:.1f} GiB usable", n) for key, (n, mem, example) in walk.memory.items()]
    return tuple(sorted(fams, key=lambda f: (-f.layouts, f.kind, f.message)))


def _rebuild(walk: Walk, leaf: tuple) -> tuple[Plan | None, str | None]:
    """The plan make_plan gives for a search leaf, or why it disagrees with the search."""
    step, mem, gid, inner = leaf
    values = {**walk.grids[gid], **dict(zip(INNER_AXES, inner))}
    plan = make_plan(walk.base.with_overrides(spec_overrides(values)), walk.shape)
    label = f"{grid_label(values, walk.shape)} {inner_label(inner)}"
    if not plan.valid:
        return None, f"{label}: make_plan rejects it: {'; '.join(plan.errors)}"
    if not (math.isclose(plan.time.step_time_s, step, rel_tol=1e-9)
            and math.isclose(plan.memory.worst.total, mem, rel_tol=1e-9)):
        return None, (f"{label}: search estimated {step:.4g} s / {mem / GiB:.2f} GiB, make_plan "
                      f"{plan.time.step_time_s:.4g} s / {plan.memory.worst.total / GiB:.2f} GiB")
    return plan, None
