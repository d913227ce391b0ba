"""``toolkit plan --auto``: every layout of a model on a cluster, ranked by estimated step time.

Fixed: the model, cluster, sequence length, global batch, precision and every other spec
key. Searched (AXES), each over a domain that does not depend on the others:
  tp, pp, cp        every divisor of the world size
  vpp               every divisor of num_layers
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
from the same functions (memory.py, cost.py) with what depends only on the parallel grid
computed once per grid. Layouts whose worst pipeline stage fits in (1 - headroom) of GPU
memory (headroom: estimate.headroom if the spec sets it, else AUTO_HEADROOM = 5%) are
ranked by step time; layouts with the same step time (to 6 digits) are
collapsed into the one needing least memory. Every returned candidate is rebuilt by
make_plan from a validated spec and must agree with the search (valid, fits, same
estimates); a disagreement is reported in ``mismatches`` and the layout is dropped.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..hardware import get_gpu
from ..models import ModelShape, load_model
from ..spec import TrainingSpec
from . import Plan, make_plan
from .cost import bubble_fraction, compute_seconds, data_comm, parallel_comm, step_flops, step_seconds
from .layout import derive_batch, derive_layout
from .memory import (GiB, StageMemory, activation_bytes, activation_settings, buffer_bytes, in_flight,
                     micro_batch_tokens, stage_activations, stage_params, stage_states, usable_bytes)
from .partial import (AXES, PARALLEL_FIELDS, ZERO_FIELDS, Choice, Verdict, build_spec, judge, partial_context,
                      spec_overrides, zero_choices)
from .rules import RULES

SEARCHED_KEYS = tuple(f"parallel.{f}" for f in PARALLEL_FIELDS) + tuple(f"zero.{f}" for f in ZERO_FIELDS) + (
    "batch.micro", "recompute")  # the spec keys --auto chooses
GRID_AXES = AXES[:7]  # tp sp pp vpp cp ep etp: decided one after another, depth first
INNER_AXES = AXES[7:]  # zero micro recompute: each checked against a grid on its own
MAX_MICRO = 32
AUTO_HEADROOM = 0.05
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Family:
    """Layouts set aside for one reason: a rule's error, a rule's warning (kept), or memory."""

    kind: str  # "error" | "warning" | "memory"
    rule: str  # rule name, or "memory"
    message: str
    layouts: int


@dataclass
class _Inner:
    """What the rules say about one value of an inner axis (zero, micro, recompute) under a prefix."""

    error: tuple[str, str] | None
    warnings: list
    pending: list


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    ties: int  # layouts with the same estimated step time that need more memory

    def as_dict(self) -> dict:
        t = self.plan.time
        return {**self.plan.as_dict(), "step_time_s": t.step_time_s, "tokens_per_s": t.tokens_per_s,
                "mfu": t.mfu, "ties": self.ties}


@dataclass(frozen=True)
class SearchResult:
    candidates: tuple[Candidate, ...]
    space: int  # layouts in the search space (product of the domains)
    valid: int  # layouts every rule accepts
    fitting: int  # valid layouts whose memory estimate fits with the headroom
    headroom: float
    families: tuple[Family, ...]  # most layouts first
    fitting_times: tuple[float, ...] = field(repr=False)  # step times of all fitting layouts, sorted
    mismatches: tuple[str, ...] = ()

    @property
    def rejected(self) -> int:
        return self.space - self.valid

    def faster_than(self, step_time_s: float) -> int:
        """How many fitting layouts are estimated faster than this step time."""
        return bisect_left(self.fitting_times, step_time_s * (1 - 1e-9))


def domains(spec: TrainingSpec, shape: ModelShape) -> dict[str, tuple]:
    world = spec.cluster.world_size
    div = tuple(d for d in range(1, world + 1) if world % d == 0)
    moe = shape.moe is not None
    return {"tp": div, "sp": (False, True), "pp": div, "vpp": _divisors(shape.num_layers), "cp": div,
            "ep": div if moe else (1,), "etp": div if moe else (None,), "zero": zero_choices(spec.zero.nvme_path),
            "micro": tuple(d for d in _divisors(spec.batch.global_) if d <= MAX_MICRO), "recompute": RECOMPUTE}


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def search_headroom(spec: TrainingSpec) -> float:
    """The memory fraction --auto keeps free: estimate.headroom when the spec sets it, else
    AUTO_HEADROOM (the fastest layouts sit just under the limit, so the search keeps a margin
    that ``toolkit plan`` on a hand-written layout does not impose)."""
    return spec.estimate.headroom if "estimate.headroom" in spec.given_keys() else AUTO_HEADROOM


def search(spec: TrainingSpec, shape: ModelShape | None = None, *, top: int = 5, headroom: float | None = None,
           axes: dict[str, tuple] | None = None, progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Rank every layout of ``spec``'s model, cluster and batch. ``headroom`` defaults to
    search_headroom(spec); ``axes`` replaces the domains of some axes (values as in AXES: zero
    takes spec Zero sections); ``progress(done, total)`` is called per tensor-parallel size."""
    shape = shape or load_model(spec.model)
    h = search_headroom(spec) if headroom is None else headroom
    return _Search(spec.with_overrides({"estimate.headroom": h}), shape, axes or {}, progress).run(top)


