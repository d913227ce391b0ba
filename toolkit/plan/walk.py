"""The search's walk: the spine's rules grid by grid, then memory and time per grid.

Grid axes (GRID_AXES) are chosen depth first; at each prefix the still-open rules run on a
partial context (partial.py) and an error rejects the whole family below it. The inner axes
(zero, micro, recompute) ride along: for each of their values the walk keeps what the rules
say with only that inner value added, deciding it at the shortest prefix that can. At each
valid grid the memory and step time of every inner choice come from the functions make_plan
uses (memory.py, cost.py), with what depends on the grid alone computed once, and what a
pipeline stage does once per stage signature (memory.stage_signatures: stages with the same
layers and edges). The order of the grid axes (pp, split, vpp, cp first) lets the pipeline's
and the runtime's rules reject a family before it is multiplied by the tensor-parallel sizes.
Values the search does not try (choices.skipped) are counted as "skipped" families.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..hardware import get_gpu
from ..models import ModelShape
from ..spec import TrainingSpec
from ..kernels import spec_kernels
from .compute import model_dims
from .cost import pipeline_breakdown, stage_times, step_breakdown
from .data_time import bucket_elements, dp_seconds, offload_seconds, optimizer_seconds, stage_comms
from .layout import derive_batch, derive_layout
from .memory import (StageMemory, activation_bytes, activation_settings, buffer_bytes, in_flight,
                     micro_batch_tokens, stage_activations, stage_params, stage_signatures, stage_states,
                     usable_bytes, zero_shards)
from .choices import CPComm, Split, skipped
from .partial import AXES, BATCH_FIELD_AXES, Choice, Verdict, build_spec, judge, partial_context
from .rules import RULES

GRID_AXES = AXES[:9]  # pp split vpp cp cpc tp sp ep etp: decided one after another, depth first
INNER_AXES = AXES[9:]  # zero micro recompute: each checked against a grid on its own
BATCH_AXES = tuple(sorted(set().union(*BATCH_FIELD_AXES.values())))  # all a BatchPlan depends on


@dataclass
class _Inner:
    """What the rules say about one value of an inner axis (zero, micro, recompute) under a prefix."""

    error: tuple[str, str] | None
    warnings: list
    pending: list


class Walk:
    """One search's walk; its results are ``families``, ``memory``, ``leaves``, ``grids``, ``valid``."""

    def __init__(self, base: TrainingSpec, shape: ModelShape, dom: dict[str, tuple],
                 progress: Callable[[int, int], None] | None):
        self.base, self.shape, self.gpu, self.progress = base, shape, get_gpu(base.cluster.gpu), progress
        self.dom = dom
        self.placeholders = {a: d[0] for a, d in self.dom.items()}
        self.families: Counter[tuple[str, str, str]] = Counter()
        self.limit = usable_bytes(self.gpu.memory_gib, base.estimate.headroom)
        self.leaves: list[tuple[float, float, int, tuple]] = []  # fitting: (step, memory, grid, inner values)
        self.grids: list[dict[str, Any]] = []
        self.valid = 0
        self.batches: dict[tuple, Any] = {}
        self.memory: dict[str, tuple[int, float, str]] = {}  # grids where nothing fits: layouts, least bytes, example
        self.flash = spec_kernels(base).attention == "flash"
        self.dims = model_dims(shape)
        self.buffers = {id(z): buffer_bytes(build_spec(base, {"zero": z}), shape) for z in self.dom["zero"]}

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(len(self.dom[a]) for a in axes)

    def context(self, values: dict[str, Any]):
        return partial_context(self.base, self.shape, self.gpu, Choice(values), self.placeholders)

    # ------------------------------------------------------------------ rules, grid by grid
    def run(self) -> Walk:
        table = {a: {v: _Inner(None, [], list(RULES)) for v in self.dom[a]} for a in INNER_AXES}
        for values, pending, warnings, inner in self.descend(0, {}, list(RULES), [], table):
            self.grid(values, pending, warnings, inner)
        return self

    def descend(self, level: int, values: dict, pending: list, warnings: list, inner: dict) -> Iterator[tuple]:
        """Depth first over GRID_AXES; a rule error rejects the family below. ``inner`` carries,
        for every value of every inner axis, what the rules say with only that inner axis chosen."""
        if level == len(GRID_AXES):
            yield values, pending, warnings, inner
            return
        axis, below = GRID_AXES[level], self.size(GRID_AXES[level + 1:] + INNER_AXES)
        for i, v in enumerate(self.dom[axis]):
            chosen = {**values, axis: v}
            why = skipped(axis, chosen)
            if why:
                self.families[("skipped", "search", why)] += below
                continue
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
        if not any(st.pending for states in inner.values() for st in states.values()):
            return inner  # nothing left open: shared, never mutated
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
        for leaf, mem, step in self.leaves_of(values, layout, ok):
            if leftover and self.leaf_rejected(values, leaf, leftover):
                continue
            n_valid += 1
            if per_leaf_warnings:
                for w in [w for a, v in zip(INNER_AXES, leaf) for w in inner[a][v].warnings]:
                    self.families[("warning", *w)] += 1
            if mem <= self.limit:
                n_fit += 1
                self.leaves.append((step(), mem, gid, leaf))
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
        """BatchPlan of a grid and micro batch, shared by grids that agree on its axes."""
        key = tuple({**values, "micro": micro}[a] for a in BATCH_AXES)
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
    def leaves_of(self, values: dict, layout, ok: dict[str, list]) -> Iterator[tuple[tuple, float, Callable]]:
        """(inner values, worst-stage bytes, its step seconds on call) of every rule-valid inner
        choice: the step time is computed only for the layouts that fit."""
        base, shape, gpu = self.base, self.shape, self.gpu
        prec = base.precision
        sigs = stage_signatures(shape, layout)
        params = _per_stage(sigs, lambda k: stage_params(shape, layout, k))
        zeros = ok["zero"]
        fixed = np.array([[StageMemory(k, *stage_states(p, layout, z, prec)[:3], 0.0, self.buffers[id(z)], 0.0).total
                           for k, p in enumerate(params)] for z in zeros])  # (zero, stage) bytes without activations
        acts = {r: _per_stage(sigs, lambda k, r=r: stage_activations(shape, layout, k, seq=base.batch.seq_len,
                                                                      recompute=r, **activation_settings(base)))
                for r in ok["recompute"]}
        timing = _Timing(self, layout, params)
        for m in ok["micro"]:
            batch = self.batch(values, m, layout)
            tokens = micro_batch_tokens(layout, batch)
            flight = [in_flight(layout, k, batch.grad_accum) for k in range(layout.pp)]
            for r in ok["recompute"]:
                act = np.array([activation_bytes(a, tokens, f) for a, f in zip(acts[r], flight)])
                worst = (fixed + act).max(axis=1).tolist()  # the same float sums, the worst stage per ZeRO choice
                for z, mem in zip(zeros, worst):
                    yield (z, m, r), mem, lambda z=z, batch=batch, r=r: timing.step(z, batch, r)

    def memory_family(self, values: dict, smallest: tuple[float, tuple], layouts: int) -> None:
        """Grids where nothing fits, grouped by tp/pp/cp (and ep/etp) with their smallest need."""
        key = grid_label({a: values[a] for a in ("tp", "pp", "cp", "ep", "etp")}, self.shape)
        count, mem, example = self.memory.get(key, (0, math.inf, ""))
        if smallest[0] < mem:
            mem, example = smallest[0], inner_label(smallest[1])
        self.memory[key] = (count + layouts, mem, example)


