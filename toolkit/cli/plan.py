"""`toolkit plan`, `toolkit config`, `toolkit models`, `toolkit gpus`."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..errors import SpecError
from ..spec import TrainingSpec, parse_assignment
from . import app
from .tables import plan_label, plan_table

SetOpt = Annotated[list[str], typer.Option("--set", help="override a spec key: --set parallel.tp=4")]
out = Console(highlight=False, width=None if Console().is_terminal else 120)


def load_spec(path: Path, sets: list[str] | None) -> TrainingSpec:
    spec = TrainingSpec.from_yaml(path)
    return with_data_fill(spec.with_overrides(dict(parse_assignment(s) for s in sets)) if sets else spec)


def with_data_fill(spec: TrainingSpec) -> TrainingSpec:
    """data.fill, when the spec leaves it out, from what `toolkit data prepare --seq-len`
    recorded for train.data_path's chat data at the spec's seq_len (packed or not)."""
    from ..runtime.data import recorded_fill

    if spec.data.fill is not None:
        return spec
    fill = recorded_fill(spec.train.data_path, spec.batch.seq_len, spec.data.packing)
    return spec if fill is None else spec.with_overrides({"data.fill": round(fill, 4)})


@app.command("plan")
def plan_cmd(spec: Annotated[Path, typer.Argument(help="training spec (YAML)")],
             json_out: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
             auto: Annotated[bool, typer.Option("--auto", help="search every tp/pp/vpp/cp/ep/etp/sp/ZeRO/offload/"
                                                "micro/recompute layout and rank those that fit")] = False,
             top: Annotated[int, typer.Option("--top", min=1, help="with --auto: how many layouts to show")] = 5,
             explain: Annotated[bool, typer.Option("--explain", help="with --auto: list each rejected family "
                                                   "of layouts with the reason")] = False,
             sets: SetOpt = None,
             chart: Annotated[Path | None, typer.Option(
                 "--chart", help="also draw FILE.png + FILE.html: memory per stage vs the GPU's, step time split "
                                 "(with --auto: the top layouts side by side)")] = None,
             overwrite: Annotated[bool, typer.Option("--overwrite", help="with --chart: replace its files")] = False,
             ) -> None:
    """Validate a spec and estimate memory and step time. Exit 0 valid, 2 invalid.
    With --auto: the fastest layouts that fit (exit 2 when none does)."""
    from ..plan import make_plan

    if chart is not None:
        from ..charts.page import check_chart_paths

        check_chart_paths(chart, overwrite)
    if auto:
        return auto_cmd(load_spec(spec, sets), json_out, top, explain, chart, overwrite)
    if explain or top != 5:
        raise SpecError("--top and --explain go with --auto")
    plan = make_plan(load_spec(spec, sets))
    if json_out:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        out.print(plan_table(plan))
    if chart is not None:
        draw_plans([(plan_label(plan, "\n"), plan)] if plan.estimated else [], chart, overwrite)
    if not plan.valid:
        raise typer.Exit(2)


def estimate_warnings(candidates) -> list[str]:
    """The listed candidates' zero3_overlap warnings (make_plan's, after the estimate) in one line:
    each such candidate's step with none of ZeRO-3's traffic hidden (the JSON has every warning)."""
    from ..plan import ZERO3_OVERLAP_RULE, ZERO3_SOURCE, zero3_hidden_seconds

    steps = []
    for i, c in enumerate(candidates, 1):
        p = c.plan
        if any(f.rule == ZERO3_OVERLAP_RULE for f in p.findings):
            hidden, _ = zero3_hidden_seconds(p.spec, p.shape, p.layout, p.batch, p.gpu, p.time)
            steps.append(f"#{i} {p.time.step_time_s + hidden:.3g} s, not {p.time.step_time_s:.3g} s")
    if not steps:
        return []
    return [f"ZeRO-3's all-gathers and reduce-scatters are estimated hidden behind compute; {ZERO3_SOURCE}. "
            f"With none hidden: {'; '.join(steps)}"]


def draw_plans(labeled: list, chart: Path, overwrite: bool) -> None:
    """The --chart files, or a line on stderr saying why there is nothing to draw."""
    if not labeled:
        print("no chart: the layout's sizes do not come out, so nothing is estimated", file=sys.stderr)
        return
    from ..charts import plan_chart, write_chart

    fig, tables = plan_chart(labeled)
    png, page = write_chart(fig, tables, chart, f"{labeled[0][1].spec.model}: memory and step time",
                            overwrite=overwrite)
    print(f"wrote {png} and {page}", file=sys.stderr)


def auto_cmd(spec: TrainingSpec, json_out: bool, top: int, explain: bool, chart: Path | None = None,
             overwrite: bool = False) -> None:
    from ..plan import make_plan
    from ..search.search import SEARCHED_KEYS, search
    from .auto import auto_json, candidates_table, explain_table, spec_line, time_table

    result = search(spec, top=top)
    spec_plan = make_plan(spec) if spec.given_keys() & set(SEARCHED_KEYS) else None
    if json_out:
        print(json.dumps(auto_json(result, spec_plan, explain), indent=2))
    else:
        if explain:
            out.print(explain_table(result))
        out.print(candidates_table(spec, result, spec_plan))
        if spec_plan is not None:
            out.print(spec_line(result, spec_plan))
        if explain and (seconds := time_table(result, spec_plan)) is not None:
            out.print(seconds)
    if chart is not None:
        draw_plans([(f"#{i}\n{plan_label(c.plan, chr(10))}", c.plan) for i, c in enumerate(result.candidates, 1)],
                   chart, overwrite)
    for problem in result.mismatches:
        print(f"warning: search and make_plan disagree, layout dropped: {problem}", file=sys.stderr)
    if not json_out:  # (the JSON lists every candidate's warnings)
        for line in estimate_warnings(result.candidates):
            print(f"warning: {line}", file=sys.stderr)
    if not result.candidates:
        print(f"error: none of the {result.valid:,} valid layouts fits in memory"
              + ("" if explain else " (--explain says why)"), file=sys.stderr)
        raise typer.Exit(2)


@app.command("config")
def config_cmd(spec: Annotated[Path, typer.Argument(help="training spec (YAML)")],
               out_dir: Annotated[Path, typer.Option("--out", help="folder to create")],
               overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing folder")] = False,
               sets: SetOpt = None) -> None:
    """Write DeepSpeed, Megatron, accelerate and launch settings for a valid spec."""
    from ..atomic import check_output_dir
    from ..emit import write_artifacts
    from ..emit.launch import launch_warnings
    from ..plan import make_plan

    check_output_dir(out_dir, overwrite)  # before any work
    plan = make_plan(load_spec(spec, sets))
    if not plan.valid:
        out.print(plan_table(plan))
        raise typer.Exit(2)
    write_artifacts(plan, out_dir, overwrite=overwrite)
    out.print(plan_table(plan))
    out.print(f"wrote {', '.join(sorted(p.name for p in out_dir.iterdir()))} to {out_dir}")
    for warning in launch_warnings(plan):
        print(f"warning: {warning}", file=sys.stderr)


@app.command("models")
def models_cmd() -> None:
    """List the named models with their parameter counts."""
    from ..models import active_params, load_model, named_models, total_params

    tab = Table("name", "architecture", "params", "active", "HF repo")
    for name, entry in named_models().items():
        s = load_model(name)
        tab.add_row(name, s.architecture, f"{total_params(s):,}", f"{active_params(s):,}", entry["hf_repo"] or "-")
    out.print(tab)


@app.command("gpus")
def gpus_cmd() -> None:
    """List the GPU registry."""
    from ..hardware import GPUS

    tab = Table("name", "memory GiB", "bf16 TFLOP/s", "intra-node GB/s", "inter-node GB/s")
    for g in GPUS.values():
        tab.add_row(g.name, f"{g.memory_gib:.1f}", f"{g.bf16_tflops:.0f}", f"{g.intra_node_gbps:.0f}",
                    f"{g.inter_node_gbps:.0f}")
    out.print(tab)