class _Search:
    def __init__(self, base: TrainingSpec, shape: ModelShape, axes: dict[str, tuple],
                 progress: Callable[[int, int], None] | None):
        self.base, self.shape, self.gpu, self.progress = base, shape, get_gpu(base.cluster.gpu), progress
        unknown = set(axes) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; axes are {AXES}")
        self.dom = {**domains(base, shape), **{a: tuple(v) for a, v in axes.items()}}
        self.placeholders = {a: d[0] for a, d in self.dom.items()}
        self.families: Counter[tuple[str, str, str]] = Counter()
        self.limit = usable_bytes(self.gpu.memory_gib, base.estimate.headroom)
        self.leaves: list[tuple[float, float, int, tuple]] = []  # fitting: (step, memory, grid, inner values)
        self.grids: list[dict[str, Any]] = []
        self.valid = 0
        self.batches: dict[tuple, Any] = {}
        self.memory: dict[str, tuple[int, float, str]] = {}  # grids where nothing fits: layouts, least bytes, example
        self.flops = {r: step_flops(shape, _any_batch(base, shape), r)[1] for r in RECOMPUTE}
        self.buffers = {id(z): buffer_bytes(build_spec(base, {"zero": z}), shape) for z in self.dom["zero"]}

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(len(self.dom[a]) for a in axes)

    def context(self, values: dict[str, Any]):
        return partial_context(self.base, self.shape, self.gpu, Choice(values), self.placeholders)

    # ------------------------------------------------------------------ rules, grid by grid
    def run(self, top: int) -> SearchResult:
        table = {a: {v: _Inner(None, [], list(RULES)) for v in self.dom[a]} for a in INNER_AXES}
        for values, pending, warnings, inner in self.descend(0, {}, list(RULES), [], table):
            self.grid(values, pending, warnings, inner)
        return self.result(top)

    def descend(self, level: int, values: dict, pending: list, warnings: list, inner: dict) -> Iterator[tuple]:
        """Depth first over GRID_AXES; a rule error rejects the family below. ``inner`` carries,
        for every value of every inner axis, what the rules say with only that inner axis chosen."""
        if level == len(GRID_AXES):
            yield values, pending, warnings, inner
            return
        axis, below = GRID_AXES[level], self.size(GRID_AXES[level + 1:] + INNER_AXES)
        for i, v in enumerate(self.dom[axis]):
            chosen = {**values, axis: v}
            verdict = judge(pending, self.context(chosen)[0])
            if verdict.error:
                self.families[("error", *verdict.error)] += below
            else:
                yield from self.descend(level + 1, chosen, verdict.pending, warnings + verdict.warnings,
                                        self.refine(inner, chosen, verdict))
            if level == 0 and self.progress:
                self.progress(i + 1, len(self.dom[axis]))

    def refine(self, inner: dict, chosen: dict, grid: Verdict) -> dict:
        """Re-judge, for each inner-axis value, the rules still open for it under the longer prefix.
        A rule the grid prefix decides alone is dropped (its verdict is the grid's); so is a rule
        that one inner axis decides for all of its accepted values. A rule the grid prefix left
        blocked on a value that choosing this inner axis does not reveal is not re-run: it would
        read the same values up to the same hidden one."""
        out: dict[str, dict] = {}
        for axis, states in inner.items():
            out[axis] = {}
            for v, st in states.items():
                keep = [r for r in st.pending if r in grid.blocked] if st.error is None else []
                rules = [r for r in keep if grid.blocked[r] <= {axis}]
                if not rules:
                    out[axis][v] = _Inner(st.error, st.warnings, keep)
                    continue
                verdict = judge(rules, self.context({**chosen, axis: v})[0])
                still = [r for r in keep if r not in rules or r in verdict.blocked]
                out[axis][v] = _Inner(verdict.error, st.warnings + verdict.warnings, still)
        open_rules = {r for states in out.values() for st in states.values() for r in st.pending}
        decided = {r for r in open_rules if any(all(r not in st.pending for st in states.values() if st.error is None)
                                                for states in out.values())}
        for states in out.values() if decided else ():
            for st in states.values():
                st.pending = [r for r in st.pending if r not in decided]
        return out

    def grid(self, values: dict, pending: list, warnings: list, inner: dict) -> None:
        ok = {a: [v for v, st in inner[a].items() if st.error is None] for a in INNER_AXES}
        for i, axis in enumerate(INNER_AXES):  # a rejected value stands for the leaves not counted before it
            covered = math.prod(len(ok[a]) for a in INNER_AXES[:i]) * self.size(INNER_AXES[i + 1:])
            for st in inner[axis].values():
                if st.error is not None:
                    self.families[("error", *st.error)] += covered
        if not all(ok.values()):
            return
        leftover = list({r for states in inner.values() for st in states.values() for r in st.pending})
        layout = derive_layout(build_spec(self.base, {**self.placeholders, **values}), self.shape)
        gid = len(self.grids)
        self.grids.append(values)
        n_valid = n_fit = 0
        smallest: tuple[float, tuple] | None = None
        per_leaf_warnings = any(inner[a][v].warnings for a in INNER_AXES for v in ok[a])
        for leaf, step, mem in self.leaves_of(values, layout, ok):
            if leftover and self.leaf_rejected(values, leaf, leftover):
                continue
            n_valid += 1
            if per_leaf_warnings:
                for w in [w for a, v in zip(INNER_AXES, leaf) for w in inner[a][v].warnings]:
                    self.families[("warning", *w)] += 1
            if mem <= self.limit:
                n_fit += 1
                self.leaves.append((step, mem, gid, leaf))
            elif smallest is None or mem < smallest[0]:
                smallest = (mem, leaf)
        for w in warnings:
            self.families[("warning", *w)] += n_valid
        self.valid += n_valid
        if n_fit == 0 and smallest is not None:
            self.memory_family(values, smallest, n_valid)
        elif n_fit < n_valid:
            self.families[("memory", "memory", "variants (ZeRO, micro batch, recompute) of layouts that fit "
                           "otherwise, needing more memory")] += n_valid - n_fit

    def batch(self, values: dict, micro: int, layout):
        """BatchPlan of a grid and micro batch; its fields depend on micro, tp, pp, cp only."""
        key = (micro,) + tuple(values[a] for a in ("tp", "pp", "cp"))
        if key not in self.batches:
            self.batches[key] = derive_batch(build_spec(self.base, {**self.placeholders, **values, "micro": micro}),
                                             layout)
        return self.batches[key]

    def leaf_rejected(self, grid: dict, inner: tuple, rules: list) -> bool:
        verdict = judge(rules, self.context({**grid, **dict(zip(INNER_AXES, inner))})[0])
        if verdict.error:
            self.families[("error", *verdict.error)] += 1
        return verdict.error is not None

    # ------------------------------------------------------------------ memory and time
    def leaves_of(self, values: dict, layout, ok: dict[str, list]) -> Iterator[tuple[tuple, float, float]]:
        """(inner values, step seconds, worst-stage bytes) of every rule-valid inner choice."""
        base, shape, gpu = self.base, self.shape, self.gpu
        est, prec = base.estimate, base.precision
        params = [stage_params(shape, layout, k) for k in range(layout.pp)]
        zeros = ok["zero"]
        fixed = np.array([[StageMemory(k, *stage_states(p, layout, z, prec)[:3], 0.0, self.buffers[id(z)], 0.0).total
                           for k, p in enumerate(params)] for z in zeros])  # (zero, stage) bytes without activations
        acts = {r: [stage_activations(shape, layout, k, seq=base.batch.seq_len, recompute=r,
                                      **activation_settings(base)) for k in range(layout.pp)]
                for r in ok["recompute"]}
        compute = {r: compute_seconds(self.flops[r], layout.world, gpu, prec, est.compute_efficiency)
                   for r in ok["recompute"]}
        for m in ok["micro"]:
            batch = self.batch(values, m, layout)
            tokens = micro_batch_tokens(layout, batch)
            flight = [in_flight(layout, k, batch.grad_accum) for k in range(layout.pp)]
            bubble = bubble_fraction(layout, batch.grad_accum)
            data = [data_comm(layout, batch, gpu, params[0], precision=prec, overlap=est.comm_overlap, zero=z)
                    for z in zeros]
            for r in ok["recompute"]:
                par = parallel_comm(shape, layout, batch, gpu, precision=prec, overlap=est.comm_overlap, recompute=r)
                act = np.array([activation_bytes(a, tokens, f) for a, f in zip(acts[r], flight)])
                worst = (fixed + act).max(axis=1).tolist()  # the same float sums, the worst stage per ZeRO choice
                for z, d, mem in zip(zeros, data, worst):
                    yield (z, m, r), step_seconds(compute[r], bubble, {**par, **d}), mem

    def memory_family(self, values: dict, smallest: tuple[float, tuple], layouts: int) -> None:
        """Grids where nothing fits, grouped by tp/pp/cp (and ep/etp) with their smallest need."""
        key = grid_label({a: values[a] for a in ("tp", "pp", "cp", "ep", "etp")}, self.shape)
        count, mem, example = self.memory.get(key, (0, math.inf, ""))
        if smallest[0] < mem:
            mem, example = smallest[0], inner_label(smallest[1])
        self.memory[key] = (count + layouts, mem, example)

    # ------------------------------------------------------------------ ranking
    def result(self, top: int) -> SearchResult:
        self.leaves.sort(key=lambda leaf: (leaf[0], leaf[1]))
        groups: list[list] = []
        for leaf in self.leaves:
            if groups and math.isclose(leaf[0], groups[-1][0][0], rel_tol=1e-6):
                groups[-1].append(leaf)
            elif len(groups) < top + 8:  # a few spare in case make_plan disagrees
                groups.append([leaf])
            else:
                break
        candidates, mismatches = [], []
        for g in groups:
            leaf = min(g, key=lambda x: x[1])
            plan, problem = self.rebuild(leaf)
            if problem:
                mismatches.append(problem)
            elif len(candidates) < top:
                candidates.append(Candidate(plan, len(g) - 1))
        fams = [Family(kind, rule, msg, n) for (kind, rule, msg), n in self.families.items()]
        limit = self.limit / GiB
        fams += [Family("memory", "memory", f"{key}: needs at least {mem / GiB:.1f} GiB per GPU ({ex}) > "
                        f"{limit:.1f} GiB usable", n) for key, (n, mem, ex) in self.memory.items()]
        fams.sort(key=lambda f: (-f.layouts, f.kind, f.message))
        return SearchResult(tuple(candidates), self.size(AXES), self.valid, len(self.leaves),
                            self.base.estimate.headroom, tuple(fams), tuple(x[0] for x in self.leaves),
                            tuple(mismatches))

    def rebuild(self, leaf: tuple) -> tuple[Plan | None, str | None]:
        """The plan make_plan gives for a search leaf, or why it disagrees with the search."""
        step, mem, gid, inner = leaf
        values = {**self.grids[gid], **dict(zip(INNER_AXES, inner))}
        plan = make_plan(self.base.with_overrides(spec_overrides(values)), self.shape)
        label = f"{grid_label(values, self.shape)} {inner_label(inner)}"
        if not plan.valid:
            return None, f"{label}: make_plan rejects it: {'; '.join(plan.errors)}"
        if not plan.memory.fits(self.base.estimate.headroom):
            return None, f"{label}: make_plan says it does not fit"
        if not (math.isclose(plan.time.step_time_s, step, rel_tol=1e-9)
                and math.isclose(plan.memory.worst.total, mem, rel_tol=1e-9)):
            return None, (f"{label}: search estimated {step:.4g} s / {mem / GiB:.2f} GiB, make_plan "
                          f"{plan.time.step_time_s:.4g} s / {plan.memory.worst.total / GiB:.2f} GiB")
        return plan, None


def _any_batch(spec: TrainingSpec, shape: ModelShape):
    """A batch plan of the spec: step FLOPs depend on the global batch and sequence only."""
    return derive_batch(spec, derive_layout(spec, shape))


def grid_label(values: dict, shape: ModelShape) -> str:
    keys = ("tp", "sp", "pp", "vpp", "cp") + (("ep", "etp") if shape.moe is not None else ())
    return " ".join(f"{k}={_short(values[k])}" for k in keys if k in values)


def inner_label(inner: tuple) -> str:
    z, m, r = inner
    off = "".join(f" +{kind} offload to {dev}" for kind, dev in (("optimizer", z.offload_optimizer),
                                                                   ("param", z.offload_param)) if dev != "none")
    return f"ZeRO-{z.stage}{off}, micro {m}, recompute {r}"


def _short(v: Any) -> str:
    return {True: "on", False: "off", None: "tp"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)