class _Timing:
    """Step times of one grid's inner choices, from the functions make_plan uses, with what the
    micro batch and recompute share (stage times, the pipeline) and what only the ZeRO stage
    changes (exposed dp) computed once."""

    def __init__(self, walk: Walk, layout, params: list):
        self.walk, self.layout, self.params = walk, layout, params
        self.pipelines: dict = {}
        self.dp: dict = {}
        self.zero: dict = {}

    def step(self, z, batch, recompute: str) -> float:
        w, lay = self.walk, self.layout
        key = (batch.micro, recompute)
        if key not in self.pipelines:
            stages = stage_times(w.shape, lay, batch, w.gpu, precision=w.base.precision, recompute=recompute,
                                 flash=w.flash, dims=w.dims)
            self.pipelines[key] = (stages, pipeline_breakdown(stages, batch.grad_accum, lay.vpp))
        stages, pipeline = self.pipelines[key]
        if id(z) not in self.zero:  # per ZeRO choice: its communication and optimizer step
            self.zero[id(z)] = (stage_comms(lay, w.gpu, self.params, z, w.base.precision),
                                optimizer_seconds(lay, w.gpu, self.params, z))
        comms, opt = self.zero[id(z)]
        if (key, z.stage) not in self.dp:  # exposed dp depends on the ZeRO stage only, not on offload
            bucket = bucket_elements(w.base.target, w.shape.hidden_size, zero_shards(lay)[0])
            self.dp[(key, z.stage)] = dp_seconds(lay, stages, comms, z.stage, grad_accum=batch.grad_accum,
                                                 bucket=bucket)
        off = offload_seconds(lay, self.params, z, batch.grad_accum)
        return sum(step_breakdown(pipeline, self.dp[(key, z.stage)], opt, off).values())


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
    z, m, r = inner
    off = "".join(f" +{kind} offload to {dev}" for kind, dev in (("optimizer", z.offload_optimizer),
                                                                   ("param", z.offload_param)) if dev != "none")
    return f"ZeRO-{z.stage}{off}, micro {m}, recompute {r}"


def _short(v: Any) -> str:
    if v is None:  # etp left to follow tp
        return "tp"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)
