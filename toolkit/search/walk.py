"""The search's walk: the spine's rules grid by grid, then memory and time per grid.

Grid axes (GRID_AXES) are chosen depth first; at each prefix the still-open rules run on a
partial context (partial.py) and an error rejects the whole family below it. A rule is run
again only when an axis it waited for is chosen, and its outcome is kept by the values of the
axes it read (partial.Verdicts), so the same question is not asked twice. The inner axes
(cp communication, zero, micro, recompute) ride along: for each of their values the walk
keeps what the rules say with only that inner value added, deciding it at the shortest prefix
that can. At each valid grid the memory of every inner choice comes from the functions
make_plan uses (toolkit.estimate.memory), as arrays, and the step time (toolkit.estimate.time)
of the ones that fit, with what depends on the grid alone computed once, and what a pipeline
stage does once per stage signature (memory.stage_signatures: stages with the same layers and edges); the cp
communication changes the step time only. The pipeline axes come first (pp, split, vpp):
their rules reject a family before it is multiplied by the other sizes. With several
workers, forked processes walk the pipeline-parallel sizes (Walk.run).
Values the search does not try (choices.skipped) are counted as "skipped" families.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import gc
import heapq
import itertools
import math
import multiprocessing as mp
import operator
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from ..backends.deepspeed import bucket_sizes
from ..estimate.compute import model_dims
from ..estimate.data_time import buckets, dp_seconds, offload_seconds, optimizer_seconds, stage_comms
from ..estimate.lora import model_states, spec_adapter_params
from ..estimate.memory import (
    StageMemory,
    buffer_bytes,
    causal_mask_bytes,
    fp8_weight_bytes,
    grad_copy,
    grad_reduce_bytes,
    hf_modules,
    in_flight,
    layer_kind_keys,
    micro_batch_tokens,
    signature_slots,
    stage_activation_settings,
    stage_activations,
    stage_params,
    stage_signatures,
    usable_bytes,
)
from ..estimate.time import (a2a_overlap_shares, layer_floor, pipeline_seconds, signature_works, spec_setting,
                             stage_work, step_floor, times_of)
from ..hardware import get_gpu
from ..kernels import spec_kernels
from ..models import ModelShape
from ..parallel.layout import LAYER_FIELDS, derive_batch
from ..plan.rules import RULES
from ..spec import TrainingSpec
from .choices import SKIPPED_AXES, CPComm, Split, skipped
from .partial import (AXES, BATCH_FIELD_AXES, Choice, Verdict, Verdicts, build_spec, judge_values, partial_context,
                      spec_layout, values_layout)

GRID_AXES = AXES[:8]  # pp split vpp tp cp sp ep etp: decided one after another, depth first
INNER_AXES = AXES[8:]  # cpc zero micro recompute: each checked against a grid on its own
BATCH_AXES = tuple(sorted(set().union(*BATCH_FIELD_AXES.values())))  # all a BatchPlan depends on
GC_THRESHOLDS = (20_000, 50, 100)  # the garbage collector's during a walk (collect_rarely)
_GRID_BATCH_AXES = tuple(a for a in BATCH_AXES if a != "micro")
_TOTAL = attrgetter("total")
_PENDING = attrgetter("pending")


@dataclass
class _Inner:
    """What the rules say about one value of an inner axis (zero, micro, recompute) under a prefix."""

    error: tuple[str, str] | None
    warnings: list
    pending: int  # rules still open for this value, as _RuleBits (none once it is rejected)
    blocked: dict = field(default_factory=dict)  # pending rule -> axes it waited for with this value chosen


class _RuleBits:
    """Sets of rules as the bits of an int (bit i: rules[i]): refine intersects and unites the inner
    values' open rules ~10^5 times a search. rules_of lists a set in the rules' order."""

    def __init__(self, rules: list):
        self.rules = tuple(rules)
        self.bit = {r: 1 << i for i, r in enumerate(self.rules)}

    def of(self, rules) -> int:
        """The set of ``rules`` (distinct)."""
        return sum(map(self.bit.__getitem__, rules))

    def rules_of(self, mask: int) -> list:
        out = []
        while mask:
            low = mask & -mask
            out.append(self.rules[low.bit_length() - 1])
            mask ^= low
        return out


class Walk:
    """One search's walk; its results are ``families``, ``memory``, ``leaves``, ``pruned``, ``grids``, ``valid``.

    The fitting layouts are timed after the rules walk, in groups (a grid, cp communication, micro
    batch and recompute choice: the ZeRO choices that fit), the group with the lowest floor first
    (time.layer_floor: a lower bound of their step times from one layer's compute; then, before a
    group is timed, time.step_floor's tighter one from its stages' compute). ``keep``:
    how many listed layouts the ranking needs (search._rank: the shown ones and their spares), or
    None (every fitting layout timed). With it, the groups whose floor is above the cut-off
    (``cutoff``: a little above the keep-th fastest of the grids' fastest layouts timed so far)
    are not timed: their layouts stay in ``leaves`` with step time inf, and ``pruned`` holds (floor,
    index in leaves) for each; ``leaf_step`` times one when the ranking finds it needs it
    (search._rank checks that every untimed layout is slower than the last one it lists)."""

    def __init__(self, base: TrainingSpec, shape: ModelShape, dom: dict[str, tuple],
                 progress: Callable[[int, int], None] | None, order: tuple[str, ...] | None = None,
                 keep: int | None = None):
        self.base, self.shape, self.gpu, self.progress = base, shape, get_gpu(base.cluster.gpu), progress
        self.dom = dom
        # an axis with one value is chosen first: it splits no family, and every level costs a judge
        # (a part of a walk keeps the whole walk's order: the rules then see the same prefixes)
        self.order = order or tuple(sorted(GRID_AXES, key=lambda a: len(dom[a]) > 1))
        self.placeholders = {a: d[0] for a, d in self.dom.items()}
        self.families: Counter[tuple[str, str, str]] = Counter()
        self.limit = usable_bytes(self.gpu.memory_gib, base.estimate.headroom)
        self.leaves: list[tuple[float, float, int, tuple]] = []  # fitting: (step, memory, grid, inner values)
        self.pruned: list[tuple[float, int]] = []  # fitting, not timed: (step floor, index in leaves)
        self.keep, self.bests, self.cut = keep, {}, math.inf  # bests: each timed grid's fastest step
        self.groups: list[tuple] = []  # fitting layouts to time: (floor, layouts, first index in leaves,
        # _GridTimings, cp communication, batch, recompute)
        self.shared_cut = None  # with forked workers: the smallest cut-off any of them found (a shared double)
        self.timings: dict = {}  # leaf_step's _GridTimings per grid
        self.inners: dict[tuple, tuple] = {}  # the leaves' inner values (inner())
        self.floors: dict[tuple, float] = {}  # layer_floor()'s
        self.sig_keys: dict[tuple, int] = {}  # signature_key()'s
        self.after = [self.size(INNER_AXES[i + 1:]) for i in range(len(INNER_AXES))]  # (tried())
        self.grids: list[dict[str, Any]] = []
        self.valid = 0
        self.batches: dict[tuple, Any] = {}
        self.cache: dict[tuple, Any] = {}
        self.known = Verdicts(dom)
        self.bits = _RuleBits(RULES)  # the inner values' open rules (_Inner.pending)
        self.micro_specs: dict[int, TrainingSpec] = {}  # per-stage pieces grids share (leaves_of)
        self.memory: dict[str, tuple[int, float, str]] = {}  # grids where nothing fits: layouts, least bytes, example
        self.flash = spec_kernels(base).attention == "flash"
        self.dims = model_dims(shape)
        self.grad_copy, self.grad_bytes = grad_copy(base), grad_reduce_bytes(base)  # the search keeps these
        self.bucket_sizes = bucket_sizes(base, shape)  # and the DeepSpeed config's bucket sizes
        self.buffers = {id(z): buffer_bytes(build_spec(base, {"zero": z}), shape) for z in self.dom["zero"]}
        self.settings: dict = {}  # spec_setting per Layout.for_layers() fields (setting())
        self.kinds = tuple(set(layer_kind_keys(shape)))  # the model's layer kinds (time.layer_floor)

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(len(self.dom[a]) for a in axes)

    def context(self, values: dict[str, Any], seen: set | None = None):
        return partial_context(self.base, self.shape, self.gpu, Choice(values), self.placeholders, seen)

    def judge(self, rules: list, values: dict[str, Any], ids: tuple | None = None) -> Verdict:
        """The rules on a partial choice, each run only where its findings are not known already
        (``ids``: self.known.ids(values), when the caller has it)."""
        return judge_values(rules, values, lambda seen: self.context(values, seen)[0], self.known, ids)

    # ------------------------------------------------------------------ rules, grid by grid
    def run(self, workers: int = 1) -> Walk:
        """Walk every layout; with ``workers`` > 1 (where processes can fork), forked processes
        walk the values of the first axis with several (pp), merged in the one-process order:
        the result is the same."""
        if workers > 1 and "fork" in mp.get_all_start_methods() and self.size(GRID_AXES) > 1:
            return self._run_forked(workers)
        every = self.bits.of(RULES)
        table = {a: {v: _Inner(None, [], every) for v in self.dom[a]} for a in INNER_AXES}
        for values, pending, warnings, inner in self.descend(0, {}, dict.fromkeys(RULES), [], table):
            self.grid(values, pending, warnings, inner)
        self.time_groups()
        return self

    def time_groups(self) -> None:
        """Time the fitting layouts' groups, lowest floor first, until the floor passes the cut-off
        (never with ``keep`` None): the rest are ``pruned``."""
        leaves, groups = self.leaves, sorted(self.groups, key=itemgetter(0))
        self.groups = []
        left = Counter(map(id, map(itemgetter(3), groups)))  # groups not yet timed or pruned, per grid
        for g, (floor, n, start, grid, c, batch, r) in enumerate(groups):
            cut = self.cutoff()
            if floor > cut:
                self.pruned += [(f, start + i) for f, n, start, *_ in groups[g:] for i in range(n)]
                return
            timing = grid.timing(c)
            left[id(grid)] -= 1
            if not left[id(grid)]:  # its last group: its timings' caches are not needed after this one
                grid.release()
            if self.keep:
                floor = timing.floor(batch, r)
                if floor > cut:
                    self.pruned += [(floor, start + i) for i in range(n)]
                    continue
            inner = [leaves[k][3] for k in range(start, start + n)]
            steps = timing.steps([z for _, z, _, _ in inner], batch, r)
            timing.forget(batch, r)  # (no other group has this timing, micro batch and recompute)
            gid = leaves[start][2]
            for k, step, leaf in zip(range(start, start + n), steps, inner):
                leaves[k] = (step, leaves[k][1], gid, leaf)
            best = min(steps)
            if best < self.bests.get(gid, math.inf):
                self.bests[gid] = best
                if self.keep and len(self.bests) >= self.keep and best < self.cut:
                    self.cut = heapq.nsmallest(self.keep, self.bests.values())[-1] * (1 + 4e-6)

    def _run_forked(self, workers: int) -> Walk:
        global _FORKED
        axes = [a for a in self.order if len(self.dom[a]) > 1][:1]  # (cells of one value: a worker fills the
        # caches of that value alone; finer cells made both workers fill them)
        cells = list(itertools.product(*(range(len(self.dom[a])) for a in axes)))
        parts: dict[tuple, dict] = {}  # arrived, not merged yet: the cells are merged in their order
        merged = 0
        left, done = Counter(c[0] for c in cells), 0  # progress: per value of the first axis (pp)
        _FORKED = (self, axes)  # what the forked workers read (inherited memory: nothing is pickled to them)
        self.shared_cut = mp.get_context("fork").RawValue("d", math.inf) if self.keep else None
        try:
            with _signals_deferred() as received, \
                    mp.get_context("fork").Pool(min(workers, len(cells)), initializer=_worker_signals) as pool:
                for cell, part in _until_signal(pool.imap_unordered(_walk_cell, cells), received):
                    parts[cell] = part
                    while merged < len(cells) and cells[merged] in parts:  # (a merged part is freed)
                        self._merge(parts.pop(cells[merged]))
                        merged += 1
                    left[cell[0]] -= 1
                    if not left[cell[0]]:
                        done += 1
                        if self.progress:
                            self.progress(done, len(self.dom[axes[0]]))
        finally:
            _FORKED = None
        return self

    def part(self, dom: dict[str, tuple]) -> Walk:
        """A walk of a sub-domain in the same order, sharing this walk's caches (not its results)."""
        part = copy.copy(self)
        part.dom, part.progress = dom, None
        part.families, part.memory, part.leaves, part.grids, part.valid = Counter(), {}, [], [], 0
        part.pruned, part.bests, part.cut, part.groups, part.timings = [], {}, math.inf, [], {}
        return part

    def _export(self) -> dict:
        """This walk's results with inner values as domain indices, one tuple per distinct choice
        (cheap to send between processes: pickle sends a shared tuple once). The walk is done: its
        leaves are replaced in place (the list is not copied)."""
        index = {a: {id(v): k for k, v in enumerate(self.dom[a])} for a in ("cpc", "zero")}
        codes: dict[int, tuple] = {}  # id(inner values) (the walk's shared tuples) -> their indices
        leaves, self.leaves = self.leaves, []
        for n, (step, mem, gid, inner) in enumerate(leaves):
            code = codes.get(id(inner))
            if code is None:
                c, z, m, r = inner
                code = codes[id(inner)] = (index["cpc"][id(c)], index["zero"][id(z)], m, r)
            leaves[n] = (step, mem, gid, code)
        return {"families": self.families, "memory": self.memory, "grids": self.grids, "valid": self.valid,
                "leaves": leaves, "pruned": self.pruned}

    def _merge(self, part: dict) -> None:
        """Append a part's results (_export's) in place of its indices: the walk's shared inner-values
        tuples, one int per grid, one inf (each leaf would otherwise keep objects of its own)."""
        cpc, zero, inf = self.dom["cpc"], self.dom["zero"], math.inf
        inners: dict[tuple, tuple] = {}  # indices -> inner values
        gids = list(range(len(self.grids), len(self.grids) + len(part["grids"])))
        ks = range(len(self.leaves), len(self.leaves) + len(part["leaves"]))
        self.pruned += [(floor, ks[k]) for floor, k in part["pruned"]]
        leaves = part["leaves"]
        for n, (step, mem, gid, code) in enumerate(leaves):
            inner = inners.get(code)
            if inner is None:
                c, z, m, r = code
                inner = inners[code] = self.inner(cpc[c], zero[z], m, r)
            leaves[n] = (inf if step == inf else step, mem, gids[gid], inner)
        self.leaves += leaves
        self.grids += part["grids"]
        self.families.update(part["families"])
        self.valid += part["valid"]
        for key, (count, mem, example) in part["memory"].items():
            have = self.memory.get(key, (0, math.inf, ""))
            self.memory[key] = (have[0] + count, *min((have[1], have[2]), (mem, example), key=lambda x: x[0]))

    def descend(self, level: int, values: dict, pending: dict, warnings: list, inner: dict) -> Iterator[tuple]:
        """Depth first over GRID_AXES; a rule error rejects the family below. ``pending`` maps each
        open rule to the unchosen axes it was blocked on (None: not run yet); a rule is run again
        only when the axis just chosen is one of them: otherwise it would read the same values up
        to the same hidden one. ``inner`` carries, for every value of every inner axis, what the
        rules say with only that inner axis chosen."""
        if level == len(self.order):
            yield values, pending, warnings, inner
            return
        axis, below = self.order[level], self.size(self.order[level + 1:] + INNER_AXES)
        for i, v in enumerate(self.dom[axis]):
            chosen = {**values, axis: v}
            why = skipped(axis, chosen)
            if why:
                self.families[("skipped", "search", why)] += below
                continue
            run = [r for r, axes in pending.items() if axes is None or axis in axes]
            verdict = self.judge(run, chosen) if run else Verdict(None, [], [])
            if verdict.error:
                self.families[("error", *verdict.error)] += below
            else:
                ran = set(run)
                still = {r: verdict.blocked.get(r, axes) for r, axes in pending.items()
                         if r in verdict.blocked or r not in ran}
                yield from self.descend(level + 1, chosen, still, warnings + verdict.warnings,
                                        self.refine(inner, chosen, axis, still, bool(run)))
            if axis == "pp" and self.progress:
                self.progress(i + 1, len(self.dom[axis]))

    def refine(self, inner: dict, chosen: dict, new: str, grid: dict, grid_ran: bool) -> dict:
        """Re-judge, for each inner-axis value, the rules still open for it under the longer prefix
        (``new``: the grid axis just chosen; ``grid``: the grid's open rules and what they wait for).
        A rule the grid prefix decides alone is dropped (its verdict is the grid's); so is a rule
        that one inner axis decides for all of its accepted values. A rule is re-run with an inner
        value only when the grid prefix waits for nothing but that inner axis, and the last run
        with that value (if any) waited for ``new``: otherwise it would read the same values up to
        the same hidden one."""
        if not grid_ran and not any(new in axes for states in inner.values() for st in states.values()
                                    for axes in st.blocked.values()):
            return inner  # the grid's rules and every inner value's wait as before: shared, never mutated
        out: dict[str, dict] = {}
        index, chosen_axes = self.known.ids(chosen)  # the prefix's part of the rules' keys, shared by every value
        bits, bit = self.bits, self.bits.bit
        open_grid, alone, none = 0, {}, 0  # alone: axis -> the grid's rules waiting on it only
        for r, axes in grid.items():
            open_grid |= bit[r]
            if len(axes) == 1:
                (a,) = axes
                alone[a] = alone.get(a, 0) | bit[r]
            elif not axes:
                none |= bit[r]
        for axis, states in inner.items():
            waits = alone.get(axis, 0) | none  # the grid's rules whose axes are within {axis}
            if not waits and not grid_ran:  # no rule to re-run with this axis's values, none to drop
                out[axis] = states
                continue
            changed: dict = {}
            value_index, with_axis = self.known.index[axis], chosen_axes | {axis}
            for v, st in states.items():
                pending = st.pending
                if not pending:  # (nor a rejected value)
                    continue
                keep = pending & open_grid if grid_ran else pending
                run = keep & waits
                rules = [r for r in bits.rules_of(run) if r not in st.blocked or new in st.blocked[r]] if run else None
                if rules:
                    verdict = self.judge(rules, {**chosen, axis: v}, ({**index, axis: value_index[id(v)]}, with_axis))
                    if verdict.error:
                        changed[v] = _Inner(verdict.error, st.warnings + verdict.warnings, 0, {})
                        continue
                    still = keep & ~bits.of(rules) | bits.of(verdict.blocked)  # (a rule run and blocked again)
                    blocked = {r: axes for r, axes in st.blocked.items() if bit[r] & still}
                    blocked.update(verdict.blocked)
                    changed[v] = _Inner(None, st.warnings + verdict.warnings, still, blocked)
                elif keep != pending:
                    blocked = {r: axes for r, axes in st.blocked.items() if bit[r] & keep}
                    changed[v] = _Inner(None, st.warnings, keep, blocked)
            out[axis] = {**states, **changed} if changed else states  # states are never mutated: shared
        if all(out[a] is inner[a] for a in inner):
            return inner
        # decided: open for no accepted value of some inner axis (not in every axis's union of them; a
        # rejected value has no open rule)
        unions = [functools.reduce(operator.or_, map(_PENDING, states.values()), 0) for states in out.values()]
        decided = functools.reduce(operator.or_, unions) & ~functools.reduce(operator.and_, unions)
        for axis, states in out.items() if decided else ():
            out[axis] = {v: _Inner(st.error, st.warnings, st.pending & ~decided, st.blocked)
                         if st.pending & decided else st for v, st in states.items()}
        return out

    def grid(self, values: dict, pending: list, warnings: list, inner: dict) -> None:
        ok = self.tried(values, inner)
        if not all(ok.values()):
            return
        states = list(itertools.chain.from_iterable(map(dict.values, inner.values())))
        leftover = []  # rules no inner value decided alone: leaf_rejected runs them on each leaf
        if any(map(_PENDING, states)):
            leftover = list({r for st in states for r in self.bits.rules_of(st.pending)})
        layout = values_layout(self.base, self.shape, {**self.placeholders, **values})
        gid = len(self.grids)
        self.grids.append(values)
        n_valid = n_fit = 0
        smallest: tuple[float, tuple] | None = None
        per_leaf_warnings = any(inner[a][v].warnings for a in INNER_AXES for v in ok[a])
        if not leftover and not per_leaf_warnings:  # every leaf valid: count with arrays, time the fitting
            n_valid, n_fit, smallest = self.fitting_leaves(values, layout, ok, gid)
        for leaf, mem, step in self.leaves_of(values, layout, ok) if leftover or per_leaf_warnings else ():
            if leftover and self.leaf_rejected(values, leaf, leftover):
                continue
            n_valid += 1
            if per_leaf_warnings:
                for w in [w for a, v in zip(INNER_AXES, leaf) for w in inner[a][v].warnings]:
                    self.families[("warning", *w)] += 1
            if mem <= self.limit:
                n_fit += 1
                self.leaves.append((step(), mem, gid, self.inner(*leaf)))
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

    def tried(self, values: dict, inner: dict) -> dict[str, list]:
        """Each inner axis's values that the rules accept under the grid ``values`` and the search tries
        (not skipped); the others are counted in ``families``, a rejected value standing for the leaves
        not counted before it (the accepted values of the axes before its, every value of those after)."""
        ok: dict[str, list] = {}
        for i, axis in enumerate(INNER_AXES):
            covered, kept = math.prod(map(len, ok.values())) * self.after[i], []
            for v, st in inner[axis].items():
                why = skipped(axis, {**values, axis: v}) if axis in SKIPPED_AXES else None
                if why:
                    self.families[("skipped", "search", why)] += covered
                elif st.error is not None:
                    self.families[("error", *st.error)] += covered
                else:
                    kept.append(v)
            ok[axis] = kept
        return ok

    def batch(self, values: dict, micro: int, layout):
        """BatchPlan of a grid and micro batch, shared by grids that agree on its axes."""
        key = (micro, *[values[a] for a in _GRID_BATCH_AXES])
        hit = self.batches.get(key)
        if hit is None:  # derive_batch reads the spec's batch section (micro) and the layout's dp
            if micro not in self.micro_specs:
                self.micro_specs[micro] = build_spec(self.base, {"micro": micro})
            hit = self.batches[key] = derive_batch(self.micro_specs[micro], layout)
        return hit

    def leaf_rejected(self, grid: dict, inner: tuple, rules: list) -> bool:
        verdict = self.judge(rules, {**grid, **dict(zip(INNER_AXES, inner))})
        if verdict.error:
            self.families[("error", *verdict.error)] += 1
        return verdict.error is not None

    # ------------------------------------------------------------------ memory and time
    def fitting_leaves(self, values: dict, layout, ok: dict[str, list], gid: int) -> tuple[int, int, tuple | None]:
        """leaves_of when every inner choice is valid: the fitting ones (in leaves_of's order) are
        timed and kept; returns (valid, fitting, the smallest leaf when none fits)."""
        worst, batches, grid = self.tables(values, layout, ok)
        fit = worst <= self.limit
        zeros, cpcs = ok["zero"], ok["cpc"]
        leaves, groups, inner = self.leaves, self.groups, self.inner
        # time.layer_floor's setting per cp communication (the only part of the floor it changes)
        settings = [(c, self.setting(layout, c)) for c in cpcs]
        micro_rec, k_fit = np.nonzero(fit.reshape(-1, fit.shape[2]))  # row-major: each (micro, recompute)'s run
        bounds = [0, *(np.flatnonzero(np.diff(micro_rec)) + 1).tolist(), len(k_fit)] if len(k_fit) else []
        micro_rec, k_fit, mem_fit = micro_rec.tolist(), k_fit.tolist(), worst[fit].tolist()
        for a, b in zip(bounds, bounds[1:]):  # the fitting ZeRO choices of one micro batch and recompute
            i, j = divmod(micro_rec[a], fit.shape[1])
            batch, m, r = batches[i], ok["micro"][i], ok["recompute"][j]
            ks, mems = k_fit[a:b], mem_fit[a:b]
            for c, s in settings:  # timed by time_groups (step inf until then)
                floor = self.layer_floor(layout, batch, s, r) if self.keep else 0.0
                groups.append((floor, len(ks), len(leaves), grid, c, batch, r))
                leaves += [(math.inf, mem, gid, inner(c, zeros[k], m, r)) for k, mem in zip(ks, mems)]
        n_fit = len(k_fit) * len(cpcs)
        smallest = None
        if not n_fit:
            i, j, k = np.unravel_index(np.argmin(worst), worst.shape)
            smallest = (float(worst[i, j, k]), (cpcs[0], zeros[k], ok["micro"][i], ok["recompute"][j]))
        return worst.size * len(cpcs), n_fit, smallest

    def layer_floor(self, layout, batch, s, r: str) -> float:
        """time.layer_floor of a grid's layouts with this batch, setting and recompute, kept by what it
        reads of them (the setting and batch are the walk's own: Walk.setting, Walk.batch)."""
        key = (id(s), id(batch), r, layout.cp, layout.pp)
        hit = self.floors.get(key)
        if hit is None:
            hit = self.floors[key] = layer_floor(self.shape, layout, batch, self.dims, s, r, self.kinds)
        return hit

    def inner(self, c: CPComm, z, m: int, r: str) -> tuple:
        """The inner values (c, z, m, r) as one tuple per distinct choice, shared by the leaves (a few
        thousand among millions of leaves)."""
        key = (id(c), id(z), m, r)  # (the domains' values live as long as the walk)
        hit = self.inners.get(key)
        if hit is None:
            hit = self.inners[key] = (c, z, m, r)
        return hit

    def cutoff(self) -> float:
        """Step seconds above which a layout need not be timed (inf: time every one): a little
        above the keep-th fastest grid's fastest layout timed so far (search._rank lists one layout
        per grid before that grid's slower ones, unless two have the same step time: then it times
        what it needs with leaf_step), or the smaller cut-off another worker found."""
        cut = self.cut
        if self.shared_cut is not None:
            if cut < self.shared_cut.value:
                self.shared_cut.value = cut
            cut = min(cut, self.shared_cut.value)
        return cut

    def leaf_step(self, gid: int, inner: tuple) -> float:
        """The step seconds fitting_leaves would have given the layout of grid ``gid`` and inner
        values ``inner`` (the same functions on the same values)."""
        c, z, m, r = inner
        hit = self.timings.get(gid)
        if hit is None:
            values = self.grids[gid]
            layout = spec_layout(build_spec(self.base, {**self.placeholders, **values}), self.shape)
            sigs = stage_signatures(self.shape, layout)
            hit = self.timings[gid] = (_GridTimings(self, layout, self.trained(layout, sigs), sigs), values, layout)
        grid, values, layout = hit
        return grid.timing(c).steps([z], self.batch(values, m, layout), r)[0]

    def params(self, lay, sigs: tuple, sk: int | None = None) -> list:
        """stage_params of every stage (shared by the grids with the same tp, ep, etp and stage signatures;
        ``sk``: signature_key(sigs), when the caller has it)."""
        sk = self.signature_key(sigs) if sk is None else sk
        return self.cached(("params", lay.tp, lay.ep, lay.etp, sk),
                           lambda: _per_stage(sigs, lambda k: stage_params(self.shape, lay, k, hf_modules(self.base))))

    def adapters(self, lay, sigs: tuple, sk: int) -> list:
        """Per stage, LoRA's adapters (estimate.lora.adapter_params, as memory.trained_states counts them)
        when the spec fine-tunes with them, else None: the frozen base then keeps no gradients or
        optimizer states."""
        b = self.base
        if b.finetune.method != "lora":
            return [None] * len(sigs)
        return self.cached(("adapters", lay.tp, lay.ep, lay.etp, sk), lambda: _per_stage(
            sigs, lambda k: spec_adapter_params(b, self.shape, lay, k)))

    def trained(self, lay, sigs: tuple, sk: int | None = None) -> list:
        """Per stage, what the optimizer trains (time.trained_params): every weight, or LoRA's adapters."""
        if self.base.finetune.method != "lora":
            return self.params(lay, sigs, sk)
        return self.adapters(lay, sigs, self.signature_key(sigs) if sk is None else sk)

    def leaves_of(self, values: dict, layout, ok: dict[str, list]) -> Iterator[tuple[tuple, float, Callable]]:
        """(inner values, worst-stage bytes, its step seconds on call) of every rule-valid inner
        choice: the step time is computed only for the layouts that fit."""
        worst, batches, grid = self.tables(values, layout, ok)
        timings = [(c, grid.timing(c)) for c in ok["cpc"]]
        for i, m in enumerate(ok["micro"]):
            for j, r in enumerate(ok["recompute"]):
                for c, timing in timings:  # the cp communication changes the step time only
                    for z, mem in zip(ok["zero"], worst[i, j].tolist()):
                        yield (c, z, m, r), mem, lambda z=z, batch=batches[i], r=r, timing=timing: timing.step(
                            z, batch, r)

    def tables(self, values: dict, layout, ok: dict[str, list]) -> tuple[np.ndarray, list, _GridTimings]:
        """(worst-stage bytes per micro x recompute x ZeRO choice, BatchPlan per micro, the grid's
        _GridTimings) of a grid."""
        base, shape = self.base, self.shape
        prec = base.precision
        sigs = stage_signatures(shape, layout)
        sk = self.signature_key(sigs)  # (in the caches' keys: sigs is hashed once)
        lay = layout  # what each piece reads of the layout keys its cache (grids share them)
        params = self.params(layout, sigs, sk)
        adapters = self.adapters(layout, sigs, sk)
        zeros = ok["zero"]
        states = self.cached(  # (zero, stage) model states, step-only bytes and buffers (StageMemory.total's terms)
            ("fixed", lay.tp, lay.ep, lay.etp, sk, (lay.dp_cp, lay.edp), *map(id, zeros)),
            lambda: np.array([[_fixed_terms(p, layout, z, prec, self.grad_copy, self.buffers[id(z)], a)
                               for p, a in zip(params, adapters)] for z in zeros]))
        acts = {r: self.cached(("acts", lay.tp, lay.sequence_parallel, lay.etp, sk, r), lambda r=r: _per_stage(
                    sigs, lambda k: stage_activations(shape, layout, k, seq=base.batch.seq_len, recompute=r,
                                                      **stage_activation_settings(base))))
                for r in ok["recompute"]}
        batches = [self.batch(values, m, layout) for m in ok["micro"]]
        # memory.activation_bytes for every micro x recompute x stage: the same float operations
        stored, rebuilt, edge = self.cached(  # (the activations' terms as arrays, kept with the activations)
            ("act_terms", lay.tp, lay.sequence_parallel, lay.etp, sk, *ok["recompute"]),
            lambda: [np.array([[getattr(a, f) for a in acts[r]] for r in ok["recompute"]])[None]
                     for f in ("stored", "rebuilt", "edge")])
        tokens = np.array([micro_batch_tokens(layout, b) for b in batches])[:, None, None]
        flight = self.in_flight(layout, batches)
        act = tokens * (stored * flight + rebuilt + edge)  # (micro, recompute, stage)
        model_states, step_only, buffers = (states[None, None, ..., i] for i in range(3))
        if base.fp8.on:  # memory.estimate_memory's params: TransformerEngine's FP8 weight copies
            copies = self.cached(("fp8w", lay.tp, lay.ep, lay.etp, sk),
                                 lambda: _per_stage(sigs, lambda k: fp8_weight_bytes(base, shape, layout, k)))
            model_states = model_states + np.array(copies)
        buffers = buffers + causal_mask_bytes(base, layout)  # memory.estimate_memory's buffers
        # StageMemory.total of the worst stage per micro x recompute x ZeRO
        worst = (model_states + np.maximum(act[:, :, None], step_only) + buffers).max(axis=3)
        return worst, batches, _GridTimings(self, layout, self.trained(layout, sigs, sk), sigs)

    def in_flight(self, lay, batches: list) -> np.ndarray:
        """memory.in_flight of every micro batch x stage as a (micro, 1, stage) array, shared by the grids with
        the same pipeline and micro-batch counts (each count's list is kept too)."""
        pipe = ("flight", lay.pp, lay.vpp, lay.ep_a2a_overlap, lay.split)  # (the split is built per call)
        counts = [b.grad_accum for b in batches]
        return self.cached(("flights", *pipe[1:], *counts), lambda: np.array([self.cached(
            (*pipe, m), lambda m=m: [in_flight(lay, k, m) for k in range(lay.pp)]) for m in counts])[:, None, :])

    def setting(self, layout, cpc: CPComm | None = None):
        """spec_setting(base, layout, gpu), one object per Layout.for_layers() (the rest is the base
        spec's): ~6,000 grids x cp communications share ~100, whose hashes are kept, and the caches
        keyed by them (time._signature_work, layer_piece) compare them by identity. ``cpc``: that
        of replace(layout, **cpc.fields()) (built only for a setting not met before)."""
        fields = cpc.fields() if cpc is not None else {}
        key = tuple([fields[f] if f in fields else getattr(layout, f) for f in LAYER_FIELDS])
        hit = self.settings.get(key)
        if hit is None:
            hit = self.settings[key] = spec_setting(self.base, replace(layout, **fields) if fields else layout,
                                                    self.gpu)
        return hit

    def signature_key(self, sigs: tuple) -> int:
        """A number per distinct stage_signatures tuple (one per stage: hashing it in every cache key of a
        grid cost more than the lookups)."""
        return self.sig_keys.setdefault(sigs, len(self.sig_keys))

    def cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        hit = self.cache.get(key)  # (no value is None)
        if hit is None:
            hit = self.cache[key] = make()
        return hit

    def memory_family(self, values: dict, smallest: tuple[float, tuple], layouts: int) -> None:
        """Grids where nothing fits, grouped by tp/pp/cp (and ep/etp) with their smallest need."""
        key = grid_label({a: values[a] for a in ("tp", "pp", "cp", "ep", "etp")}, self.shape)
        count, mem, example = self.memory.get(key, (0, math.inf, ""))
        if smallest[0] < mem:
            mem, example = smallest[0], inner_label(smallest[1])
        self.memory[key] = (count + layouts, mem, example)


def _fixed_terms(p, layout, zero, precision: str, copy: str, buffers: float,
                 adapters=None) -> tuple[float, float, float]:
    """A stage's StageMemory terms that do not depend on the micro batch or recompute: model
    states, step-only bytes, buffers (its total adds the larger of the activations and step-only);
    with LoRA ``adapters``, the frozen base's and the adapters' (memory.trained_states)."""
    params, grads, opt, _, step_only = model_states(p, adapters, layout, zero, precision, copy)
    return StageMemory(0, params, grads, opt, 0.0, buffers, 0.0, step_only).model_states, step_only, buffers


class _Timing:
    """Step times of one grid's inner choices, from the functions make_plan uses, with what the
    micro batch and recompute share (stage times, the pipeline) and what only the ZeRO stage
    changes (exposed dp) computed once."""

    def __init__(self, walk: Walk, layout, params: list, zero: dict, sigs: tuple, setting=None):
        self.walk, self.layout, self.params, self.sigs = walk, layout, params, sigs  # sigs: the cp communication
        # changes no stage signature. Stages of one signature share their work, params (so their comms) and,
        # without the EP a2a overlap (whose share differs by stage), their StageTime: dp_seconds's distinct
        # (stage, comm) pairs are then the signatures' first stages
        self.first = None if layout.ep_a2a_overlap else signature_slots(sigs)[0]
        self.slots = signature_slots(sigs)[1]  # each stage's signature (stage_work(distinct=True)'s index)
        self.setting = setting or walk.setting(layout)
        self.pipelines: dict = {}
        self.work: dict = {}
        self.works: dict = {}  # time.signature_works per micro batch
        self.dp: dict = {}  # (micro, recompute) -> {ZeRO part -> exposed dp seconds}
        self.zero = zero  # shared by the layouts that differ in the cp communication only

    def signature_works(self, batch) -> list[tuple]:
        works = self.works.get(batch.micro)
        if works is None:
            w = self.walk
            works = self.works[batch.micro] = signature_works(w.shape, self.layout, batch, w.dims, self.setting,
                                                              self.sigs)
        return works

    def floor(self, batch, recompute: str) -> float:
        """A lower bound of steps(zs, batch, recompute) for every ZeRO choice (time.step_floor)."""
        return step_floor(self.signature_works(batch), recompute, batch.grad_accum)

    def step(self, z, batch, recompute: str) -> float:
        return self.steps([z], batch, recompute)[0]

    def forget(self, batch, recompute: str) -> None:
        """Drop what steps() kept for this micro batch and recompute alone (time_groups times each
        such group once): the stage work per micro batch and the ZeRO choices' terms stay."""
        self.pipelines.pop((batch.micro, recompute), None)
        self.dp.pop((batch.micro, recompute), None)

    def steps(self, zs: list, batch, recompute: str) -> list[float]:
        """Step seconds of each ZeRO choice in ``zs`` with this micro batch and recompute."""
        w, lay = self.walk, self.layout
        key = (batch.micro, recompute)
        if key not in self.pipelines:
            if batch.micro not in self.work:  # the same for every recompute choice
                self.work[batch.micro] = stage_work(w.shape, lay, batch, w.gpu, precision=w.base.precision,
                                                    flash=w.flash, dims=w.dims, s=self.setting, sigs=self.sigs,
                                                    works=self.signature_works(batch), distinct=True)
            stages = times_of(self.work[batch.micro], recompute, a2a_overlap_shares(lay, batch.grad_accum),
                              self.slots)
            # sum(pipeline_breakdown(...).values()), without the breakdown
            self.pipelines[key] = (stages, pipeline_seconds(list(map(_TOTAL, stages)), batch.grad_accum, lay.vpp))
        stages, pipeline_total = self.pipelines[key]
        m, dps, zero, out = batch.grad_accum, self.dp.setdefault(key, {}), self.zero, []
        for z in zs:
            per = zero.get(id(z))
            if per is None:  # per ZeRO choice: its communication, optimizer step and the dp cache's key part
                bucket = buckets(w.base.target, w.base.precision, z, lay, w.shape.hidden_size, sizes=w.bucket_sizes,
                                 gather_at_start=w.base.estimate.param_gather_at_start)
                per = zero[id(z)] = (stage_comms(lay, w.gpu, self.params, z, w.base.precision, w.grad_bytes, bucket),
                                     optimizer_seconds(lay, w.gpu, self.params, z), bucket, (z.stage, bucket.engine))
            comms, opt, bucket, part = per
            # the ZeRO stage and the engine's path decide it, not offload (on one layout the path decides the
            # bucket sizes: buckets())
            dp = dps.get(part)
            if dp is None:
                dp = dps[part] = dp_seconds(lay, stages, comms, z.stage, grad_accum=m, bucket=bucket,
                                                   first=self.first)
            off = zero.get((id(z), m))
            if off is None:
                off = zero[(id(z), m)] = offload_seconds(lay, self.params, z, m)
            out.append(pipeline_total + dp + opt + off)  # sum(step_breakdown(...).values())
        return out


class _GridTimings:
    """A grid's _Timing per cp communication, built when a group of its layouts is timed (most
    are not: time_groups) and dropped by release() after its last one: a grid waiting to be
    timed holds its layout and per-stage parameters only (shared with Walk.cache)."""

    def __init__(self, walk: Walk, layout, params: list, sigs: tuple):
        self.walk, self.layout, self.params, self.sigs = walk, layout, params, sigs
        self.timings: dict = {}  # id(cp communication) -> _Timing
        self.zero: dict = {}  # what the cp communication does not change (_Timing.zero)

    def timing(self, cpc: CPComm) -> _Timing:
        hit = self.timings.get(id(cpc))
        if hit is None:
            lay = replace(self.layout, **cpc.fields())
            hit = self.timings[id(cpc)] = _Timing(self.walk, lay, self.params, self.zero, self.sigs,
                                                  self.walk.setting(self.layout, cpc))
        return hit

    def release(self) -> None:
        """Drop the timings (a _Timing already handed out keeps working)."""
        self.timings, self.zero = {}, {}


@contextlib.contextmanager
def collect_rarely() -> Iterator[None]:
    """While a search runs (its walk and ranking; forked workers inherit it), the cyclic garbage
    collector runs GC_THRESHOLDS' generations instead of Python's default (700, 10, 10): the walk
    allocates ~230,000 container objects (the 405B search) that live to its end (leaves, caches, the
    rules' verdicts) and makes little cyclic garbage, so the frequent collections, each older
    generation's traversing everything kept so far again, found nothing to free and took about a
    tenth of the search's CPU. Restored afterwards."""
    old = gc.get_threshold()
    gc.set_threshold(*map(max, old, GC_THRESHOLDS))
    try:
        yield
    finally:
        gc.set_threshold(*old)


_FORKED: tuple[Walk, list[str]] | None = None  # the walk whose cells forked workers run (Walk._run_forked)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _worker_signals() -> None:
    """In a forked worker: Ctrl-C reaches the whole process group, and the parent alone
    answers it (the pool's terminate() then ends the workers with SIGTERM, which must not
    run a handler inherited from the parent): no worker prints a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _worker_default(signum: int) -> None:
    """A stop signal that reached a worker before _worker_signals ran (the pool's terminate()
    right after a Ctrl-C can come that early, under load): SIGINT is ignored, SIGTERM ends the
    worker. Recorded instead, as the parent's handler did, it left a worker the pool waited
    for forever (a Ctrl-C hung `toolkit plan --auto`)."""
    _worker_signals()
    if signum == signal.SIGTERM:
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[list[int]]:
    """While the pool runs, SIGINT/SIGTERM are recorded (in the list yielded), not raised: an
    exception raised at an arbitrary point inside multiprocessing's pool, while it forks or
    holds its locks, left workers it could no longer terminate (a Ctrl-C right after the first
    fork hung the command). The walk stops at the next result, the pool is terminated, and the
    signal is raised again for the handler it was meant for (the CLI's: one line, exit 130).
    Only the main thread can handle signals; elsewhere nothing changes."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    parent = os.getpid()

    def record(signum: int, frame) -> None:
        if os.getpid() == parent:
            received.append(signum)
        else:  # a worker forked but not yet past _worker_signals: what that would do
            _worker_default(signum)

    old = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
    for s, handler in old.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, record)
    try:
        yield received
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if received:
        signal.raise_signal(received[0])


def _until_signal(results: Iterator, received: list[int], poll_s: float = 0.05) -> Iterator:
    """The pool's results until they end or a signal is recorded (checked every ``poll_s``)."""
    while not received:
        try:
            yield results.next(timeout=poll_s)
        except mp.TimeoutError:
            continue
        except StopIteration:
            return


def _walk_cell(cell: tuple[int, ...]) -> tuple[tuple[int, ...], dict]:
    """In a forked worker: the walk of one cell (value indices of the first axes)."""
    walk, axes = _FORKED
    dom = {**walk.dom, **{a: (walk.dom[a][i],) for a, i in zip(axes, cell)}}
    return cell, walk.part(dom).run()._export()


def _per_stage(signatures: tuple, fn: Callable[[int], Any]) -> list:
    """fn(stage) for every stage, computed once per stage signature (memory.stage_signatures)."""
    first: dict = {}
    for k, sig in enumerate(signatures):
        first.setdefault(sig, k)
    values = {sig: fn(k) for sig, k in first.items()}
    return [values[sig] for sig in signatures]


def grid_label(values: dict, shape: ModelShape) -> str:
    keys = ("tp", "sp", "pp", "split", "vpp", "cp", "cpc") + (("ep", "etp") if shape.moe is not None else ())
    return " ".join(f"{k}={_short(values[k])}" for k in keys if k in values
                    and not (k == "split" and values[k] == Split(num_layers=values[k].num_layers))
                    and not (k == "cpc" and values[k] == CPComm()))


def inner_label(inner: tuple) -> str:
    c, z, m, r = inner
    off = "".join(f" +{kind} offload to {dev}" for kind, dev in (("optimizer", z.offload_optimizer),
                                                                   ("param", z.offload_param)) if dev != "none")
    cpc = "" if c == CPComm() else f"cp_comm {c}, "
    return f"{cpc}ZeRO-{z.stage}{off}, micro {m}, recompute {r}"


def _short(v: Any) -> str:
    if v is None:  # etp left to follow tp
        return "tp"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)
