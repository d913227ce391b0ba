"""The spine's rules on a partly chosen layout: what the search can decide early.

The search fixes the axes of a layout one after another (pp, then the split, vpp, cp, tp, ...).
A rule reads its Context through views in which every value that depends on an axis not
chosen yet is hidden: reading it raises ``Undetermined``. A rule that returns without
raising read only chosen values, so (rules being pure functions of the context) it returns
the same findings for every way of choosing the remaining axes: an error rejects the whole
family of layouts below, a pass need not be checked again. The rules themselves are the
spine's ``RULES``, run unchanged; nothing here restates one.

What each derived field depends on is written down once (LAYOUT_FIELD_AXES, BATCH_FIELD_AXES)
and checked against ``derive_layout`` / ``derive_batch`` by tests/toolkit/search/test_partial.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from operator import itemgetter
from typing import Any

from ..hardware import GPU
from ..models import ModelShape
from ..estimate.memo import IdMemo
from ..parallel.layout import derive_batch, derive_layout
from ..plan.rules import Context, Finding, Rule
from ..spec import TrainingSpec, Zero
from .choices import CP_FIELDS, SPLIT_FIELDS

AXES = ("pp", "split", "vpp", "tp", "cp", "sp", "ep", "etp", "cpc", "zero", "micro", "recompute")
PARALLEL_FIELDS = {"tp": "tp", "sequence_parallel": "sp", "pp": "pp", "vpp": "vpp", "cp": "cp", "ep": "ep",
                   "etp": "etp"}  # spec.parallel field -> axis (split and cpc set several fields: choices.py)
PARALLEL_FIELD_AXES = {**{f: (a,) for f, a in PARALLEL_FIELDS.items()}, **dict.fromkeys(SPLIT_FIELDS, ("split", "pp")),
                       **dict.fromkeys(CP_FIELDS, ("cpc",))}
ZERO_FIELDS = ("stage", "offload_optimizer", "offload_param")  # the "zero" axis (nvme_path stays the spec's)
LAYOUT_FIELD_AXES = {  # the Layout's fields; its derived sizes (dp, edp, split, ...) are properties that read them
    "world": (), "gpus_per_node": (), "num_layers": (), "tp": ("tp",), "pp": ("pp",), "vpp": ("vpp",), "ep": ("ep",),
    "cp": ("cp",), "etp": ("etp", "tp"), "sequence_parallel": ("sp", "tp"),
    **dict.fromkeys(SPLIT_FIELDS, ("split", "pp")), "cp_comm": ("cpc",), "cp_a2a": ("cpc",),
    "tp_comm_overlap": ("tp", "sp"), "ep_a2a_overlap": ("ep", "pp", "vpp"),
}
BATCH_FIELD_AXES = {"micro": ("micro",), "global_": (), "seq_len": (), "grad_accum": ("micro", "tp", "pp", "cp")}


class Undetermined(Exception):
    """A rule read a value that depends on axes the search has not chosen yet (``axes``)."""

    def __init__(self, axes: frozenset[str]):
        super().__init__(", ".join(sorted(axes)))
        self.axes = axes


class View:
    """Read-only stand-in for a spec section, Layout or BatchPlan with some fields hidden.

    ``hidden`` maps a field to the unchosen axes it depends on. Properties are evaluated on
    the view (so they hide what their inputs hide); methods of an object with hidden fields
    count as undetermined, since they may read anything."""

    __slots__ = ("_obj", "_hidden", "_children", "_axes", "_seen")

    def __init__(self, obj: Any, hidden: dict[str, frozenset[str]] | None = None,
                 children: dict[str, View] | None = None, axes: dict[str, frozenset[str]] | None = None,
                 seen: set | None = None):
        """``axes``: the axes each field depends on (chosen or not); ``seen``: where to record the
        axes of every field read (ANY for a method call, which may read anything)."""
        self._obj, self._hidden, self._children = obj, hidden or {}, children or {}
        self._axes, self._seen = axes or {}, seen

    def __getattr__(self, name: str) -> Any:
        if name in self._children:
            return self._children[name]
        if name in self._hidden:
            raise Undetermined(self._hidden[name])
        attr = getattr(type(self._obj), name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        value = getattr(self._obj, name)
        if callable(value):
            if self._hidden:
                raise Undetermined(frozenset().union(*self._hidden.values()))
            if self._seen is not None:
                self._seen.add(ANY)
        elif self._seen is not None and name in self._axes:
            self._seen.update(self._axes[name])
        return value


@dataclass(frozen=True)
class Choice:
    """Values of the chosen axes; axes absent from ``values`` are not chosen yet."""

    values: dict[str, Any]

    def hidden(self, table: dict[str, tuple[str, ...]]) -> dict[str, frozenset[str]]:
        """Fields of a table that depend on an unchosen axis, with those axes."""
        out = {f: frozenset(a for a in axes if a not in self.values) for f, axes in table.items()}
        return {f: axes for f, axes in out.items() if axes}


def build_spec(base: TrainingSpec, values: dict[str, Any]) -> TrainingSpec:
    """The base spec with the given axis values (no validation: values come from the domains)."""
    update: dict[str, Any] = {"parallel": parallel_section(base, values)}
    if "zero" in values:
        update["zero"] = values["zero"]
    if "micro" in values:
        update["batch"] = _section(base.batch, {"micro": values["micro"]})
    if "recompute" in values:
        update["recompute"] = values["recompute"]
    return base.model_copy(update=update)


def parallel_section(base: TrainingSpec, values: dict[str, Any]) -> Any:
    """build_spec's parallel section, one per base section and parallel axes' values (found by their
    ids, ~10,000 times a search: the fields it sets need not be gathered again), shared as _section's."""
    chosen = tuple(values.get(a, _UNSET) for a in _PARALLEL_AXES)
    return _PARALLEL.get((id(base.parallel), *map(id, chosen)), (base.parallel, chosen),
                         lambda: _parallel_section(base, values))


