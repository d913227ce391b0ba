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

SetOpt = Annotated[list[str], typer.Option("--set", help="override a spec key: --set parallel.tp=4")]
out = Console(highlight=False, width=None if Console().is_terminal else 120)


def load_spec(path: Path, sets: list[str] | None) -> TrainingSpec:
    spec = TrainingSpec.from_yaml(path)
    return spec.with_overrides(dict(parse_assignment(s) for s in sets)) if sets else spec


def plan_table(plan) -> Table:
    d = plan.as_dict()
    lay, b, m, t = d["layout"], d["batch"], d["memory_gib"], d["time"]
    tab = Table(title=f"{plan.spec.model} on {d['cluster']['world']} x {plan.gpu.name}", show_header=False)
    tab.add_column(style="bold")
    tab.add_column()
    mdl = d["model"]
    tab.add_row("model", f"{mdl['architecture']}: {mdl['params']:,} params ({mdl['active_params']:,} active), "
                         f"vocab padded to {mdl['padded_vocab']:,}")
    experts = f" ep={lay['ep']} etp={lay['etp']}" if plan.shape.is_moe else ""
    expert_dp = f" (expert dp={lay['edp']})" if plan.shape.is_moe else ""
    tab.add_row("layout", f"tp={lay['tp']} pp={lay['pp']} vpp={lay['vpp']} cp={lay['cp']}{experts} -> "
                          f"dp={lay['dp']}{expert_dp}, "
                          f"sequence parallel {'on' if lay['sequence_parallel'] else 'off'}")
    tab.add_row("batch", f"global {b['global']} = micro {b['micro']} x accumulation {b['grad_accum']} x dp {lay['dp']}; "
                         f"seq_len {b['seq_len']}")
    z = d["zero"]
    tab.add_row("zero / precision", f"ZeRO-{z['stage']}, offload optimizer={z['offload_optimizer']} "
                                    f"param={z['offload_param']}; {d['precision']}; recompute {d['recompute']}")
    tab.add_row(f"memory / GPU (stage {m['worst_stage']})",
                f"params {m['params']:.2f} + grads {m['grads']:.2f} + optimizer {m['optimizer']:.2f} + "
                f"activations {m['activations']:.2f} + buffers {m['buffers']:.2f} = "
                f"[bold]{m['total']:.2f} GiB[/] of {m['gpu']:.1f} GiB ({'fits' if d['fits'] else 'DOES NOT FIT'})")
    if m["cpu_offloaded"]:
        tab.add_row("host memory / GPU", f"{m['cpu_offloaded']:.2f} GiB of offloaded model states")
    tab.add_row("model states (16 B/param)", f"{m['classic_model_states_total']:,.1f} GiB unsharded")
    comm = ", ".join(f"{k} {v:.3f}" for k, v in t["comm_s"].items() if v)
    sec = t["seconds"]
    work = ", ".join(f"{k} {sec[k]:.3f}" for k in ("gemm", "attention", "memory", "recompute", "optimizer") if sec[k])
    tab.add_row("step time", f"{t['step_time_s']:.3f} s (compute {t['compute_s']:.3f} s: {work}; exposed comm: "
                             f"{comm or 'none'}; bubble {t['bubble_fraction']:.1%}; slowest stage "
                             f"{t['slowest_stage']}; dominant: {t['dominant']})")
    tab.add_row("throughput", f"{t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%}, "
                              f"{t['model_tflops_per_step']:,.0f} TFLOP per step")
    tab.add_row("time to train", f"{t['train_tokens']:.3g} tokens in {t['time_to_train_days']:.1f} days")
    for w in d["warnings"]:
        tab.add_row("[yellow]warning[/]", w)
    for e in d["errors"]:
        tab.add_row("[red]error[/]", e)
    return tab


@app.command("plan")
def plan_cmd(spec: Annotated[Path, typer.Argument(help="training spec (YAML)")],
             json_out: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
             auto: Annotated[bool, typer.Option("--auto", help="search every tp/pp/vpp/cp/ep/etp/sp/ZeRO/offload/"
                                                "micro/recompute layout and rank those that fit")] = False,
             top: Annotated[int, typer.Option("--top", min=1, help="with --auto: how many layouts to show")] = 5,
             explain: Annotated[bool, typer.Option("--explain", help="with --auto: list each rejected family "
                                                   "of layouts with the reason")] = False,
             sets: SetOpt = None) -> None:
    """Validate a spec and estimate memory and step time. Exit 0 valid, 2 invalid.
    With --auto: the fastest layouts that fit (exit 2 when none does)."""
    from ..plan import make_plan

    if auto:
        return auto_cmd(load_spec(spec, sets), json_out, top, explain)
    if explain or top != 5:
        raise SpecError("--top and --explain go with --auto")
    plan = make_plan(load_spec(spec, sets))
    if json_out:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        out.print(plan_table(plan))
    if not plan.valid:
        raise typer.Exit(2)


def auto_cmd(spec: TrainingSpec, json_out: bool, top: int, explain: bool) -> None:
    from ..plan import make_plan
    from ..plan.search import SEARCHED_KEYS, search
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
    for problem in result.mismatches:
        print(f"warning: search and make_plan disagree, layout dropped: {problem}", file=sys.stderr)
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
    from ..emit import write_artifacts
    from ..plan import make_plan

    plan = make_plan(load_spec(spec, sets))
    if not plan.valid:
        out.print(plan_table(plan))
        raise typer.Exit(2)
    write_artifacts(plan, out_dir, overwrite=overwrite)
    out.print(plan_table(plan))
    out.print(f"wrote {', '.join(sorted(p.name for p in out_dir.iterdir()))} to {out_dir}")


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