_PARALLEL = IdMemo()
_PARALLEL_AXES = (*PARALLEL_FIELDS.values(), "split", "cpc")  # the axes build_spec's parallel section reads
_UNSET = object()  # an axis not in the values (its field stays the base's)


def _parallel_section(base: TrainingSpec, values: dict[str, Any]) -> Any:
    par = {f: values[a] for f, a in PARALLEL_FIELDS.items() if a in values}
    if "split" in values:
        par.update(values["split"].fields(values.get("pp", base.parallel.pp)))
    if "cpc" in values:
        par.update(values["cpc"].fields())
    return _section(base.parallel, par)


_SECTIONS = IdMemo()  # (id(section), update) -> its copy


def _section(section: Any, update: dict[str, Any]) -> Any:
    """section.model_copy(update=update), one copy per section and update (build_spec's ~8,000 calls
    a search ask for ~3,000 parallel sections and a few batch sections). The copies are shared:
    nothing writes to a spec's sections."""
    return _SECTIONS.get((id(section), *update.items()), section, lambda: section.model_copy(update=update))


_LAYOUTS = IdMemo()  # ids of (spec.parallel, spec.moe, spec.cluster, shape) -> their layout


def spec_layout(spec: TrainingSpec, shape: ModelShape):
    """derive_layout(spec, shape), one per parallel section (build_spec shares the sections: the
    search's ~8,000 specs have ~3,000); derive_layout reads the spec's parallel, moe and cluster
    sections and the shape."""
    keep = (spec.parallel, spec.moe, spec.cluster, shape)
    return _LAYOUTS.get(tuple(map(id, keep)), keep, lambda: derive_layout(spec, shape))


def values_layout(base: TrainingSpec, shape: ModelShape, values: dict[str, Any]):
    """spec_layout(build_spec(base, values), shape), building no spec when the layout of its parallel
    section is known (build_spec changes neither the moe nor the cluster section)."""
    hit = _LAYOUTS.find((id(parallel_section(base, values)), id(base.moe), id(base.cluster), id(shape)))
    return hit if hit is not None else spec_layout(build_spec(base, values), shape)


def partial_context(base: TrainingSpec, shape: ModelShape, gpu: GPU, choice: Choice,
                    placeholders: dict[str, Any], seen: set | None = None) -> tuple[Context, Any, Any]:
    """(context of views, real layout, real batch plan) for a partial choice. Unchosen axes
    take placeholder values so that the real objects can be built; the views hide every
    field those placeholders influence. ``seen`` collects the axes of the fields read."""
    spec = build_spec(base, {**placeholders, **choice.values})
    layout = spec_layout(spec, shape)
    batch = derive_batch(spec, layout)
    spec_h, par_h, zero_h, batch_h, layout_h, plan_h = _hidden_maps(frozenset(choice.values))
    spec_a, par_a, zero_a, batch_a, layout_a, plan_a = _AXES_MAPS
    spec_view = View(spec, spec_h, children={"parallel": View(spec.parallel, par_h, axes=par_a, seen=seen),
                                             "zero": View(spec.zero, zero_h, axes=zero_a, seen=seen),
                                             "batch": View(spec.batch, batch_h, axes=batch_a, seen=seen)},
                     axes=spec_a, seen=seen)
    ctx = Context(spec_view, shape, View(layout, layout_h, axes=layout_a, seen=seen),
                  View(batch, plan_h, axes=plan_a, seen=seen), gpu)
    return ctx, layout, batch


_VIEW_TABLES = ({"recompute": ("recompute",)}, PARALLEL_FIELD_AXES, {f: ("zero",) for f in ZERO_FIELDS},
                {"micro": ("micro",)}, LAYOUT_FIELD_AXES, BATCH_FIELD_AXES)  # (spec, spec.parallel, spec.zero,
# spec.batch, layout, batch plan): field -> the axes it depends on
_AXES_MAPS = tuple({f: frozenset(axes) for f, axes in table.items()} for table in _VIEW_TABLES)
ANY = "*"  # recorded for a method call: it may read any field


@lru_cache(maxsize=None)
def _hidden_maps(chosen: frozenset[str]) -> tuple[dict[str, frozenset[str]], ...]:
    """What the views hide depends only on which axes are chosen: (spec, spec.parallel,
    spec.zero, spec.batch, layout, batch plan) field -> unchosen axes."""
    choice = Choice(dict.fromkeys(chosen))
    return tuple(choice.hidden(table) for table in _VIEW_TABLES)


def try_rule(rule: Rule, ctx: Context) -> list[Finding] | Undetermined:
    """The rule's findings, or the Undetermined that says which unchosen axes blocked it."""
    try:
        return list(rule(ctx))
    except Undetermined as e:
        return e


@dataclass
class Verdict:
    """What the pending rules say about a partial choice."""

    error: tuple[str, str] | None  # (rule name, first error message): the family is rejected
    warnings: list[tuple[str, str]]  # (rule name, message) of rules that passed with a warning
    pending: list[Rule]  # rules that need more axes
    blocked: dict[Rule, frozenset[str]] = field(default_factory=dict)  # pending rule -> axes it waits for


class Verdicts:
    """Outcomes of rules, keyed by the values of the axes of the fields they read.

    A rule is a pure function of its context: run again where those axes have the same values,
    it reads the same fields with the same values in the same order, so it returns the same
    findings; and if it stopped at a hidden field, it stops there again when the same axes are
    chosen (an Undetermined is also keyed by the set of chosen axes). A run that called a
    method of a view (ANY) is not kept. Values are keyed by their index in the search's domains."""

    def __init__(self, dom: dict[str, tuple]):
        self.index = {a: {id(v): i for i, v in enumerate(values)} for a, values in dom.items()}
        # per rule, in the order first met: (axes read as a set, their value indices' getter (_key), stopped,
        # outcome by those indices)
        self.tables: dict[Rule, list[tuple[frozenset[str], Callable, bool, dict]]] = {}
        self._table: dict[tuple, dict] = {}  # (rule, axes, stopped) -> its outcomes (put's way in)

    def ids(self, values: dict[str, Any]) -> tuple[dict[str, int], frozenset[str]]:
        """What get and put key by: each chosen axis's value index, and the chosen axes."""
        return {a: self.index[a][id(v)] for a, v in values.items()}, frozenset(values)

    def get(self, rule: Rule, ids: tuple[dict[str, int], frozenset[str]]) -> list[Finding] | Undetermined | None:
        index, chosen = ids
        for needs, key, stopped, table in self.tables.get(rule, ()):
            if needs <= chosen:  # (else an axis this outcome depends on is not chosen here)
                hit = table.get((*key(index), chosen) if stopped else key(index))
                if hit is not None:
                    return hit
        return None

    def put(self, rule: Rule, seen: set, ids: tuple[dict[str, int], frozenset[str]],
            outcome: list[Finding] | Undetermined) -> None:
        index, chosen = ids
        axes, stopped = tuple(sorted(seen)), isinstance(outcome, Undetermined)
        key = tuple(index[a] for a in axes) + ((chosen,) if stopped else ())
        table = self._table.get((rule, axes, stopped))
        if table is None:
            table = self._table[(rule, axes, stopped)] = {}
            self.tables.setdefault(rule, []).append((frozenset(axes), _key(axes), stopped, table))
        table[key] = outcome


def _key(axes: tuple[str, ...]) -> Callable[[dict[str, int]], tuple[int, ...]]:
    """index -> tuple(index[a] for a in axes), as one C call where it can (Verdicts.get runs ~40,000 times
    a search)."""
    if len(axes) > 1:
        return itemgetter(*axes)
    if axes:
        return lambda index, a=axes[0]: (index[a],)
    return lambda index: ()


def judge_values(rules: list[Rule], values: dict[str, Any], context: Callable[[set], Context],
                 known: Verdicts, ids: tuple[dict[str, int], frozenset[str]] | None = None) -> Verdict:
    """judge() on the context of ``values``, built by ``context(seen)`` only when a rule is not
    ``known`` for these values (``ids``: known.ids(values), when the caller has it)."""
    ids, ctx, seen = ids or known.ids(values), None, set()
    verdict = Verdict(None, [], [])
    for rule in rules:
        findings = known.get(rule, ids)
        if findings is None:
            if ctx is None:
                ctx = context(seen)
            seen.clear()
            findings = try_rule(rule, ctx)
            if ANY not in seen:
                known.put(rule, seen, ids, findings)
        if _judged(verdict, rule, findings):
            return verdict
    return verdict


def judge(rules: list[Rule], ctx: Context) -> Verdict:
    verdict = Verdict(None, [], [])
    for rule in rules:
        if _judged(verdict, rule, try_rule(rule, ctx)):
            break
    return verdict


def _judged(verdict: Verdict, rule: Rule, findings: list[Finding] | Undetermined) -> bool:
    """Add a rule's outcome to the verdict; True once it holds an error (the rest need not run)."""
    if isinstance(findings, Undetermined):
        verdict.pending.append(rule)
        verdict.blocked[rule] = findings.axes
        return False
    for f in findings:
        if f.level == "error":
            verdict.error = (rule.__name__, f.message)
            return True
    verdict.warnings += [(rule.__name__, f.message) for f in findings]
    return False


def zero_choices(nvme_path: str | None) -> tuple[Zero, ...]:
    """Every ZeRO stage x optimizer offload x parameter offload (NVMe only when the spec names a path)."""
    devices = ("none", "cpu", "nvme") if nvme_path else ("none", "cpu")
    return tuple(Zero.model_construct(stage=s, offload_optimizer=o, offload_param=p, nvme_path=nvme_path)
                 for s in (0, 1, 2, 3) for o in devices for p in devices)


def spec_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """Dotted spec keys (for TrainingSpec.with_overrides) of a complete choice."""
    out = {f"parallel.{f}": values[a] for f, a in PARALLEL_FIELDS.items()}
    out.update({f"parallel.{f}": v for f, v in {**values["split"].fields(values["pp"]), **values["cpc"].fields()}.items()})
    z = values["zero"]
    out.update({f"zero.{f}": getattr(z, f) for f in ZERO_FIELDS})
    out.update({"batch.micro": values["micro"], "recompute": values["recompute"]})
    return out
